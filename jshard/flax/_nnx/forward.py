"""Just-in-time gathering around a sharded NNX module's forward methods.

``fully_shard`` changes a module's class to ``FSDP<Name>(FSDPModule, Name)`` (FSDP2 does the
same), so ``module(x)`` goes through :func:`forward`: inside the step it gathers the
module's own parameters (``js.unshard`` of its unit, in the core's local view), runs the
original method, and puts the shards back. The class is part of the module's graphdef,
so copies made by ``nnx.merge`` (``nnx.jit``, ``nnx.scan`` bodies) behave the same.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from flax import nnx

from jshard._sharding.step_axes import leaf_view
from jshard._sharding.step_state import Held, ShardedState, active_step
from jshard._step.gather import is_layer_slice
from jshard._step.unit_gather import gather_for_compute, per_layer
from jshard.flax._nnx.graph import describe, own_variables, unit_state
from jshard.flax._nnx.step_context import NOT_IN_STEP, current_step, nnx_step

OUTSIDE_STEP = (
    "{module} is fully sharded and was called outside the step: its parameters are shards. "
    "Call it inside jshard.flax.nnx.value_and_grad(loss_fn)(model, batch), or gather the model "
    "for evaluation with jshard.flax.nnx.unshard(model) (and jshard.flax.nnx.reshard(model) "
    "before training again)."
)


READ_SHARD = (
    "Param `{path}` of a fully sharded module was read inside the step while its module's "
    "parameters are not gathered, so it holds this device's shard, not the parameter. Read "
    "parameters inside the module's forward, register other methods that use them with "
    "jshard.flax.nnx.register_fsdp_forward_method(module, name), or call module.unshard() first."
)


class GuardedParam:
    """Mixed into the class of every sharded Param: inside the step, refuses to hand out a
    shard where the parameter is expected (its module's parameters are not gathered).

    A shard is recognised by its shape: the local shard's shape and, for stacked leaves, one
    layer's, as the step sees them (:func:`step_shard_shapes`, from the leaf's layout in the
    metadata ``jshard_layout``, which survives ``nnx.scan`` / ``nnx.remat`` copying the
    Variable); a leaf whose shard has its full shape is not checked.
    """

    __slots__ = ()

    def get_value(self, **kwargs: Any) -> Any:
        step = nnx_step()
        if step is not None and step.holds_shards:
            shards = step_shard_shapes(*self.get_metadata()["jshard_layout"], step.axes)
            if tuple(getattr(self.get_raw_value(), "shape", ())) in shards:
                raise RuntimeError(READ_SHARD.format(path=self.get_metadata().get("jshard_path", "?")))
        return super().get_value(**kwargs)


def step_shard_shapes(layout: Any, axes: Any, scan_axis: int | None, step_axes: Any) -> tuple[tuple[int, ...], ...]:
    """:func:`shard_shapes` inside a step manual over ``step_axes``: a dim split over a model
    axis the step is manual over holds this device's block (an expert unit's local experts,
    [Note: step axes])."""
    return shard_shapes(*leaf_view(layout, axes, step_axes), scan_axis)


def shard_shapes(layout: Any, axes: Any, scan_axis: int | None) -> tuple[tuple[int, ...], ...]:
    """Local shapes of a leaf's shard (and of one layer of it) that differ from the full shapes."""
    if not layout.sharded or layout.ignored:
        return ()
    shard = list(layout.padded_shape)
    shard[layout.dim] //= axes.shard_size
    shapes = {(tuple(shard), layout.shape)}
    if scan_axis == 0:
        shapes.add((tuple(shard[1:]), layout.shape[1:]))
    return tuple(sorted(s for s, full in shapes if s != full))


def guarded_class(cls: type) -> type:
    """``Sharded<Name>(GuardedParam, Name)`` for a Param class (one class per Param class)."""
    return cls if issubclass(cls, GuardedParam) else _guarded(cls)


@functools.cache
def _guarded(cls: type) -> type:
    return type(f"Sharded{cls.__name__}", (GuardedParam, cls), {"__slots__": (), "__module__": "jshard.flax.nnx"})


def gather_module(module: Any, step: Any) -> list[tuple[Any, Any]]:
    """Put the module's gathered parameters in its Params; returns ``(param, shard)`` to restore."""
    state = unit_state(module)
    params = own_variables(module)
    own = [(i, p) for i, ((_, is_sub), p) in enumerate(zip(state.entries, params, strict=True)) if not is_sub]
    shards = [p.get_raw_value() for _, p in own]
    values = [None if is_sub else p.get_raw_value() for (_, is_sub), p in zip(state.entries, params, strict=True)]
    flat = gather_for_compute(state.meta, values, step, layer=_is_stacked_slice(module),
                              not_in_step=NOT_IN_STEP.format(module=describe(module)))
    full = [flat[i] for i, _ in own]
    for (_, p), x in zip(own, full, strict=True):
        p.set_value(x)
    return [(p, x) for (_, p), x in zip(own, shards, strict=True)]


def _is_flax_node(x: Any) -> bool:
    return isinstance(x, (nnx.Pytree, nnx.Variable))


def restore(saved: list[tuple[Any, Any]]) -> None:
    for param, shard in saved:
        param.set_value(shard)


def forward(module: Any, name: str, args: tuple, kwargs: dict) -> Any:
    """Run ``module.<name>`` with its parameters gathered (see the module docstring).

    Inside ``nnx.scan`` over a stacked unit the gather and the call run as the step runs
    one layer (``per_layer``, with ``nnx.remat``), as :func:`jshard.scan` does.
    """
    method = getattr(type(module)._jshard_base, name)
    state = unit_state(module)
    if active_step() is None:
        if state.unsharded:
            return method(module, *args, **kwargs)
        raise RuntimeError(OUTSIDE_STEP.format(module=describe(module)))
    step = current_step(module)
    held = step.held.get(module)
    if held is not None and held.state is not ShardedState.PREFETCHED:
        return method(module, *args, **kwargs)

    def prefetch() -> None:
        for path in state.forward_prefetch:
            target = step.adapter.module_at(path, module)
            if target not in step.held:
                step.held[target] = Held(ShardedState.PREFETCHED, gather_module(target, step))

    if held is None and _is_stacked_slice(module):
        prefetch()  # outside the checkpoint: the targets live in this trace
        return per_layer(step, lambda m: _gathered_call(m, method, args, kwargs, step), nnx.remat)(module)
    return _gathered_call(module, method, args, kwargs, step, prefetch)


def _gathered_call(module: Any, method: Any, args: tuple, kwargs: dict, step: Any, prefetch=None) -> Any:
    held = step.held.get(module)
    if held is None:
        held = step.held[module] = Held(ShardedState.FORWARD, gather_module(module, step))
    held.state = ShardedState.FORWARD
    try:
        if prefetch is not None:
            prefetch()
        mp = unit_state(module).meta.policy.mp_policy
        args, kwargs = mp.cast_inputs((args, kwargs), is_leaf=_is_flax_node)
        return mp.cast_outputs(method(module, *args, **kwargs), is_leaf=_is_flax_node)
    finally:
        restore(step.held.pop(module).saved)


def _is_stacked_slice(module: Any) -> bool:
    state = unit_state(module)
    pairs = zip(state.entries, state.meta.layouts, own_variables(module), strict=True)
    return any(
        is_layer_slice(p.get_raw_value(), layout, state.meta.policy)
        for (_, is_sub), layout, p in pairs
        if not is_sub
    )


def forward_method(name: str) -> Callable[..., Any]:
    def method(self, *args, **kwargs):
        return forward(self, name, args, kwargs)

    method.__name__ = name
    return method
