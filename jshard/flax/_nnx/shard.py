"""``fully_shard`` for NNX modules: validation, the unit, and the class change."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from jshard._sharding.fully_shard import fully_shard as fully_shard_tree
from jshard._sharding.local_shapes import local_shapes
from jshard._sharding.mesh import make_mesh
from jshard._sharding.nested import nest
from jshard._sharding.policies import FullyShardPolicy
from jshard._sharding.stages import stage_layers
from jshard._sharding.unit import is_unit
from jshard.flax._nnx.forward import GuardedParam, forward_method, guarded_class
from jshard.flax._nnx.graph import UnitState, build_unit, describe, member_of, node_at, set_unit_state, unit_state, walk
from jshard.flax._nnx.module import FSDPModule
from jshard.flax._paths import Path, attribute_path, entry_paths


@functools.cache
def fsdp_class(base: type, methods: tuple[str, ...]) -> type:
    """``FSDP<Name>(FSDPModule, Name)`` whose ``methods`` gather parameters (one class per base and methods)."""
    namespace = {name: forward_method(name) for name in methods}
    namespace.update(_jshard_base=base, _jshard_methods=methods, __module__=base.__module__)
    return type(f"FSDP{base.__name__}", (FSDPModule, base), namespace)


def _where(module: Any, path: Path) -> str:
    return f"`{attribute_path(path)}` of {describe(module)}"


def _shared_error(module: Any, path: Path, other: str, what: str = "Module") -> ValueError:
    return ValueError(
        f"{what} {_where(module, path)} is shared by two parents (it is also {other}): a unit's "
        "parameters must have one owner, or they would be gathered and reduced as two copies. "
        "Shard the smallest module that contains every use instead (FSDP units form a tree), or "
        "give each parent its own copy."
    )


def _collect(module: Any) -> tuple[list[tuple[Path, Any]], list[tuple[Path, Any]]]:
    """The module's own Params and its top-most sharded sub-modules, after the sharing checks."""
    subs: dict[int, tuple[Path, Any]] = {}
    own_ids: dict[int, Path] = {}
    for path, node in walk(module):
        if unit_state(node) is not None:
            if id(node) in subs:
                raise _shared_error(module, path, f"at `{attribute_path(subs[id(node)][0])}`")
            if unit_state(node).parent is not None:
                raise _shared_error(module, path, f"{unit_state(node).parent}, sharded earlier")
            subs[id(node)] = (path, node)
        elif isinstance(node, nnx.Param):
            own_ids.setdefault(id(node), path)
        elif isinstance(node, nnx.Module) and member_of(node) is not None:
            owner, where = member_of(node)
            raise _shared_error(module, path, f"`{where}` in the unit of {owner}")
    for sub_path, sub in subs.values():
        for path, node in walk(sub, sub_path, stop_at_units=False):
            if isinstance(node, nnx.Param) and id(node) in own_ids:
                other = f"`{attribute_path(path)}` inside the sharded `{attribute_path(sub_path)}`"
                raise _shared_error(module, own_ids[id(node)], other, what="Param")
    sub_paths = [p for p, _ in subs.values()]
    flat = nnx.to_flat_state(nnx.state(module, nnx.Param))
    own = [(p, node_at(module, p)) for p, _ in flat if not any(p[: len(s)] == s for s in sub_paths)]
    return own, sorted(subs.values(), key=lambda item: item[0])


def _check_can_shard(module: Any) -> None:
    if not isinstance(module, nnx.Module):
        raise TypeError(f"jshard.flax.nnx.fully_shard takes an nnx.Module, got {type(module).__name__}.")
    if unit_state(module) is not None:
        raise RuntimeError(f"{describe(module)} is already fully sharded: call fully_shard once per module.")
    if member_of(module) is not None:
        owner, where = member_of(module)
        raise RuntimeError(
            f"Module `{where}` ({type(module).__name__}) already belongs to the unit of {owner}, which was "
            f"sharded before it: apply fully_shard bottom-up, to `{where}` before its root (re-create the "
            "model and shard the blocks first, then the root)."
        )


def _guard(param: Any, layout: Any, meta: Any) -> None:
    """A Param whose shard can be told from the parameter becomes a ``Sharded<Name>``
    ([Note: guarded Params])."""
    if local_shapes(layout, meta.axes, meta.policy.scan_axis, meta.axes).shard_reads:
        param.__class__ = guarded_class(type(param))
        param.set_metadata(jshard_layout=(layout, meta.axes, meta.policy.scan_axis))


