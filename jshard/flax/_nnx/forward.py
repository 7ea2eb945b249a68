"""Just-in-time gathering around a sharded NNX module's forward methods.

``fully_shard`` changes a module's class to ``FSDP<Name>(FSDPModule, Name)`` (FSDP2 does the
same), so ``module(x)`` goes through :func:`forward`: inside the step it gathers the
module's own parameters (``js.unshard`` of its unit, in the core's local view), runs the
original method, and puts the shards back. The class is part of the module's graphdef,
so copies made by ``nnx.merge`` (``nnx.jit``, ``nnx.scan`` bodies) behave the same.

[Note: NNX layer slices] Inside ``nnx.scan`` (or ``nnx.vmap``) over a stacked unit each Param
holds one layer of its stack, and the forward must know it: one layer is gathered with the
layer's layout, under ``per_layer``. Flax 0.12.8 does not carry that fact as Flax's docs write
``nnx.scan``: its transforms call the Variable axis hooks (``Variable.remove_axis`` /
``add_axis``, through ``spmd.remove_axis`` / ``add_axis``) only when ``transform_metadata``
names ``nnx.PARTITION_NAME`` (``ScanFn.__call__`` and ``VmapFn.__call__`` in
``flax/nnx/transforms/iteration.py`` test ``spmd.PARTITION_NAME in self.transform_metadata``;
its default is ``FrozenDict({})``), and the slices that ``jax.lax.scan`` / ``jax.vmap`` hand the
body are unflattened with the Variable's metadata untouched (it is the Variable's pytree aux
data, ``variablelib._variable_unflatten``). No metadata of ours can change there without the
user passing ``transform_metadata``, so a layer and its stack differ only in the value. The
most explicit means left: the shapes a leaf may hold travel with it (its layout is in the
module's static ``UnitState``, part of the graphdef every copy is merged from);
:func:`jshard._sharding.local_shapes.local_shapes` says exactly which is the stack's and
which is one layer's in this step (shard or, gradient sync deferred, gathered), and a Param
holding neither, or Params that disagree, are an error naming the Param: never a guess from
``ndim`` (a scan over axis 1 was taken for one layer, and failed inside the gather's VJP).

[Note: guarded Params] Refusing a shard read must run when a Param is read. Flax 0.12.8 has
two ways: ``on_get_value`` metadata hooks, deprecated (``Variable.__init__`` warns "Variable
hooks are deprecated. Create your own Variable type and overload `get_value`"), and what that
warning prescribes, a Variable subclass overriding ``get_value``. A class is chosen when a
Variable is made, and the user's Params exist before ``fully_shard``: the supported way to a
new class is a new Variable (``Sharded.from_metadata(value, metadata)``, or
``nnx.recursive_map``, which works on a clone) put where the Param was. But a Param's identity
is how NNX ties weights (one Param reached from two modules) and how ``fully_shard`` finds a
Param shared by two units; Flax's own graph updates keep it (``Pytree._graph_node_set_key``
calls ``update_from_state`` on the Variable already there). A new object would untie, silently,
a Param the module shares with code outside it. So ``fully_shard`` changes the class of the
existing Param to ``Sharded<Name>(GuardedParam, Name)``, as it changes the module's and as FSDP2
does: the same object and slots, a subclass (``nnx.Param`` filters match), recorded in the
graphdef (copies keep it). The rule itself has one home,
:func:`jshard._sharding.local_shapes.refuse_shard_read`, which the core's unit calls too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from flax import nnx

from jshard._sharding.local_shapes import local_shapes, refuse_shard_read
from jshard._sharding.step_state import Held, ShardedState, active_step
from jshard._step.unit_gather import gather_for_compute, per_layer
from jshard.flax._nnx.graph import describe, own_variables, unit_state
from jshard.flax._nnx.step_context import NOT_IN_STEP, current_step, nnx_step
from jshard.flax._paths import attribute_path

OUTSIDE_STEP = (
    "{module} is fully sharded and was called outside the step: its parameters are shards. "
    "Call it inside jshard.flax.nnx.value_and_grad(loss_fn)(model, batch), or gather the model "
    "for evaluation with jshard.flax.nnx.unshard(model) (and jshard.flax.nnx.reshard(model) "
    "before training again)."
)


READ_SHARD = (
    "Param `{path}` of a fully sharded module was read inside the step while its module's parameters are "
    "not gathered, so it holds this device's shard {local} of the parameter's {shape} (padded to {padded}, "
    "split over mesh axis {axis!r} of size {n}). Read parameters inside the module's forward, register other "
    "methods that use them with jshard.flax.nnx.register_fsdp_forward_method(module, name), or call "
    "module.unshard() first."
)
NOT_ONE_LAYER = (
    "Param `{path}` of {module}, a stack of layers (FullyShardPolicy(scan_axis=0)), holds shape {shape} inside "
    "the step, {problem}; its stack's shard is {stack} and one layer's {layer} (split over mesh axis {axis!r} of "
    "size {n}). Call the stacked module inside nnx.scan or nnx.vmap over axis 0 of every Param (in_axes=0 for the "
    "module), as Flax writes stacked layers, or as a whole outside them."
)


class GuardedParam:
    """Mixed into the class of every sharded Param whose shard can be told from the parameter:
    inside the step, reading it while its module's parameters are not gathered is refused
    (:func:`jshard._sharding.local_shapes.refuse_shard_read`, with the leaf's layout from the
    metadata ``jshard_layout``, which ``nnx.scan`` / ``nnx.remat`` copies keep).

    See [Note: guarded Params] for why the class of the existing Param changes.
    """

    __slots__ = ()

    def get_value(self, **kwargs: Any) -> Any:
        step = nnx_step()
        if step is not None:  # outside the step (most reads) no metadata is looked up
            refuse_shard_read(self.get_raw_value(), *self.get_metadata("jshard_layout"), step, READ_SHARD,
                              path=self.get_metadata("jshard_path", "?"))
        return super().get_value(**kwargs)


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
    flat = gather_for_compute(state.meta, values, step, layer=_holds_one_layer(module, step),
                              not_in_step=NOT_IN_STEP.format(module=describe(module)))
    full = [flat[i] for i, _ in own]
    for (_, p), x in zip(own, full, strict=True):
        p.set_value(x)
    return [(p, x) for (_, p), x in zip(own, shards, strict=True)]


IN_PIPELINE_LOSS = (
    "{module} was called in the loss of jnnx.pipeline under PipelinePolicy(schedule='1f1b') without being "
    "gathered: its parameters (Param `{path}` of shape {shape}, ...) are sharded over mesh axis {axis!r} of size "
    "{n}, and its forward would gather them per microbatch inside the schedule's own trace, where Flax refuses to "
    "set a Param made outside it (TraceContextError). "
    "Pass it in jnnx.pipeline(..., head=...) (one module or a tuple), which gathers it once before the schedule."
)


def _refuse_in_pipeline_loss(module: Any, step: Any) -> None:
    if step.adapter.pipeline_loss:
        state = unit_state(module)
        path, layout = next((p, lay) for (p, sub), lay in zip(state.entries, state.meta.layouts, strict=True)
                            if not sub)
        raise ValueError(IN_PIPELINE_LOSS.format(
            module=describe(module), path=attribute_path(path), shape=layout.shape, axis=state.meta.axes.shard_entry,
            n=state.meta.axes.shard_size))


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

    if held is None and _holds_one_layer(module, step):
        prefetch()  # outside the checkpoint: the targets live in this trace
        return per_layer(step, lambda m: _gathered_call(m, method, args, kwargs, step), nnx.remat)(module)
    return _gathered_call(module, method, args, kwargs, step, prefetch)


def _gathered_call(module: Any, method: Any, args: tuple, kwargs: dict, step: Any, prefetch=None) -> Any:
    held = step.held.get(module)
    if held is None:
        _refuse_in_pipeline_loss(module, step)
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


def _holds_one_layer(module: Any, step: Any) -> bool:
    """Whether the module's Params hold one layer of their stacks (inside ``nnx.scan`` /
    ``nnx.vmap``) rather than the whole stacks: the shape each holds against the two its
    carried layout allows in this step, every Param agreeing ([Note: NNX layer slices])."""
    state = unit_state(module)
    if state.meta.policy.scan_axis != 0:
        return False
    first: tuple[Any, bool] | None = None
    for (path, is_sub), layout, param in zip(state.entries, state.meta.layouts, own_variables(module), strict=True):
        if is_sub:
            continue
        shapes = local_shapes(layout, state.meta.axes, 0, step.axes)
        stack, layer = (shapes.before_gather(step.holds_shards, one) for one in (False, True))
        shape = tuple(param.get_raw_value().shape)
        if shape not in (stack, layer):
            problem = "which is neither"
        elif first is not None and (shape == layer) != first[1]:
            problem = f"while `{attribute_path(first[0])}` holds {'one layer' if first[1] else 'its whole stack'}"
        else:
            first = first or (path, shape == layer)
            continue
        raise ValueError(NOT_ONE_LAYER.format(
            path=attribute_path(path), module=describe(module), shape=shape, problem=problem, stack=stack, layer=layer,
            axis=state.meta.axes.shard_entry, n=state.meta.axes.shard_size))
    return first is not None and first[1]


def forward_method(name: str) -> Callable[..., Any]:
    def method(self, *args, **kwargs):
        return forward(self, name, args, kwargs)

    method.__name__ = name
    return method
