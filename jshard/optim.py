"""Optax on sharded parameters (see :func:`shard_optimizer`)."""

from jshard._optim import shard_optimizer as shard_optimizer

__all__ = ["shard_optimizer"]
