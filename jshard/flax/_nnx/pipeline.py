"""``pipeline`` for NNX: a stacked module (``nnx.vmap``) run as pipeline stages, the user's layer module the body.

[Note: NNX pipeline] ``jnnx.fully_shard(blocks, mesh, policy, stages="stage")`` lays the
stacked Params out as :func:`jshard.stage_layers` does and makes them one unit, so the
module's unit is exactly what :func:`jshard.pipeline` takes. Inside the step
``jnnx.pipeline(body, x, blocks)`` hands that unit to the core schedule, whose body gets one
layer's gathered parameters; there the layer's module is rebuilt (``nnx.merge`` of the stack's
graphdef, each own Param set to that layer's value) and recorded as held gathered in the
step's ``held`` map, so its forward runs the original method without gathering again, and the
user's ``body(h, layer_module)`` (what an ``nnx.scan`` body gets) runs on it. A module that is
not sharded (the same model on one device), or gathered for evaluation (``jnnx.unshard``),
runs its ``L`` layers in a plain ``lax.scan``, as ``nnx.scan`` would.

Under 1F1B the core traces ``loss`` once (``_hoisted``) and runs that trace per microbatch
inside its ``custom_vjp``, differentiating the values it closes over ([Note: 1F1B schedule]).
A module whose forward gathered there would all-gather and reduce-scatter over every stage
inside each microbatch's backward, where only the last stage's gradient is kept: so the
``head`` modules that are units are gathered before the schedule and held (as the layer
module is), their forwards read the gathered Params, which the trace closes over, and the
gathers' own VJPs reduce-scatter their gradients once, after the schedule. A module that is
part of another unit (the root's ``self.head``) reads that unit's values, gathered by the
root's forward that calls the stack.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jshard._sharding.pipeline_policy import PipelinePolicy
from jshard._sharding.step_state import Held, ShardedState, active_step
from jshard._step.pipeline import pipeline as core_pipeline
from jshard.flax._nnx.forward import OUTSIDE_STEP, gather_module, restore
from jshard.flax._nnx.graph import build_unit, describe, own_variables, unit_state
from jshard.flax._nnx.step_context import current_step


def _only_params(module: Any) -> tuple[Any, Any, Any]:
    """``nnx.split(module, nnx.Param, ...)``, or an error naming the first other stacked variable."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    flat = jax.tree_util.tree_flatten_with_path(rest)[0]
    if flat:
        path, leaf = flat[0]
        raise ValueError(
            f"jnnx.pipeline runs stacks whose only state is nnx.Param, but {describe(module)} holds "
            f"{jax.tree_util.keystr(path)} of shape {tuple(getattr(leaf, 'shape', ()))} (not a Param): each stage "
            "would need its own slice of it. Keep other state (nnx.Rngs, batch statistics) outside the stack."
        )
    return graphdef, params, rest


def _scan(body: Callable, x: jax.Array, module: Any) -> jax.Array:
    """The ``L`` layers one after another (one device, or gathered for evaluation)."""
    graphdef, params, rest = _only_params(module)
    return jax.lax.scan(lambda h, p: (body(h, nnx.merge(graphdef, p, rest)), None), x, params)[0]


def _gathered_head(head: Any, step: Any) -> list[Any]:
    """The sharded units among ``head``'s modules that are not gathered now, gathered and held
    (their forwards gather no more); returns them, to restore after the schedule."""
    modules = () if head is None else head if isinstance(head, (tuple, list)) else (head,)
    gathered = []
    for module in (m for m in modules if unit_state(m) is not None):  # a plain submodule reads its unit's
        held = step.held.get(module)
        if held is None:
            step.held[module] = Held(ShardedState.FORWARD, gather_module(module, step))
        elif held.state is ShardedState.PREFETCHED:
            held.state = ShardedState.FORWARD
        else:  # in its own forward now: gathered, and restored there
            continue
        gathered.append(module)
    return gathered


