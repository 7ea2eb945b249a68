"""The policy of :func:`jshard.pipeline`: a frozen, hashable dataclass validated on construction."""

from __future__ import annotations

import dataclasses

GATHER_CHOICES = ("per_microbatch", "once")
SCHEDULE_CHOICES = ("gpipe", "1f1b")


@dataclasses.dataclass(frozen=True)
class PipelinePolicy:
    """How :func:`jshard.pipeline` runs a stack of layers as pipeline stages: the schedule and the gathers.

    With ``S`` stages of ``K = ceil(L / S)`` layers, ``M`` microbatches, ``F`` devices on a
    stage's shard axes and ``W`` the bytes of one gathered layer (in ``param_dtype``):

    - ``gather="per_microbatch"`` (MaxText's ``pipeline_fsdp_ag_per_repeat``): each of the
      ``M + S - 1`` schedule steps (bubble steps included) gathers the stage's layers one at a
      time, so a device holds one gathered layer (and the next, prefetched) at a time; each
      device sends ``(M + S - 1) * K * W * (F - 1) / F`` bytes of all-gathers in forward,
      re-gathers in backward what backward reads (the matrices; a bias its gradient does not
      need), and reduce-scatters every layer's gradient at every step, as much again.
    - ``gather="once"`` (MaxText's ``pipeline_fsdp_ag_once``): the stage's ``K`` layers are
      gathered before the schedule and their gradients reduce-scattered once after it: a
      device holds ``K * W`` of gathered weights and as much of full gradient through the
      step, and sends ``K * W * (F - 1) / F`` per all-gather (one in forward; XLA:TPU gathers
      again for backward, XLA:CPU keeps the forward's, as measured) and as much for the one
      reduce-scatter.

    Both schedules idle ``(S - 1) / (M + S - 1)`` of the step (the bubble); they differ in the
    activations a stage keeps for backward (``A``: one layer's saved activations of one
    microbatch; [Note: 1F1B schedule]):

    - ``schedule="gpipe"``: all forwards, then JAX's transpose of them: every stage keeps
      ``(M + S - 1) * K * A`` (one per layer and schedule step, bubble steps included).
    - ``schedule="1f1b"``: after a warm-up of forwards each stage runs one forward and one
      backward per schedule step, so a stage keeps at most ``min(2 S - 1, M) * K * A``,
      not growing with ``M``. Its backward runs inside the schedule, so it needs the loss:
      ``js.pipeline(..., loss=fn, targets=...)``.

    Args:
      axis: the mesh axis whose devices are the stages.
      microbatches: ``M``, how many microbatches the schedule runs (``None``: ``S``).
      gather: ``"per_microbatch"`` or ``"once"`` (above).
      schedule: ``"gpipe"`` or ``"1f1b"`` (above).

    Example:
      >>> import jshard as js
      >>> js.PipelinePolicy(microbatches=4, gather="once", schedule="1f1b").schedule
      '1f1b'
    """

    axis: str = "stage"
    microbatches: int | None = None
    gather: str = "per_microbatch"
    schedule: str = "gpipe"

    def __post_init__(self):
        if not isinstance(self.axis, str) or not self.axis:
            raise ValueError(f"`axis` must be a mesh axis name, got {self.axis!r}.")
        m = self.microbatches
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"`microbatches` must be a positive int or None (one per stage), got {m!r}.")
        if self.gather not in GATHER_CHOICES:
            raise ValueError(f"`gather` must be one of {GATHER_CHOICES}, got {self.gather!r}.")
        if self.schedule not in SCHEDULE_CHOICES:
            raise ValueError(f"`schedule` must be one of {SCHEDULE_CHOICES}, got {self.schedule!r}.")
