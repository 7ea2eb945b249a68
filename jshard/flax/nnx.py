"""FSDP2 for Flax NNX: ``fully_shard`` per module, then train with your usual loop.

Example:
  >>> from flax import nnx
  >>> from jshard.flax import nnx as jnnx
  >>> model = jnnx.fully_shard(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
  >>> type(model).__name__
  'FSDPLinear'
"""

from __future__ import annotations

from typing import Any

from jshard.flax._nnx_graph import sharded_modules
from jshard.flax._nnx_module import FSDPModule as FSDPModule
from jshard.flax._nnx_module import UnshardHandle as UnshardHandle
from jshard.flax._nnx_shard import fully_shard as fully_shard
from jshard.flax._nnx_shard import register_fsdp_forward_method as register_fsdp_forward_method
from jshard.flax._nnx_step import value_and_grad as value_and_grad


def unshard(module: Any) -> Any:
    """Gather every sharded module in ``module``'s graph (outside the step), for evaluation.

    Calls then run like the unsharded model; call :func:`reshard` before training again.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jshard.flax import nnx as jnnx
      >>> model = jnnx.fully_shard(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
      >>> jnnx.unshard(model)(jnp.ones((1, 3))).shape
      (1, 2)
      >>> jnnx.reshard(model).kernel.get_value().shape
      (8, 2)
    """
    for _, m in sharded_modules(module):
        m.unshard()
    return module


def reshard(module: Any) -> Any:
    """Put back the shards of every sharded module in ``module``'s graph (see :func:`unshard`).

    Example:
      >>> from flax import nnx
      >>> from jshard.flax import nnx as jnnx
      >>> model = jnnx.reshard(jnnx.unshard(jnnx.fully_shard(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))))
      >>> model.kernel.get_value().shape
      (8, 2)
    """
    for _, m in sharded_modules(module):
        m.reshard()
    return module


__all__ = [
    "FSDPModule",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "reshard",
    "unshard",
    "value_and_grad",
]
