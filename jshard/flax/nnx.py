"""FSDP2 for Flax NNX: ``fully_shard`` per module, then train with your usual loop.

Example:
  >>> from flax import nnx
  >>> from jshard.flax import nnx as jnnx
  >>> model = jnnx.fully_shard(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
  >>> type(model).__name__
  'FSDPLinear'
"""

from jshard.flax._nnx.module import FSDPModule as FSDPModule
from jshard.flax._nnx.module import UnshardHandle as UnshardHandle
from jshard.flax._nnx.optimizer import shard_optimizer as shard_optimizer
from jshard.flax._nnx.pipeline import pipeline as pipeline
from jshard.flax._nnx.shard import fully_shard as fully_shard
from jshard.flax._nnx.shard import register_fsdp_forward_method as register_fsdp_forward_method
from jshard.flax._nnx.step import value_and_grad as value_and_grad
from jshard.flax._nnx.whole_model import reshard as reshard
from jshard.flax._nnx.whole_model import units as units
from jshard.flax._nnx.whole_model import unshard as unshard

__all__ = [
    "FSDPModule",
    "UnshardHandle",
    "fully_shard",
    "pipeline",
    "register_fsdp_forward_method",
    "reshard",
    "shard_optimizer",
    "units",
    "unshard",
    "value_and_grad",
]
