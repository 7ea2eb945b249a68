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
from flax.core import lift

from jshard._sharding.dtypes import cast_floating
from jshard._sharding.nested import get_in, set_in
from jshard._sharding.policies import FullyShardPolicy
from jshard._sharding.unit import FSDPUnit, is_unit
from jshard._sharding.views import current_view
from jshard._step.gather import is_layer_slice, step_reshard
from jshard._step.unit_gather import gather_entries
from jshard.flax._linen.stacked import own_unboxed
from jshard.flax._paths import Path, entry_paths, scope_path


@dataclasses.dataclass
class StepTable:
    """The units of the step by scope path, and which of them were gathered."""

    units: dict[Path, FSDPUnit]
    depth: dict[Path, int] = dataclasses.field(default_factory=dict)
    gathered: set[Path] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class Discovered:
    """What ``shard_params`` learns from abstract calls: each wrapped module's spec and, in a
    call where the wrapped modules (``units``) are known and the params boxed, the axes lifted
    transforms removed from its own params ([Note: Linen stacking])."""

    specs: dict[Path, tuple[Any, FullyShardPolicy]] = dataclasses.field(default_factory=dict)
    units: tuple[Path, ...] = ()
    stacked: dict[Path, tuple[int, ...]] = dataclasses.field(default_factory=dict)


_TABLE: contextvars.ContextVar[StepTable | None] = contextvars.ContextVar("jshard_linen_step", default=None)
_DISCOVERED: contextvars.ContextVar[Discovered | None] = contextvars.ContextVar("jshard_linen_discovered", default=None)


@contextlib.contextmanager
def step_table(table: StepTable) -> Iterator[StepTable]:
    token = _TABLE.set(table)
    try:
        yield table
    finally:
        _TABLE.reset(token)


@contextlib.contextmanager
def discovering(units: tuple[Path, ...] = ()) -> Iterator[Discovered]:
    token = _DISCOVERED.set(Discovered(units=units))
    try:
        yield _DISCOVERED.get()
    finally:
        _DISCOVERED.reset(token)


def gather_params(unit: FSDPUnit, params: dict, view: Any) -> dict:
    """``params`` (this module's shards, or one layer of them) with its own leaves gathered."""
    meta, entries = unit.meta, entry_paths(unit.tree)
    values = [None if is_unit(x) else get_in(params, path) for path, x in entries]
    own = [i for i, (_, x) in enumerate(entries) if not is_unit(x)]
    if view.pregathered or not own:
        return params
    layer = any(is_layer_slice(values[i], meta.layouts[i], meta.policy) for i in own)
    full = gather_entries(meta, values, view, layer=layer)
    for i in own:
        params = set_in(params, entries[i][0], full[i])
    return params


def _has_unit(tree: Any) -> bool:
    return any(is_unit(x) for x in jax.tree.leaves(tree, is_leaf=is_unit))


def _map_in(path: Path, spec: tuple[Any, FullyShardPolicy], target: dict) -> dict:
    found, table = _DISCOVERED.get(), _TABLE.get()
    if found is not None:
        found.specs[path] = spec
        if not found.units or "params" not in target:
            return target
        params, found.stacked[path] = own_unboxed(target["params"], path, found.units)
        return {**target, "params": params}
    if table is None or current_view() is None:
        if _has_unit(target):
            raise RuntimeError(
                f"Linen module at `{scope_path(path)}` is fully sharded and was called outside the step "
                "with sharded parameters: call it inside jshard.flax.linen.value_and_grad, or pass full "
                "parameters for evaluation (model.apply({'params': js.unshard(params)}, ...))."
            )
        return target  # init, or evaluation with full parameters
    if table.depth.get(path, 0) > 1:  # a registered method calling another: already gathered
        return target
    if path not in table.units:
        raise ValueError(
            f"Linen module at `{scope_path(path)}` is wrapped with jshard.flax.linen.fully_shard but its "
            "parameters are not a unit of the step: build the sharded params with "
            "jshard.flax.linen.shard_params(model, params, *example_args)."
        )
    table.gathered.add(path)
    return {**target, "params": gather_params(table.units[path], target["params"], current_view())}


def fsdp(fn: Any, mesh: Any, policy: FullyShardPolicy) -> Any:
    """The lifted transform applied by ``jshard.flax.linen.fully_shard`` (see the Note).

    Linen names the transformed class after it: ``Fsdp<Name>``.
    """

    def wrapped(scopes: Any, *args: Any, **kwargs: Any) -> Any:
        scope = scopes[0] if isinstance(scopes, (list, tuple)) else scopes
        path = tuple(scope.path)
        table = _TABLE.get()
        inner = lift.map_variables(fn, "params", lambda t: _map_in(path, (mesh, policy), t), init=True)
        unit = table.units.get(path) if table is not None and current_view() is not None else None
        if unit is None:
            return inner(scopes, *args, **kwargs)
        mp = unit.meta.policy.mp_policy
        if mp.cast_forward_inputs:
            args, kwargs = cast_floating((args, kwargs), mp.param_dtype)
        if unit.meta.policy.scan_axis == 0 and step_reshard(unit.meta) is not False:
            inner = lift.checkpoint(inner, policy=current_view().remat_policy)
        table.depth[path] = table.depth.get(path, 0) + 1
        try:
            return cast_floating(inner(scopes, *args, **kwargs), mp.output_dtype)
        finally:
            table.depth[path] -= 1

    return wrapped
