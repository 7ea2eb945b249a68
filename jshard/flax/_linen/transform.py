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

from jshard._sharding.nested import get_in, set_in
from jshard._sharding.policies import FullyShardPolicy
from jshard._sharding.step_state import StepState, active_step
from jshard._sharding.unit import FSDPUnit, is_unit
from jshard._step.unit_gather import gather_for_compute, per_layer
from jshard.flax._linen.stacked import own_unboxed
from jshard.flax._paths import Path, entry_paths, scope_path


@dataclasses.dataclass
class StepTable:
    """The Linen adapter's part of the step state ([Note: step state]): the units of the step
    by scope path, how deep each module's calls are nested, which units were gathered, and
    whether a 1F1B pipeline's ``loss`` is being traced (no unit may gather there, [Note: Linen
    pipeline])."""

    units: dict[Path, FSDPUnit]
    depth: dict[Path, int] = dataclasses.field(default_factory=dict)
    gathered: set[Path] = dataclasses.field(default_factory=set)
    pipeline_loss: bool = False


@dataclasses.dataclass
class Discovered:
    """What ``shard_params`` learns from abstract calls: each wrapped module's spec and, in a
    call where the wrapped modules (``units``) are known and the params boxed, the axes lifted
    transforms removed from its own params ([Note: Linen stacking])."""

    specs: dict[Path, tuple[Any, FullyShardPolicy]] = dataclasses.field(default_factory=dict)
    units: tuple[Path, ...] = ()
    stacked: dict[Path, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    stages: dict[Path, str] = dataclasses.field(default_factory=dict)  # pipeline stacks: their stage axis


# ``shard_params``'s abstract call is no step: ``model.apply`` cannot carry what it collects.
_DISCOVERED: contextvars.ContextVar[Discovered | None] = contextvars.ContextVar("jshard_linen_discovered", default=None)


def linen_step() -> tuple[StepState, StepTable] | None:
    """The active step and its Linen table, when ``jshard.flax.linen`` started it."""
    step = active_step()
    if step is None or not isinstance(step.adapter, StepTable):
        return None
    return step, step.adapter


def discovered() -> Discovered | None:
    """What the abstract call of ``shard_params`` running now has found, else ``None``."""
    return _DISCOVERED.get()


@contextlib.contextmanager
def discovering(units: tuple[Path, ...] = ()) -> Iterator[Discovered]:
    token = _DISCOVERED.set(Discovered(units=units))
    try:
        yield _DISCOVERED.get()
    finally:
        _DISCOVERED.reset(token)


def gather_params(unit: FSDPUnit, params: dict, step: StepState, path: Path) -> dict:
    """``params`` (this module's shards, or one layer of them) with its own leaves gathered."""
    meta, entries = unit.meta, entry_paths(unit.tree)
    values = [None if is_unit(x) else get_in(params, where) for where, x in entries]
    own = [i for i, (_, x) in enumerate(entries) if not is_unit(x)]
    # A wrapped unit with scan_axis=0 (set by shard_params where the module's calls saw one
    # layer of its params, or by the user) is only ever called inside nn.scan: one layer.
    layer = meta.policy.scan_axis == 0
    full = gather_for_compute(meta, values, step, layer=layer, not_in_step=_not_a_unit(path))
    for i in own:
        params = set_in(params, entries[i][0], full[i])
    return params


def _has_unit(tree: Any) -> bool:
    return any(is_unit(x) for x in jax.tree.leaves(tree, is_leaf=is_unit))


def _map_in(path: Path, spec: tuple[Any, FullyShardPolicy], target: dict) -> dict:
    found, in_step = _DISCOVERED.get(), linen_step()
    if found is not None:
        found.specs[path] = spec
        if not found.units or "params" not in target:
            return target
        params, found.stacked[path] = own_unboxed(target["params"], path, found.units)
        return {**target, "params": params}
    if in_step is None:
        if _has_unit(target):
            raise RuntimeError(
                f"Linen module at `{scope_path(path)}` is fully sharded and was called outside the step "
                "with sharded parameters: call it inside jshard.flax.linen.value_and_grad, or pass full "
                "parameters for evaluation (model.apply({'params': js.unshard(params)}, ...))."
            )
        return target  # init, or evaluation with full parameters
    step, table = in_step
    if table.depth.get(path, 0) > 1:  # a registered method calling another: already gathered
        return target
    if path not in table.units:
        raise ValueError(_not_a_unit(path))
    if table.pipeline_loss:
        raise ValueError(_in_pipeline_loss(path, table.units[path]))
    table.gathered.add(path)
    return {**target, "params": gather_params(table.units[path], target["params"], step, path)}


def _in_pipeline_loss(path: Path, unit: FSDPUnit) -> str:
    where, layout = next((w, lay) for (w, _), lay in zip(entry_paths(unit.tree), unit.meta.layouts, strict=True)
                         if lay is not None)
    return (
        f"Linen module at `{scope_path(path)}` is wrapped with jshard.flax.linen.fully_shard and was called in the "
        f"loss of a jlinen.pipeline stack under PipelinePolicy(schedule='1f1b'): its params (`{scope_path(where)}` "
        f"of shape {layout.shape}, ...) are sharded over mesh axis {unit.meta.axes.shard_entry!r} of size "
        f"{unit.meta.axes.shard_size}, and a gather there would run per microbatch inside the schedule (M gathers and "
        "reduce-scatters of its params, where the root's call gathers them once). Make it a plain submodule of "
        "the wrapped root (not wrapped itself): the root's "
        "call gathers it before the stack runs."
    )


def _not_a_unit(path: Path) -> str:
    return (
        f"Linen module at `{scope_path(path)}` is wrapped with jshard.flax.linen.fully_shard but its "
        "parameters are not a unit of the step: build the sharded params with "
        "jshard.flax.linen.shard_params(model, params, *example_args)."
    )


def fsdp(fn: Any, mesh: Any, policy: FullyShardPolicy) -> Any:
    """The lifted transform applied by ``jshard.flax.linen.fully_shard`` (see the Note).

    Linen names the transformed class after it: ``Fsdp<Name>``.
    """

    def wrapped(scopes: Any, *args: Any, **kwargs: Any) -> Any:
        scope = scopes[0] if isinstance(scopes, (list, tuple)) else scopes
        path = tuple(scope.path)
        in_step = linen_step()
        inner = lift.map_variables(fn, "params", lambda t: _map_in(path, (mesh, policy), t), init=True)
        unit = in_step[1].units.get(path) if in_step is not None else None
        if unit is None:
            return inner(scopes, *args, **kwargs)
        step, table = in_step
        mp = unit.meta.policy.mp_policy
        args, kwargs = mp.cast_inputs((args, kwargs))
        if unit.meta.policy.scan_axis == 0:  # called per layer, inside nn.scan
            inner = per_layer(step, inner, lift.checkpoint)
        table.depth[path] = table.depth.get(path, 0) + 1
        try:
            return mp.cast_outputs(inner(scopes, *args, **kwargs))
        finally:
            table.depth[path] -= 1

    return wrapped
