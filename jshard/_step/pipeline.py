"""``pipeline``: a stack of layers run as pipeline stages over a ``stage`` mesh axis (GPipe; 1F1B
in ``pipeline_1f1b.py``).

[Note: pipeline schedule] The step is manual over ``stage`` as over every data-parallel axis
([Note: step axes]): the stack, split over ``stage`` on its layer axis, is a unit sharded over
the stage's own data-parallel axes, and the model's other units shard over ``stage`` too, so
the batch is split over it. Inside the step a device ``(s, f)`` holds stage ``s``'s ``K``
layers ([Note: pipeline stages]), FSDP-sharded over ``f``, and its ``b`` rows of the batch:

1. the stage's rows are all-gathered over ``stage`` (every stage of column ``f`` then holds
   the column's ``S * b`` rows) and cut into ``M`` microbatches of ``S * b / M`` rows;
2. ``M + S - 1`` schedule steps (a ``lax.scan``): stage 0 takes microbatch ``t`` (while
   ``t < M``), every other stage what its predecessor sent; each runs its ``K`` layers (the
   padding layers, index ``>= L``, as identities) and sends the result to the next stage
   with one ``ppermute``; the last stage keeps microbatch ``t - (S - 1)``. A stage idles
   (computes what is thrown away) ``S - 1`` of the ``M + S - 1`` steps: the bubble;
3. the last stage's outputs are reduce-scattered over ``stage``, so each stage gets its
   own ``b`` rows back for the rest of the model (the other stages contribute zeros).

Backward is JAX's transpose of the schedule: the ``ppermute`` runs the other way, and a
layer's gradient reaches its stage from every stage's loss through it. The stack's
gradients are reduce-scattered over the stage's shard axes only (``stage`` splits them),
and divided by the whole batch split, as expert units' are. Each layer's compute is
checkpointed with the step's policy (one layer's input saved per layer and schedule step).
The stage's layers enter the layer loop as its scanned inputs: measured on XLA:CPU (width
1024, ``S = 2``, ``M = 4``), indexing them inside the loop body instead held 15.11 MiB of
temporaries against 12.11 (``"per_microbatch"``) and 49.04 against 40.92 (``"once"``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jshard._sharding.fully_shard import unshard_global
from jshard._sharding.pipeline_policy import PipelinePolicy
from jshard._sharding.stages import stage_size
from jshard._sharding.step_state import StepState, active_step
from jshard._sharding.unit import FSDPUnit, is_unit
from jshard._step.pipeline_1f1b import one_f_one_b
from jshard._step.remat import depend
from jshard._step.unit_gather import gather_for_compute, per_layer


def _stack_layers(stack: Any, axis: str) -> int:
    """``L``, the layer count ``js.stage_layers`` recorded in the stack's unit, or an error naming the leaf."""
    if not is_unit(stack) or stack.meta.policy.scan_axis != 0 or any(lay is None for lay in stack.meta.layouts):
        raise ValueError(
            "js.pipeline takes one FSDPUnit of stacked layers made with FullyShardPolicy(scan_axis=0), got "
            f"{type(stack).__name__}; build it with js.fully_shard(js.stage_layers(stack, mesh), mesh, "
            "js.FullyShardPolicy(scan_axis=0, dp_mesh_dims=js.DataParallelMeshDims(shard='fsdp')))."
        )
    stages = stack.meta.mesh.shape.get(axis)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(stack.tree)[0]]
    for path, layout in zip(paths, stack.meta.layouts, strict=True):
        if layout.layers is None or not layout.model or layout.model[0] != (axis,):
            raise ValueError(
                f"Leaf {path} of shape {layout.shape} is not laid out as stages over mesh axis {axis!r} (size "
                f"{stages}) on its layer axis 0; lay the stack out with js.stage_layers(stack, mesh) before "
                "js.fully_shard."
            )
    return stack.meta.layouts[0].layers


