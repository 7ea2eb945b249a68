"""FSDP2 for Flax Linen: wrap blocks and the root like ``nn.remat``, train with ``TrainState``.

Example:
  >>> import jax, jax.numpy as jnp, flax.linen as nn
  >>> from jshard.flax import linen as jlinen
  >>> model = jlinen.fully_shard(nn.Dense)(3)
  >>> x = jnp.ones((8, 5))
  >>> params = jlinen.shard_params(model, model.init(jax.random.key(0), x)["params"], x)
  >>> params["kernel"].shape  # 5 rows padded to the 8 devices
  (8, 3)
"""

from jshard.flax._linen.intercept import ModuleUnits as ModuleUnits
from jshard.flax._linen.pipeline import pipeline as pipeline
from jshard.flax._linen.step import value_and_grad as value_and_grad
from jshard.flax._linen.wrap import fully_shard as fully_shard
from jshard.flax._linen.wrap import shard_params as shard_params

__all__ = ["ModuleUnits", "fully_shard", "pipeline", "shard_params", "value_and_grad"]
