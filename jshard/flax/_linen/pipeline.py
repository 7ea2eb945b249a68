"""``pipeline`` for Linen: an ``nn.scan`` stack of a wrapped block run as pipeline stages.

[Note: Linen pipeline] ``jlinen.pipeline(Block, length=L)`` is ``nn.scan(Block,
variable_axes={"params": 0}, split_rngs={"params": True}, length=L)`` (the same params tree,
``(L, ...)`` per leaf) whose call, inside :func:`jshard.flax.linen.value_and_grad`, runs
:func:`jshard.pipeline` on the stack's unit instead of the scan. ``Block`` is wrapped with
:func:`jshard.flax.linen.fully_shard`, so ``shard_params``' abstract call finds it stacked
(``scan_axis=0``, [Note: Linen stacking]); the pipeline records its stage axis there too,
and ``shard_params`` lays the stack out with :func:`jshard.stage_layers` before sharding it.
In the step the schedule's body applies one ``Block`` to one layer's gathered parameters,
with the step's Linen table set aside, so the wrapped block runs as it does on full
parameters (evaluation) and gathers nothing again. Outside the step (``init``, the abstract
call, evaluation on ``js.unshard(params)``) it is the plain ``nn.scan``, then ``loss`` if given.

``stack(h, targets, loss)`` hands ``loss`` to the core as it is: under 1F1B the core traces it
once and differentiates the values it closes over ([Note: 1F1B schedule]). A head that is a
plain submodule of the wrapped root (``nn.Dense(1, name="head")`` made in the root's
``__call__``) reads its params from the root's scope, which the root's call gathered before
the stack ran, so the trace closes over gathered values and their gradients leave the
schedule, reduce-scattered once by the root's gather. A head wrapped as its own unit would
gather inside that trace, per microbatch (``M`` gathers and reduce-scatters where the root's
call does one). Before the core seeded only the last stage's loss (95667b0) its gradient was
also wrong (summed over every stage, then masked: a head bias's gradient came out zero); with
the refusal lifted it is now right (w_out's gradients within 3e-8 of the unsharded model), but
the gathers stay per microbatch, so a wrapped module called while ``loss`` is traced is
refused, named (``StepTable.pipeline_loss``); keep the head in the root.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import linen as nn

from jshard._sharding.pipeline_policy import PipelinePolicy
from jshard._step.pipeline import pipeline as core_pipeline
from jshard.flax._linen.transform import discovered, linen_step
from jshard.flax._paths import scope_path


def pipeline(target: type[nn.Module], *, length: int, policy: PipelinePolicy | None = None) -> type[nn.Module]:
    """A stack of ``length`` ``target`` layers (``nn.scan`` over its params) run as pipeline stages.

    Use it where you would write ``nn.scan(target, variable_axes={"params": 0},
    split_rngs={"params": True}, length=length)``: ``target`` is one layer,
    ``__call__(self, h, _) -> (h, None)`` as ``nn.scan`` takes it, wrapped with
    ``jlinen.fully_shard(Block, mesh=mesh, policy=js.FullyShardPolicy(dp_mesh_dims=...(shard="fsdp")))``;
    an instance is called as ``stack(h) -> h``, or ``stack(h, targets, loss) -> loss`` with the
    model after the stack and its loss run per microbatch, as :func:`jshard.pipeline` takes them
    (``PipelinePolicy(schedule="1f1b")`` needs them): ``loss(h, targets)`` may call the root's
    submodules (the head), defined in the root, not wrapped as units of their own
    ([Note: Linen pipeline]). Wrap the root with the model's other units over
    ``("stage", "fsdp")``; :func:`jshard.flax.linen.shard_params` lays the stack out as the mesh's
    stages over ``policy.axis``, and inside :func:`jshard.flax.linen.value_and_grad` the stack
    runs :func:`jshard.pipeline` ([Note: Linen pipeline]). Outside the step it is the
    ``nn.scan``: ``init`` makes the same params, and ``model.apply({"params":
    js.unshard(params)}, ...)`` evaluates the ``L`` layers.

    Args:
      target: the layer's Linen module class, wrapped with :func:`jshard.flax.linen.fully_shard`.
      length: ``L``, the number of layers.
      policy: a :class:`jshard.PipelinePolicy` (default ``PipelinePolicy()``).

    Returns:
      A Linen module class taking ``target``'s fields.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> from jshard.flax import linen as jlinen
      >>> class Layer(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, h, _):
      ...         return jnp.tanh(nn.Dense(4)(h)), None
      >>> stack = jlinen.pipeline(jlinen.fully_shard(Layer), length=3)()
      >>> params = stack.init(jax.random.key(0), jnp.ones((2, 4)))["params"]  # outside the step: nn.scan
      >>> params["Dense_0"]["kernel"].shape
      (3, 4, 4)
      >>> mse = lambda h, y: jnp.mean((h - y) ** 2)  # with a loss: the loss after the layers
      >>> float(stack.apply({"params": params}, jnp.zeros((2, 4)), jnp.ones((2, 4)), mse))
      1.0
    """
    policy = PipelinePolicy() if policy is None else policy
    scanned = nn.scan(target, variable_axes={"params": 0}, split_rngs={"params": True}, length=length)
    fields = [f.name for f in dataclasses.fields(target) if f.init and f.name not in ("parent", "name")]

    def __call__(self, h: jax.Array, targets: Any = None, loss: Callable[[jax.Array, Any], jax.Array] | None = None,
                 ) -> jax.Array:
        path = tuple(self.scope.path)
        found, in_step = discovered(), linen_step()
        if found is not None:
            found.stages[path] = policy.axis
        if in_step is None:
            h = scanned.__call__(self, h, None)[0]
            return h if loss is None else loss(h, targets)
        step, table = in_step
        if path not in table.units:
            raise ValueError(
                f"The pipeline stack at `{scope_path(path)}` is not a unit of the step: build the sharded params "
                "with jshard.flax.linen.shard_params(model, params, *example_args), its block wrapped with "
                "jshard.flax.linen.fully_shard."
            )
        table.gathered.add(path)
        layer = target(**{name: getattr(self, name) for name in fields}, parent=None)

        def body(h: jax.Array, weights: Any) -> jax.Array:
            with step.adapting(None):  # full parameters: the wrapped block gathers nothing
                return layer.apply({"params": weights}, h, None)[0]

        def scheduled_loss(h: jax.Array, y: Any) -> jax.Array:  # traced inside the schedule: no unit gathers
            table.pipeline_loss = True
            try:
                return loss(h, y)
            finally:
                table.pipeline_loss = False

        return core_pipeline(body, h, table.units[path], policy=policy, targets=targets,
                             loss=loss if loss is None or policy.schedule != "1f1b" else scheduled_loss)

    return type(f"Pipeline{target.__name__}", (scanned,), {"__call__": __call__, "__module__": target.__module__})
