"""Where a sharded NNX module's parameters are: paths, ownership, and its unit tree.

[Note: NNX unit] ``fully_shard(module)`` makes the module's own ``nnx.Param`` values (those
not inside an already sharded sub-module) the leaves of one :class:`jshard.FSDPUnit`; the
sub-modules sharded before it sit in that unit's tree as sub-units, at their attribute
paths. The unit tree is a nested dict keyed like the module graph (``{"attn": {"q":
{"kernel": ...}}, "blocks": {0: FSDPUnit}}``). The Params hold the stored (padded,
sharded) arrays; the unit's static facts (:class:`jshard._sharding.unit.UnitMeta`) and the order of
its entries live in the module's static ``_jshard`` attribute (a :class:`UnitState`), so
they travel through ``nnx.split`` / ``nnx.merge``, ``nnx.jit`` and ``nnx.scan`` unchanged,
and the unit is rebuilt from the Params whenever the step needs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from flax import nnx

from jshard._sharding.nested import nest
from jshard._sharding.unit import FSDPUnit, UnitMeta
from jshard.flax._paths import Path, attribute_path


@dataclasses.dataclass(frozen=True)
class UnitState:
    """The static facts of a sharded module (hashable: it is part of its graphdef).

    ``entries`` are the unit's own entries in tree order: ``(relative path, is_sub)``;
    ``meta.layouts[i]`` describes entry ``i`` (``None`` for a sub-unit). ``path`` is the
    module's path in the outermost sharded module that contains it (``()`` for that one),
    and the prefetch lists hold such paths: a module is known by where it is, so two
    identically built models have equal graphdefs (and share ``nnx.jit``'s cache).
    """

    meta: UnitMeta
    entries: tuple[tuple[Path, bool], ...]
    cls_name: str
    path: Path = ()
    parent: str | None = None
    forward_prefetch: tuple[Path, ...] = ()
    backward_prefetch: tuple[Path, ...] = ()
    requires_gradient_sync: bool = True
    requires_all_reduce: bool = True
    reshard_after_backward: bool = True
    unsharded: bool = False

    @property
    def name(self) -> str:
        """The module's path printed for messages (``blocks[0].attn``; ``''`` for the outermost)."""
        return attribute_path(self.path)

    def placed_at(self, path: Path) -> UnitState:
        """These facts for the module now at ``path`` in a new outermost sharded module: its own
        path and its prefetch targets' rebased (they were paths in the outermost one before)."""
        prefix = path[: len(path) - len(self.path)]
        return dataclasses.replace(self, path=path, forward_prefetch=tuple(prefix + p for p in self.forward_prefetch),
                                   backward_prefetch=tuple(prefix + p for p in self.backward_prefetch))


def describe(module: Any) -> str:
    """How messages name a sharded module: its path and class."""
    state = unit_state(module)
    if state is None:
        return f"module {type(module).__name__}"
    where = f"`{state.name}`" if state.name else "the root module"
    return f"{where} ({state.cls_name})"


def unit_state(module: Any) -> UnitState | None:
    return vars(module).get("_jshard") if isinstance(module, nnx.Module) else None


def set_unit_state(module: Any, state: UnitState) -> None:
    object.__setattr__(module, "_jshard", state)


def member_of(module: Any) -> tuple[str, str] | None:
    """``(owner description, path in owner)`` for a plain module inside some unit."""
    return vars(module).get("_jshard_member")


def child(node: Any, key: Any) -> Any:
    return dict(nnx.iter_children(node))[key]


def node_at(node: Any, path: Path) -> Any:
    for key in path:
        node = child(node, key)
    return node


def walk(node: Any, path: Path = (), stop_at_units: bool = True) -> Iterator[tuple[Path, Any]]:
    """Every ``(path, node)`` below ``node``, shared nodes once per path they are reached at.

    Does not descend into sharded sub-modules when ``stop_at_units`` (they are yielded).
    """
    for key, value in nnx.iter_children(node):
        sub = (*path, key)
        yield sub, value
        if isinstance(value, nnx.Variable):
            continue
        if stop_at_units and unit_state(value) is not None:
            continue
        yield from walk(value, sub, stop_at_units)


def own_variables(module: Any) -> list[Any]:
    """The module's own entries: its Params, and its sharded sub-modules, in unit order."""
    state = unit_state(module)
    return [node_at(module, path) for path, _ in state.entries]


def build_unit(module: Any) -> FSDPUnit:
    """The module's unit from the current values of its Params (recursively)."""
    state = unit_state(module)
    items = [
        (path, build_unit(node) if is_sub else node.get_raw_value())
        for (path, is_sub), node in zip(state.entries, own_variables(module), strict=True)
    ]
    return FSDPUnit(nest(items), state.meta)


def unit_leaf_paths(module: Any, prefix: Path = ()) -> list[Path]:
    """Absolute paths of the leaves of ``build_unit(module)``, in ``jax.tree.leaves`` order."""
    state = unit_state(module)
    out: list[Path] = []
    for (path, is_sub), node in zip(state.entries, own_variables(module), strict=True):
        out.extend(unit_leaf_paths(node, prefix + path) if is_sub else [prefix + path])
    return out


def sharded_modules(module: Any) -> list[tuple[Path, Any]]:
    """Every sharded module in the graph (each once), with its path."""
    return [(path, m) for path, m in nnx.iter_modules(module) if unit_state(m) is not None]


def module_at(root: Any, path: Path, requester: Any) -> Any:
    """The sharded module at ``path`` in the outermost sharded module that holds ``requester``
    (both found in ``root``, the model of this step)."""
    for _, outermost in sharded_modules(root):
        if unit_state(outermost).path:
            continue
        inside = dict(sharded_modules(outermost))
        if any(m is requester for m in inside.values()):
            if path in inside:
                return inside[path]
            break
    raise ValueError(
        f"{describe(requester)} prefetches `{attribute_path(path)}`, which is not a sharded module of its model in "
        "this step; pass modules of the same model to set_modules_to_forward_prefetch."
    )