def pipeline(body: Callable[[jax.Array, Any], jax.Array], x: jax.Array, module: Any, *,
             policy: PipelinePolicy | None = None, loss: Callable[[jax.Array, Any], jax.Array] | None = None,
             targets: Any = None, head: Any = None) -> jax.Array:
    """A stacked NNX module's layers run as pipeline stages over ``policy.axis`` (GPipe or 1F1B), like ``nnx.scan``.

    Write the loop over the stack with it instead of ``nnx.scan``: ``body(h, layer)`` gets one
    layer of the stack as a module (what an ``nnx.scan(in_axes=(nnx.Carry, 0))`` body gets),
    typically ``lambda h, block: block(h)``. Shard the stack with
    ``jnnx.fully_shard(blocks, mesh, js.FullyShardPolicy(scan_axis=0, dp_mesh_dims=...(shard="fsdp")),
    stages="stage")`` and the root over ``("stage", "fsdp")``; inside
    :func:`jshard.flax.nnx.value_and_grad` it runs :func:`jshard.pipeline` on the stack's unit
    ([Note: NNX pipeline]). An unsharded stack (the same model on one device) or one gathered
    with ``jnnx.unshard`` runs its layers in a plain ``lax.scan``.

    With ``loss`` the model after the stack runs per microbatch and the result is the loss, as
    :func:`jshard.pipeline` takes it (``PipelinePolicy(schedule="1f1b")`` needs it): ``loss(h,
    targets)`` may call the model's modules (``self.head``, a final norm), which are then
    listed in ``head``: under 1F1B each that is its own unit is gathered once before the
    schedule and held through it, so its forward inside ``loss`` gathers nothing and its
    gradients leave the schedule with the stack's ([Note: NNX pipeline]).

    Args:
      body: ``(h, layer_module) -> h``, one layer.
      x: the activations entering the stack, the batch on dim 0.
      module: the stacked module (Params with a leading layer axis, e.g. made with ``nnx.vmap``).
      policy: a :class:`jshard.PipelinePolicy` (default ``PipelinePolicy()``).
      loss: ``(h, targets) -> scalar``, the model after the stack and its loss, a mean over the rows.
      targets: a pytree of arrays with ``x``'s rows on dim 0 (labels), passed to ``loss``.
      head: the modules ``loss`` calls, one or a tuple (gathered before the schedule under 1F1B).

    Returns:
      ``h`` after the stack's ``L`` layers, shaped like ``x``; with ``loss``, the loss.

    Raises:
      RuntimeError: a sharded stack called outside the step.
      ValueError: the stack holds state other than Params, or is not laid out as stages
        (``stages=`` of :func:`jshard.flax.nnx.fully_shard`); under 1F1B, ``loss`` calls a
        sharded module not listed in ``head``.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jshard.flax import nnx as jnnx
      >>> @nnx.split_rngs(splits=3)
      ... @nnx.vmap(in_axes=(0,), out_axes=0)
      ... def create(rngs):
      ...     return nnx.Linear(4, 4, rngs=rngs)
      >>> blocks = create(nnx.Rngs(0))  # unsharded: the layers in a lax.scan
      >>> jnnx.pipeline(lambda h, block: block(h), jnp.ones((2, 4)), blocks).shape
      (2, 4)
      >>> head = nnx.Linear(4, 1, rngs=nnx.Rngs(1))
      >>> loss = jnnx.pipeline(lambda h, block: block(h), jnp.ones((2, 4)), blocks, targets=jnp.zeros((2, 1)),
      ...                      loss=lambda h, y: jnp.mean((head(h) - y) ** 2), head=head)
      >>> loss.shape
      ()
    """
    state = unit_state(module)
    if state is None or state.unsharded:
        h = _scan(body, x, module)
        return h if loss is None else loss(h, targets)
    policy = PipelinePolicy() if policy is None else policy
    if any(layout is None or layout.layers is None for layout in state.meta.layouts):
        raise ValueError(
            f"{describe(module)} is sharded but not laid out as pipeline stages: shard the stack with "
            f"jnnx.fully_shard(module, mesh, js.FullyShardPolicy(scan_axis=0, ...), stages={policy.axis!r})."
        )
    if active_step() is None:
        raise RuntimeError(OUTSIDE_STEP.format(module=describe(module)))
    step = current_step(module)
    graphdef, params, rest = _only_params(module)

    def layer(h: jax.Array, weights: Any) -> jax.Array:
        one = nnx.merge(graphdef, jax.tree.map(lambda v: v, params), rest)  # Variables of this trace
        for param, value in zip(own_variables(one), jax.tree.leaves(weights), strict=True):
            param.set_value(value)
        step.held[one] = Held(ShardedState.FORWARD, [])  # gathered: its forward gathers no more
        try:
            return body(h, one)
        finally:
            step.held.pop(one)

    gathered = _gathered_head(head, step) if policy.schedule == "1f1b" else []

    def scheduled_loss(h: jax.Array, y: Any) -> jax.Array:  # traced inside the schedule: no module gathers
        with step.adapting(dataclasses.replace(step.adapter, pipeline_loss=True)):
            return loss(h, y)

    try:
        return core_pipeline(layer, x, build_unit(module), policy=policy, targets=targets,
                             loss=loss if loss is None or policy.schedule != "1f1b" else scheduled_loss)
    finally:
        for done in gathered:
            restore(step.held.pop(done).saved)