def _stamp(module: Any, subs: list[tuple[Path, Any]]) -> None:
    """Record, for later checks and messages, who owns what."""
    owner = describe(module)
    other_owner = owner.replace("the root module", "another root module")  # as the next fully_shard names it
    for path, node in walk(module):
        if isinstance(node, nnx.Module) and unit_state(node) is None:
            object.__setattr__(node, "_jshard_member", (owner, attribute_path(path)))
    for path, node in walk(module, stop_at_units=False):
        if isinstance(node, GuardedParam):
            node.set_metadata(jshard_path=attribute_path(path))
    for sub_path, sub in subs:
        parent = f"`{attribute_path(sub_path)}` of {other_owner}"
        set_unit_state(sub, dataclasses.replace(unit_state(sub), parent=parent))
    for path, node in nnx.iter_modules(module):
        if path and unit_state(node) is not None:
            set_unit_state(node, unit_state(node).placed_at(path))


def fully_shard(module: Any, mesh: Mesh | None = None, policy: FullyShardPolicy | None = None, *,
                stages: str | None = None) -> Any:
    """Shard an NNX module's parameters as one unit, in place (FSDP2's ``fully_shard``).

    Apply it bottom-up: to each block, then to the root. The module's own ``nnx.Param``
    values (those not inside a module sharded before) become the leaves of one
    :class:`jshard.FSDPUnit`: each Param now holds its padded shard array, and the
    module's class becomes ``FSDP<Name>``, whose ``__call__`` gathers the parameters
    just in time inside :func:`jshard.flax.nnx.value_and_grad` and reshards after
    forward per the policy; gradients are reduce-scattered per module. A module whose
    Params are stacked along axis 0 (``nnx.vmap``) takes
    ``FullyShardPolicy(scan_axis=0)``; called inside ``nnx.scan`` it gathers one layer
    per iteration.

    Args:
      module: an ``nnx.Module``; sharded modules inside it stay their own units.
      mesh: the mesh (default :func:`jshard.make_mesh`).
      policy: a :class:`jshard.FullyShardPolicy` (default ``FullyShardPolicy()``).
      stages: a mesh axis: lay the stacked Params out as pipeline stages over it
        (:func:`jshard.stage_layers`) for :func:`jshard.flax.nnx.pipeline`; needs
        ``policy.scan_axis=0``.

    Returns:
      ``module`` itself, now also an :class:`jshard.flax.nnx.FSDPModule`.

    Raises:
      RuntimeError: the module is already sharded, or belongs to a unit sharded before it.
      ValueError: a module or Param shared by two units, an empty module, or an
        invalid leaf (see :func:`jshard.fully_shard`).

    Example:
      >>> from flax import nnx
      >>> from jshard.flax import nnx as jnnx
      >>> class MLP(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.blocks = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(2)])
      ...         self.head = nnx.Linear(4, 1, rngs=rngs)
      >>> model = MLP(nnx.Rngs(0))
      >>> for block in model.blocks:
      ...     _ = jnnx.fully_shard(block)
      >>> model = jnnx.fully_shard(model)
      >>> model.head.kernel.get_value().sharding.spec[0], model.blocks[1].kernel.get_value().shape
      ('fsdp', (8, 4))
    """
    _check_can_shard(module)
    own, subs = _collect(module)
    items = [(p, v.get_value()) for p, v in own] + [(p, build_unit(s)) for p, s in subs]
    if not items:
        raise ValueError(f"{describe(module)} has no nnx.Param to shard: shard a module that owns parameters.")
    mesh = make_mesh() if mesh is None else mesh
    tree = nest(items) if stages is None else stage_layers(nest(items), mesh, stages)
    unit = fully_shard_tree(tree, mesh, policy)
    entries = entry_paths(unit.tree)
    for (path, x), layout in zip(entries, unit.meta.layouts, strict=True):
        if not is_unit(x):
            node_at(module, path).set_value(x)
            _guard(node_at(module, path), layout, unit.meta)
    state = UnitState(
        meta=unit.meta,
        entries=tuple((path, is_unit(x)) for path, x in entries),
        cls_name=type(module).__name__,
    )
    module.__class__ = fsdp_class(type(module), ("__call__",))
    set_unit_state(module, state)
    _stamp(module, subs)
    return module


def register_fsdp_forward_method(module: Any, method_name: str) -> None:
    """Gather a sharded module's parameters for ``method_name`` too (e.g. ``generate``).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jshard.flax import nnx as jnnx
      >>> embed = jnnx.fully_shard(nnx.Embed(10, 4, rngs=nnx.Rngs(0)))
      >>> jnnx.register_fsdp_forward_method(embed, "attend")
      >>> type(embed)._jshard_methods
      ('__call__', 'attend')
    """
    state = unit_state(module)
    if state is None:
        raise ValueError(
            f"register_fsdp_forward_method got {type(module).__name__}, which is not fully sharded: "
            "call jshard.flax.nnx.fully_shard(module) first."
        )
    cls = type(module)
    if not callable(getattr(cls._jshard_base, method_name, None)):
        raise ValueError(f"{describe(module)} has no method `{method_name}` to register.")
    if method_name not in cls._jshard_methods:
        module.__class__ = fsdp_class(cls._jshard_base, (*cls._jshard_methods, method_name))
