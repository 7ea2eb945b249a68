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

from jshard._sharding.dtypes import cast_floating
from jshard._sharding.views import current_view
from jshard._step.gather import is_layer_slice
from jshard._step.unit_gather import gather_entries
from jshard.flax._nnx.graph import describe, own_variables, unit_state
from jshard.flax._nnx.step_context import Held, active_step, current_step

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

    A shard is recognised by its shape (metadata ``jshard_shards``: the local shard's shape
    and, for stacked leaves, one layer's), which survives ``nnx.scan`` / ``nnx.remat``
    copying the Variable; a leaf whose shard has its full shape is not checked.
    """

    __slots__ = ()

    def get_value(self, **kwargs: Any) -> Any:
        view = current_view()
        if view is not None and not view.pregathered and active_step() is not None:
            if tuple(getattr(self.get_raw_value(), "shape", ())) in self.get_metadata().get("jshard_shards", ()):
                raise RuntimeError(READ_SHARD.format(path=self.get_metadata().get("jshard_path", "?")))
        return super().get_value(**kwargs)


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


def gather_module(module: Any, view: Any) -> list[tuple[Any, Any]]:
    """Put the module's gathered parameters in its Params; returns ``(param, shard)`` to restore."""
    state = unit_state(module)
    meta = state.meta
    step_reshard(module)  # a unit of this step, or a clear error
    params = own_variables(module)
    own = [(i, p) for i, ((_, is_sub), p) in enumerate(zip(state.entries, params, strict=True)) if not is_sub]
    if view.pregathered or not own:
        return []
    shards = [p.get_raw_value() for _, p in own]
    values = [None if is_sub else p.get_raw_value() for (_, is_sub), p in zip(state.entries, params, strict=True)]
    flat = gather_entries(meta, values, view, layer=_is_stacked_slice(module))
    full = [flat[i] for i, _ in own]
    for (_, p), x in zip(own, full, strict=True):
        p.set_value(x)
    return [(p, x) for (_, p), x in zip(own, shards, strict=True)]


NOT_IN_STEP = (
    "{module} was called in a step that it is not part of: pass the model that contains it to the "
    "grad function (do not close over sharded modules)."
)


def step_reshard(module: Any) -> bool | int:
    """How the module's unit reshards in this step (its meta's ``step_reshard``), or a clear error."""
    raf = unit_state(module).meta.step_reshard
    if raf is None:
        raise ValueError(NOT_IN_STEP.format(module=describe(module)))
    return raf


def _is_flax_node(x: Any) -> bool:
    return isinstance(x, (nnx.Pytree, nnx.Variable))


def restore(saved: list[tuple[Any, Any]]) -> None:
    for param, shard in saved:
        param.set_value(shard)


def forward(module: Any, name: str, args: tuple, kwargs: dict) -> Any:
    """Run ``module.<name>`` with its parameters gathered (see the module docstring).

    [Note: stacked slices] Inside ``nnx.scan`` over a stacked unit the gather runs in a
    checkpoint (``nnx.remat`` with the core's names policy), as :func:`jshard.scan` does:
    the step's own checkpoint does not reach into the scan body, and without this every
    layer's gathered parameters would be saved for backward.
    """
    method = getattr(type(module)._jshard_base, name)
    state = unit_state(module)
    view = current_view()
    if view is None:
        if state.unsharded:
            return method(module, *args, **kwargs)
        raise RuntimeError(OUTSIDE_STEP.format(module=describe(module)))
    step = current_step(module)
    held = step.gathered.get(id(module))
    if held is not None and held.kind != "prefetch":
        return method(module, *args, **kwargs)

    def prefetch() -> None:
        for path in state.forward_prefetch:
            target = step.module_at(path, module)
            if id(target) not in step.gathered:
                step.gathered[id(target)] = Held("prefetch", gather_module(target, view))

    if held is None and _is_stacked_slice(module) and step_reshard(module) is not False:
        prefetch()  # outside the checkpoint: the targets live in this trace
        call = nnx.remat(lambda m: _gathered_call(m, method, args, kwargs, step, view), policy=view.remat_policy)
        return call(module)
    return _gathered_call(module, method, args, kwargs, step, view, prefetch)


def _gathered_call(module: Any, method: Any, args: tuple, kwargs: dict, step: Any, view: Any, prefetch=None) -> Any:
    held = step.gathered.get(id(module))
    if held is None:
        held = step.gathered[id(module)] = Held("forward", gather_module(module, view))
    held.kind = "forward"
    try:
        if prefetch is not None:
            prefetch()
        mp = unit_state(module).meta.policy.mp_policy
        if mp.cast_forward_inputs:
            args, kwargs = cast_floating((args, kwargs), mp.param_dtype, is_leaf=_is_flax_node)
        return cast_floating(method(module, *args, **kwargs), mp.output_dtype, is_leaf=_is_flax_node)
    finally:
        restore(step.gathered.pop(id(module)).saved)


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
