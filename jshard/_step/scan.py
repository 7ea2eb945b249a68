"""``scan``: run a body over stacked layers, gathering one layer per iteration."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jshard._sharding.fully_shard import unshard_global
from jshard._sharding.step_state import active_step
from jshard._sharding.unit import FSDPUnit, is_unit
from jshard._step.unit_gather import gather_for_compute, per_layer


def _check_stacked(units: Any) -> FSDPUnit:
    if not is_unit(units) or units.meta.policy.scan_axis != 0:
        raise ValueError(
            "js.scan takes one FSDPUnit made with FullyShardPolicy(scan_axis=0) (layers stacked "
            f"along axis 0), got {type(units).__name__}"
            + ("" if not is_unit(units) else f" with scan_axis={units.meta.policy.scan_axis}")
            + "; shard the stacked layers with js.fully_shard(stack, policy=js.FullyShardPolicy(scan_axis=0))."
        )
    if any(layout is None for layout in units.meta.layouts):
        raise ValueError(
            "js.scan got a stacked unit that contains sub-units; a stack is one unit: "
            "fully_shard the stacked tree once, with scan_axis=0."
        )
    split = next((layout.model[0] for layout in units.meta.layouts if layout.model and layout.model[0]), ())
    if split:
        raise ValueError(
            f"js.scan got a stack whose layer axis 0 is split over mesh axes {split}: each device holds only "
            "its stage's layers; run it with js.pipeline (pipeline stages), or place the stack without "
            "splitting its layer axis."
        )
    return units


def scan(body: Callable[[Any, Any], tuple[Any, Any]], init: Any, units: FSDPUnit, **scan_kwargs: Any):
    """``jax.lax.scan`` over stacked layers, each layer gathered at its iteration.

    Inside the step (local view), ``body(carry, layer)`` receives one layer's **full**
    parameters, all-gathered in ``param_dtype`` at that iteration; per
    ``reshard_after_forward`` the gathered layer is freed and re-gathered in backward
    (``True``), saved (``False``), or a group copy is saved (``int``). Each layer's
    gradient is reduce-scattered in its backward iteration; on TPU a leaf whose gradient is
    reduced in ``param_dtype`` comes cast to it by the step, and its gradients are stacked
    in it (see [Note: stacks cast before the loop]). In the global view it
    unshards the stack and runs a plain ``lax.scan`` (for evaluation).

    Args:
      body: ``(carry, layer) -> (carry, y)``.
      init: the initial carry.
      units: a unit made with ``FullyShardPolicy(scan_axis=0)``.
      **scan_kwargs: passed to ``jax.lax.scan`` (``unroll``, ``reverse``, ...).

    Returns:
      ``(carry, ys)`` like ``jax.lax.scan``.

    Example:
      >>> import jax, jax.numpy as jnp, jshard as js
      >>> stack = js.fully_shard({"w": jnp.ones((4, 3, 3))}, policy=js.FullyShardPolicy(scan_axis=0))
      >>> def loss_fn(p, batch):
      ...     h, _ = js.scan(lambda h, layer: (h @ layer["w"], None), batch, p)
      ...     return h.mean()
      >>> loss, grads = js.value_and_grad(loss_fn, unshard_params=False)(stack, jnp.ones((8, 3)))
      >>> float(loss), grads["w"].shape
      (81.0, (4, 8, 3))
    """
    units = _check_stacked(units)
    step = active_step()
    if step is None:
        return jax.lax.scan(body, init, unshard_global(units), **scan_kwargs)
    step.unit(units.meta)  # a unit of this step, or a clear error (before the scan)

    def iteration(carry, layer_entries):
        return body(carry, units.with_entries(gather_for_compute(units.meta, layer_entries, step, layer=True)))

    return jax.lax.scan(per_layer(step, iteration), init, units.own_entries(), **scan_kwargs)
