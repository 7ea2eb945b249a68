"""Feeding data: each process's local batch becomes one global batch for the step (see ``docs/multihost.md``)."""

from jshard._step.global_batch import global_batch as global_batch

__all__ = ["global_batch"]
