"""An analytic plan of pipeline stages over FSDP x TP: ``(stage, fsdp, tp)`` ranked against ``(fsdp, tp)``.

[Note: stage plan] Estimated, not compiled: compiling a 70B pipeline on hundreds of
simulated devices is out of reach here, so each mesh ``(S, F, T)`` with ``M`` microbatches
, a ``PipelinePolicy.gather`` and a schedule (GPipe or 1F1B) is costed from the model's shape with the formulas of
docs/parallelism.md, the ones ``tests/test_pipeline.py`` checks against compiled steps on
small meshes (loop trips ``M + S - 1``, ``ppermute`` and FSDP bytes, FLOPs ``(M + S - 1) / M
x S K / L``). ``S = 1`` is FSDP x TP alone (every layer gathered once in forward and again in
backward, as ``reshard_after_forward=True``). Per device, with ``K = ceil(L / S)``, ticks
``t = M + S - 1``, ``N`` the tokens of an ``fsdp`` column (``S = 1``: of a device), bf16
gathers and activations, fp32 masters, gradients and AdamW moments (16 B a parameter):

- state: ``16 (S K P_layer / (S F T) + P_other / (S F T))``;
- gathered: ``"per_microbatch"`` two bf16 layers (one prefetched) and one fp32 layer gradient
  (``8 P_layer / T``), ``"once"`` the stage's ``K`` layers and their gradients (``6 K P_layer / T``);
- activations: each layer's input kept for backward, ``K N dim`` bf16 under GPipe (all ``M``
  microbatches), ``min(2 S - 1, M) / M`` of it under 1F1B (the microbatches in flight on
  stage 0, docs/parallelism.md), plus one layer's recompute on a microbatch
  (``model.live_per_token`` bytes a token);
- compute: ``4 x`` the forward FLOPs (forward, recompute, backward) of the tokens, times
  ``t / M x S K / L`` (bubble steps and padding layers compute too), at the bf16 peak; under
  1F1B the head and loss run inside the schedule on every stage, so their FLOPs are not split
  over ``S``;
- traffic: FSDP all-gathers (bf16) and reduce-scatters (fp32) of ``(F - 1) / F`` of each
  gathered layer (``2 t K`` gathers and ``t K`` reduce-scatters, or ``2 K`` and ``K`` gathered
  once); ``2 t`` microbatch ``ppermute``s and the rows in and out over ``stage``; Megatron's
  ``6`` all-reduces a layer (forward, recompute, backward) over ``tp``.

The step time is the compute plus what is exposed: FSDP traffic past the compute and the
first layer's gather (as :func:`jshard.report.estimate`), and all of the ``tp`` and
``stage`` traffic (inside each layer, and between schedule steps), on one link bandwidth.
"""

from __future__ import annotations

import dataclasses
import math

from jshard._plan.hardware import HardwareProfile

_BF16, _FP32, _STATE = 2, 4, 16


