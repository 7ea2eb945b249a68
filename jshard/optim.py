"""Optax on sharded parameters (see :func:`shard_optimizer`), and on offloaded state (:func:`offload_optimizer`)."""

from jshard._state.offload_optimizer import offload_optimizer as offload_optimizer
from jshard._state.optimizer import shard_optimizer as shard_optimizer

__all__ = ["offload_optimizer", "shard_optimizer"]
