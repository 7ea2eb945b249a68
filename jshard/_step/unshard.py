"""``unshard``: the global view's gather, or the step's just-in-time gather (see [Note: step state])."""

from __future__ import annotations

from typing import Any

from jshard._sharding.fully_shard import unshard_global
from jshard._sharding.step_state import active_step
from jshard._sharding.unit import is_unit
from jshard._step.unit_gather import unshard_unit


def unshard(sharded: Any) -> Any:
    """Gather units back to full parameters.

    Global view (outside the step): every unit in ``sharded`` becomes the tree it was
    made from, each leaf of its original shape and dtype, replicated on the mesh,
    padding removed; ``unshard(fully_shard(p))`` equals ``p`` exactly. Works eagerly and
    under ``jit``.

    Local view (inside :func:`jshard.value_and_grad` with ``unshard_params=False``):
    all-gathers the unit's own shards just in time, in ``param_dtype``; sub-units stay
    units, to be unsharded when they are used. The gradient of the result is
    reduce-scattered as the unit's policy says.

    Args:
      sharded: an :class:`jshard.FSDPUnit`, or any pytree containing units.

    Returns:
      The tree with units replaced by full parameters.

    Example:
      >>> import jax.numpy as jnp, jshard as js
      >>> p = {"w": jnp.arange(10.0)}
      >>> js.unshard(js.fully_shard(p))["w"].shape
      (10,)
    """
    step = active_step()
    if step is not None:
        if not is_unit(sharded):
            raise TypeError(
                f"js.unshard inside the step takes one FSDPUnit, got {type(sharded).__name__}; "
                "call it on each unit right before its parameters are used."
            )
        return unshard_unit(sharded, step)
    return unshard_global(sharded)