def _stage(body: Callable, stack: FSDPUnit, step: StepState, policy: PipelinePolicy, layers: int,
           per_stage: int) -> tuple[list[Any], Callable[[list[Any], jax.Array], jax.Array]]:
    """This stage's weights as the schedule takes them (gathered once, or shards gathered per
    layer per ``policy``) and ``run(weights, h)``: its ``K`` layers on one microbatch."""
    first = jax.lax.axis_index(policy.axis) * per_stage
    entries = stack.own_entries()
    once, tied = policy.gather == "once", policy.schedule == "1f1b"
    if once:
        entries = gather_for_compute(stack.meta, entries, step)

    def layer(h, xs):
        j, slices = xs
        if not once:  # under 1F1B's jax.vjp, tied to h: a gather needing only weights would be hoisted
            slices = gather_for_compute(stack.meta, [depend(w, [h]) for w in slices] if tied else slices, step,
                                        layer=True)
        return jnp.where(first + j < layers, body(h, stack.with_entries(slices)), h), None

    checkpointed = per_layer(step, layer)
    return list(entries), lambda weights, h: jax.lax.scan(checkpointed, h, (jnp.arange(per_stage), weights))[0]


def _gpipe(run_stage: Callable, xs: jax.Array, axis: str, stages: int) -> jax.Array:
    """The GPipe schedule over ``xs`` (``M`` microbatches): the last stage's outputs, zeros elsewhere."""
    stage, m = jax.lax.axis_index(axis), xs.shape[0]
    shift = [(i, i + 1) for i in range(stages - 1)]

    def tick(carry, t):
        received, outputs = carry
        out = run_stage(jnp.where(stage == 0, xs[jnp.minimum(t, m - 1)], received))
        j = jnp.clip(t - (stages - 1), 0, m - 1)
        done = (stage == stages - 1) & (t >= stages - 1)
        outputs = outputs.at[j].set(jnp.where(done, out, outputs[j]))
        return (jax.lax.ppermute(out, axis, shift), outputs), None

    (_, outputs), _ = jax.lax.scan(tick, (jnp.zeros_like(xs[0]), jnp.zeros_like(xs)), jnp.arange(m + stages - 1))
    return outputs


def _check_targets(targets: Any, rows: int) -> None:
    for path, y in jax.tree_util.tree_flatten_with_path(targets)[0]:
        if getattr(y, "ndim", 0) == 0 or y.shape[0] != rows:
            raise ValueError(
                f"js.pipeline: targets{jax.tree_util.keystr(path)} of shape {tuple(getattr(y, 'shape', ()))} does not "
                f"hold this device's {rows} rows on dim 0 as x does; pass the targets of x's rows (the step's batch).")


