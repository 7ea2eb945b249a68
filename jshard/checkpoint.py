"""Orbax checkpoints of sharded train states that restore onto any mesh (see ``docs/checkpoint.md``)."""

from jshard._state.checkpoint import CheckpointManager as CheckpointManager

__all__ = ["CheckpointManager"]
