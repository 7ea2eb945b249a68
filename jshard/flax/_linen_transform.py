"""The Linen module transform: a wrapped module gathers its own parameters when called.

[Note: Linen unit] ``jshard.flax.linen.fully_shard(Block)`` is a lifted transform, like
``nn.remat``: every call of a ``Block`` runs under ``flax.core.lift.map_variables`` on
the ``params`` collection, whose ``map_in`` turns the module's parameters from this
device's shards into full arrays (``js.unshard`` of the module's unit, in the core's local
view). The unit is found by the module's scope path in the step's table (the sharded
params tree is keyed the same way). Inside ``nn.scan`` the module sees one layer of a
stacked unit and gathers that layer, in a checkpoint so that it is re-gathered in
backward rather than saved (as :func:`jshard.scan` does).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax.core import lift

from jshard import _context
from jshard._api import FullyShardPolicy
from jshard._local import gather_entries, is_layer_slice
from jshard._unit import FSDPUnit, is_unit

Path = tuple[str, ...]


@dataclasses.dataclass
class StepTable:
    """The units of the step by scope path, and which of them were gathered."""

    units: dict[Path, FSDPUnit]
    depth: dict[Path, int] = dataclasses.field(default_factory=dict)
    gathered: set[Path] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class Plan:
    """What ``shard_params`` learns from an abstract call: each wrapped module's spec and
    the shapes its parameters had inside the call (one layer's, inside ``nn.scan``)."""

    specs: dict[Path, tuple[Any, FullyShardPolicy]] = dataclasses.field(default_factory=dict)
    seen: dict[Path, Any] = dataclasses.field(default_factory=dict)


_TABLE: contextvars.ContextVar[StepTable | None] = contextvars.ContextVar("jshard_linen_step", default=None)
_PLAN: contextvars.ContextVar[Plan | None] = contextvars.ContextVar("jshard_linen_plan", default=None)


@contextlib.contextmanager
def step_table(table: StepTable) -> Iterator[StepTable]:
    token = _TABLE.set(table)
    try:
        yield table
    finally:
        _TABLE.reset(token)


@contextlib.contextmanager
def planning() -> Iterator[Plan]:
    token = _PLAN.set(Plan())
    try:
        yield _PLAN.get()
    finally:
        _PLAN.reset(token)


def format_path(path: Path) -> str:
    return "/".join(path) or "<root>"


def _get(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple, value: Any) -> dict:
    """A copy of ``tree`` with ``value`` at ``path`` (dicts along the path are copied)."""
    if not path:
        return value
    out = dict(tree)
    out[path[0]] = _set(tree[path[0]], path[1:], value)
    return out


def _entries(unit: FSDPUnit) -> list[tuple[tuple, Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(unit.tree, is_leaf=is_unit)
    return [(tuple(k.key for k in keys), x) for keys, x in flat]


def gather_params(unit: FSDPUnit, params: dict, view: Any) -> dict:
    """``params`` (this module's shards, or one layer of them) with its own leaves gathered."""
    meta, entries = unit.meta, _entries(unit)
    values = [None if is_unit(x) else _get(params, path) for path, x in entries]
    own = [i for i, (_, x) in enumerate(entries) if not is_unit(x)]
    if view.pregathered or not own:
        return params
    layer = any(is_layer_slice(values[i], meta.layouts[i], meta.policy) for i in own)
    full = gather_entries(meta, values, view, layer=layer)
    for i in own:
        params = _set(params, entries[i][0], full[i])
    return params


def _has_unit(tree: Any) -> bool:
    return any(is_unit(x) for x in jax.tree.leaves(tree, is_leaf=is_unit))


def _map_in(path: Path, spec: tuple[Any, FullyShardPolicy], target: dict) -> dict:
    plan, table = _PLAN.get(), _TABLE.get()
    if plan is not None:
        plan.specs[path] = spec
        plan.seen[path] = jax.tree.map(lambda x: x.shape, target.get("params", {}))
        return target
    if table is None or _context.current() is None:
        if _has_unit(target):
            raise RuntimeError(
                f"Linen module at `{format_path(path)}` is fully sharded and was called outside the step "
                "with sharded parameters: call it inside jshard.flax.linen.value_and_grad, or pass full "
                "parameters for evaluation (model.apply({'params': js.unshard(params)}, ...))."
            )
        return target  # init, or evaluation with full parameters
    if table.depth.get(path, 0) > 1:  # a registered method calling another: already gathered
        return target
    if path not in table.units:
        raise ValueError(
            f"Linen module at `{format_path(path)}` is wrapped with jshard.flax.linen.fully_shard but its "
            "parameters are not a unit of the step: build the sharded params with "
            "jshard.flax.linen.shard_params(model, params, *example_args)."
        )
    table.gathered.add(path)
    return {**target, "params": gather_params(table.units[path], target["params"], _context.current())}


def _cast(tree: Any, dtype: Any) -> Any:
    if dtype is None:
        return tree
    return jax.tree.map(
        lambda x: x.astype(dtype) if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def fsdp(fn: Any, mesh: Any, policy: FullyShardPolicy) -> Any:
    """The lifted transform applied by ``jshard.flax.linen.fully_shard`` (see the Note).

    Linen names the transformed class after it: ``Fsdp<Name>``.
    """

    def wrapped(scopes: Any, *args: Any, **kwargs: Any) -> Any:
        scope = scopes[0] if isinstance(scopes, (list, tuple)) else scopes
        path = tuple(scope.path)
        table = _TABLE.get()
        inner = lift.map_variables(fn, "params", lambda t: _map_in(path, (mesh, policy), t), init=True)
        unit = table.units.get(path) if table is not None and _context.current() is not None else None
        if unit is None:
            return inner(scopes, *args, **kwargs)
        mp = unit.meta.policy.mp_policy
        if mp.cast_forward_inputs:
            args, kwargs = _cast((args, kwargs), mp.param_dtype)
        if unit.meta.policy.scan_axis == 0 and _context.current().reshard[id(unit.meta)] is not False:
            inner = lift.checkpoint(inner, policy=_context.current().remat_policy)
        table.depth[path] = table.depth.get(path, 0) + 1
        try:
            return _cast(inner(scopes, *args, **kwargs), mp.output_dtype)
        finally:
            table.depth[path] -= 1

    return wrapped