def pipeline(body: Callable[[jax.Array, Any], jax.Array], x: jax.Array, stack: FSDPUnit, *,
             policy: PipelinePolicy | None = None, loss: Callable[[jax.Array, Any], jax.Array] | None = None,
             targets: Any = None) -> jax.Array:
    """``L`` stacked layers run as ``S`` pipeline stages over ``policy.axis``, GPipe or 1F1B schedule.

    Inside the step (local view) ``x`` is this device's rows of the activations; they go
    through ``M`` microbatches and the stages ([Note: pipeline schedule]) and come back as
    this device's rows of ``body`` applied ``L`` times. Each stage's layers are gathered
    over the stage's FSDP axes per ``policy.gather`` (:class:`jshard.PipelinePolicy` states
    the memory and traffic of each). The step must be manual over ``policy.axis``: shard the
    model's other units over it too (``DataParallelMeshDims(shard=("stage", "fsdp"))``), so
    the batch is split over it. In the global view (evaluation) it runs the ``L`` layers in
    a plain ``lax.scan``.

    With ``loss``, the rest of the model and the loss run per microbatch too and the result
    is the loss: ``schedule="1f1b"`` needs it, since each microbatch's backward starts at its
    loss on the last stage ([Note: 1F1B schedule]). ``loss(h, targets)`` must be a mean over
    the rows of ``h`` (as the step's own microbatches assume): the 1F1B schedule returns its
    mean over the microbatches of the stages' rows, the GPipe schedule ``loss`` of this
    device's rows; the step's average over devices is the same. It may read gathered weights
    (the head's): their gradients are returned; ``targets`` are not differentiated.

    Args:
      body: ``(h, layer) -> h``, one layer (``layer``: its full parameters, a tree like the stack's).
      x: the activations entering the stack, an array with the batch on dim 0.
      stack: the unit of stacked layers: ``js.fully_shard(js.stage_layers(stack, mesh), mesh,
        js.FullyShardPolicy(scan_axis=0, dp_mesh_dims=...))``, which records the model's layer
        count ``L`` (the stack holds ``S * ceil(L / S)`` slots; the rest are padding, run as
        identities).
      policy: a :class:`jshard.PipelinePolicy` (default ``PipelinePolicy()``).
      loss: ``(h, targets) -> scalar``, the model after the stack and its loss, a mean over the rows.
      targets: a pytree of arrays with ``x``'s rows on dim 0 (labels), passed to ``loss`` row for row.

    Returns:
      ``h`` after the ``L`` layers, shaped like ``x``; with ``loss``, the loss.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, jshard as js
      >>> mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(2, 4), ("stage", "fsdp"))
      >>> stack = js.fully_shard(js.stage_layers({"w": jnp.full((3, 4, 4), 0.5)}, mesh), mesh,
      ...                        js.FullyShardPolicy(scan_axis=0, dp_mesh_dims=js.DataParallelMeshDims(shard="fsdp")))
      >>> params = js.fully_shard({"stack": stack, "scale": jnp.ones(4)}, mesh,
      ...                         js.FullyShardPolicy(dp_mesh_dims=js.DataParallelMeshDims(shard=("stage", "fsdp"))))
      >>> def loss_fn(p, x):
      ...     h = js.pipeline(lambda h, layer: h @ layer["w"], x * js.unshard(p)["scale"], p["stack"])
      ...     return h.mean()
      >>> loss, grads = jax.jit(js.value_and_grad(loss_fn, unshard_params=False))(params, jnp.ones((16, 4)))
      >>> float(loss), grads["stack"]["w"].shape
      (8.0, (4, 4, 4))
      >>> def loss_1f1b(p, x):  # the same loss through the 1F1B schedule
      ...     policy = js.PipelinePolicy(microbatches=4, schedule="1f1b")
      ...     return js.pipeline(lambda h, layer: h @ layer["w"], x * js.unshard(p)["scale"], p["stack"],
      ...                        policy=policy, loss=lambda h, _: h.mean())
      >>> loss2, grads2 = jax.jit(js.value_and_grad(loss_1f1b, unshard_params=False))(params, jnp.ones((16, 4)))
      >>> float(loss2), bool(jnp.allclose(grads2["stack"]["w"], grads["stack"]["w"]))
      (8.0, True)
    """
    policy = PipelinePolicy() if policy is None else policy
    layers = _stack_layers(stack, policy.axis)
    if policy.schedule == "1f1b" and loss is None:
        raise ValueError("js.pipeline with PipelinePolicy(schedule='1f1b') runs each microbatch's backward inside "
                         "the schedule, from its loss on the last stage: pass loss=(h, targets) -> scalar (the "
                         "model after the stack and its loss) and the targets of x's rows.")
    _check_targets(targets, x.shape[0])
    step = active_step()
    if step is None:  # the global view: the L layers, no padding slots
        h = jax.lax.scan(lambda h, layer: (body(h, layer), None), x, unshard_global(stack))[0]
        return h if loss is None else loss(h, targets)
    step.unit(stack.meta)  # a unit of this step, or a clear error
    if policy.axis not in step.axes.data_parallel:
        raise ValueError(
            f"js.pipeline over mesh axis {policy.axis!r}: this step is manual over {step.axes.data_parallel} only, "
            f"so the batch is not split over {policy.axis!r}; shard the model's other units over it too "
            f"(js.DataParallelMeshDims(shard=({policy.axis!r}, 'fsdp')))."
        )
    stages = stack.meta.mesh.shape[policy.axis]
    m = policy.microbatches or stages
    rows = jax.lax.all_gather(x, policy.axis, axis=0, tiled=True)
    if rows.shape[0] % m:
        others = step.axes.data_parallel_size // stages
        raise ValueError(
            f"js.pipeline: the {rows.shape[0]} rows the {stages} stages (mesh axis {policy.axis!r}) share do not "
            f"split into {m} microbatches; make the global batch a multiple of {math.lcm(m, stages) * others} "
            f"(lcm(M={m}, S={stages}) x the other data-parallel axes' size {others})."
        )
    weights, run_stage = _stage(body, stack, step, policy, layers, stage_size(layers, stages))

    def microbatches(a):
        return a.reshape((m, a.shape[0] // m) + a.shape[1:])

    if policy.schedule == "1f1b":
        ys = jax.tree.map(lambda y: microbatches(jax.lax.all_gather(y, policy.axis, axis=0, tiled=True)), targets)
        return one_f_one_b(run_stage, loss, weights, microbatches(rows), ys, policy.axis, stages)
    outputs = _gpipe(lambda h: run_stage(weights, h), microbatches(rows), policy.axis, stages)
    h = jax.lax.psum_scatter(outputs.reshape(rows.shape), policy.axis, scatter_dimension=0, tiled=True)
    return h if loss is None else loss(h, targets)