@dataclasses.dataclass(frozen=True)
class StackModel:
    """The shape of a model whose repeated layers can run as pipeline stages.

    Attributes:
      name: what the plan calls it.
      layers: ``L``.
      layer_params: parameters of one layer.
      other_params: parameters outside the stack (embedding, head, final norm).
      dim: the width of the activations between layers.
      seq_len: tokens a sequence.
      layer_flops_per_token: one layer's forward FLOPs a token (matmuls and attention).
      other_flops_per_token: the forward FLOPs a token outside the stack (the head).
      live_per_token: bytes a token of one layer's recompute holds (its temporaries).

    Example:
      >>> from jshard._plan.stage_plan import StackModel
      >>> StackModel("toy", 4, 100, 10, 8, 16, 200.0, 20.0, 64.0).layers
      4
    """

    name: str
    layers: int
    layer_params: int
    other_params: int
    dim: int
    seq_len: int
    layer_flops_per_token: float
    other_flops_per_token: float
    live_per_token: float

    def __post_init__(self):
        for field in ("layers", "layer_params", "dim", "seq_len"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StackModel {self.name!r}: `{field}` must be a positive int, got {value!r}.")
        for field in ("other_params", "layer_flops_per_token", "other_flops_per_token", "live_per_token"):
            if getattr(self, field) < 0:
                raise ValueError(f"StackModel {self.name!r}: `{field}` must be >= 0, got {getattr(self, field)!r}.")


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One mesh ``(stage, fsdp, tp)``, its schedule, and its estimated cost per device (bytes, seconds)."""

    stages: int
    fsdp: int
    tp: int
    microbatches: int
    gather: str
    schedule: str
    memory: dict[str, float]
    traffic: dict[str, float]
    compute: float
    exposed: float
    step: float
    tokens_per_second: float
    fits: bool

    @property
    def bubble(self) -> float:
        """``(S - 1) / (M + S - 1)``: the share of schedule steps a stage computes what is thrown away."""
        return (self.stages - 1) / (self.microbatches + self.stages - 1)

    def describe(self) -> str:
        mesh = f"stage {self.stages} x fsdp {self.fsdp} x tp {self.tp}"
        schedule = (f"{self.schedule} M={self.microbatches} {self.gather} bubble {self.bubble:.1%}"
                    if self.stages > 1 else "no pipeline")
        return (f"{mesh:<28} {schedule:<39} {sum(self.memory.values()) / 2**30:7.1f} GiB"
                f"{'' if self.fits else ' (over)':<7} step {self.step:7.2f} s (compute {self.compute:6.2f}, exposed "
                f"{self.exposed:6.2f}) {self.tokens_per_second:8.1f} tokens/s/device")


def estimate_stages(model: StackModel, stages: int, fsdp: int, tp: int, microbatches: int, gather: str,
                    global_batch: int, hardware: HardwareProfile, schedule: str = "gpipe") -> StagePlan:
    """The estimated cost of one configuration ([Note: stage plan]); ``global_batch`` in sequences,
    ``schedule`` ``"gpipe"`` or ``"1f1b"`` (``PipelinePolicy.schedule``).

    Example:
      >>> from jshard._plan.stage_plan import StackModel, estimate_stages
      >>> from jshard.report import HARDWARE
      >>> toy = StackModel("toy", 5, 10**6, 10**5, 1024, 512, 2e6, 2e5, 1e4)
      >>> plan = estimate_stages(toy, 2, 4, 1, 4, "once", 64, HARDWARE["h100"])
      >>> plan.bubble, plan.step > plan.compute > 0
      (0.2, True)
    """
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"schedule must be 'gpipe' or '1f1b', got {schedule!r}.")
    per_stage = math.ceil(model.layers / stages)
    in_flight = min(2 * stages - 1, microbatches) / microbatches if schedule == "1f1b" and stages > 1 else 1.0
    head_on = stages if schedule == "1f1b" and stages > 1 else 1  # stages running the head and loss on a token
    ticks = microbatches + stages - 1 if stages > 1 else 1
    column_tokens = global_batch * model.seq_len / fsdp  # an fsdp column's rows (S = 1: one device's)
    layer = model.layer_params / tp
    state = _STATE * (stages * per_stage * model.layer_params + model.other_params) / (stages * fsdp * tp)
    gathered = per_stage * layer * (_BF16 + _FP32) if gather == "once" else layer * (2 * _BF16 + _FP32)
    memory = {"state": state, "gathered": gathered,
              "activations": per_stage * column_tokens * in_flight * model.dim * _BF16
              + column_tokens / microbatches * model.live_per_token}
    flops = 4 * global_batch * model.seq_len * (model.layers * model.layer_flops_per_token * ticks / microbatches
                                                * stages * per_stage / model.layers
                                                + model.other_flops_per_token * head_on)
    compute = flops / (stages * fsdp * tp) / hardware.bf16_flops
    gathers = (1 if gather == "once" else ticks) * per_stage
    share = (fsdp - 1) / fsdp
    microbatch_bytes = column_tokens / microbatches * model.dim * _BF16
    traffic = {
        "fsdp all-gather": 2 * gathers * layer * _BF16 * share,
        "fsdp reduce-scatter": gathers * layer * _FP32 * share,
        "stage ppermute": 2 * ticks * microbatch_bytes if stages > 1 else 0.0,
        "stage rows in and out": 4 * (stages - 1) / stages * column_tokens * model.dim * _BF16,
        "tp all-reduce": 6 * ticks * per_stage * microbatch_bytes * 2 * (tp - 1) / tp,
    }
    link = hardware.link_bandwidth
    fsdp_time = (traffic["fsdp all-gather"] + traffic["fsdp reduce-scatter"]) / link
    first_gather = layer * _BF16 * share / link
    exposed = min(fsdp_time, first_gather + max(0.0, fsdp_time - first_gather - compute)) + sum(
        v for k, v in traffic.items() if not k.startswith("fsdp")) / link
    step = compute + exposed
    tokens = global_batch * model.seq_len / (stages * fsdp * tp)
    return StagePlan(stages, fsdp, tp, microbatches, gather, schedule if stages > 1 else "none", memory, traffic,
                     compute, exposed, step, tokens / step, sum(memory.values()) <= hardware.hbm_bytes)


def rank_stages(model: StackModel, devices: int, global_batch: int, hardware: HardwareProfile,
                tensor_parallel: tuple[int, ...] = (1, 2, 4, 8), microbatch_factors: tuple[int, ...] = (1, 2, 4)
                ) -> list[StagePlan]:
    """Every ``(S, F, T)`` of ``devices`` (``S <= L``; ``S = 1`` FSDP x TP alone) the batch divides, with
    ``M = S x`` each factor, both gather policies and both schedules: those that fit first, fastest first.

    Example:
      >>> from jshard._plan.stage_plan import StackModel, rank_stages
      >>> from jshard.report import HARDWARE
      >>> toy = StackModel("toy", 8, 10**6, 10**5, 1024, 512, 2e6, 2e5, 1e4)
      >>> best = rank_stages(toy, 16, 64, HARDWARE["h100"])[0]
      >>> best.stages * best.fsdp * best.tp
      16
    """
    plans = []
    for tp in (t for t in tensor_parallel if devices % t == 0):
        for stages in (s for s in range(1, model.layers + 1) if devices // tp % s == 0):
            fsdp = devices // (tp * stages)
            column = global_batch // fsdp  # the sequences of an fsdp column
            if global_batch % (stages * fsdp):
                continue
            schedules = [(1, "per_microbatch", "gpipe")] if stages == 1 else [
                (stages * f, g, kind) for f in microbatch_factors for g in ("per_microbatch", "once")
                for kind in ("gpipe", "1f1b") if column % (stages * f) == 0]
            plans += [estimate_stages(model, stages, fsdp, tp, m, g, global_batch, hardware, kind)
                      for m, g, kind in schedules]
    return sorted(plans, key=lambda p: (not p.fits, p.step))
