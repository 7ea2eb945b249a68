"""An analytic step time for a plan on a hardware profile: compute against exposed communication.

[Note: step-time estimate] The compiled step's matmul FLOPs (:func:`matmul_flops`) at the
chip's peak give the compute time, a lower bound (no chip reaches its peak; MFU 40-60%
is typical of large transformer training). The data-parallel collectives (FSDP's
all-gathers and reduce-scatters, HSDP's all-reduce) run on the links while the previous
unit computes, so only the part beyond the compute time is exposed, plus the first
unit's all-gather, which nothing hides. Collectives over model axes (tensor
parallelism's) sit inside a layer's compute and are counted as exposed; so are host
transfers of offloaded state beyond what the compute hides. The ranking this gives is
what matters; the absolute times are optimistic by the chip's real MFU.
"""

from __future__ import annotations

import dataclasses

from jshard._plan.hardware import HardwareProfile
from jshard._plan.planner import Plan


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Seconds per step on one profile, and what they come from."""

    compute: float
    communication: float
    exposed: float
    step: float
    samples_per_second: float
    reasoning: tuple[str, ...]

    @property
    def compute_share(self) -> float:
        """Compute time over step time (the estimate's model FLOPs utilisation at peak)."""
        return self.compute / self.step if self.step else 0.0


def estimate(plan: Plan, hardware: HardwareProfile) -> Estimate:
    """The step time of ``plan`` on ``hardware`` (see [Note: step-time estimate]).

    Example:
      >>> from jshard.report import HARDWARE, estimate, plan
      >>> e = estimate(plan("jshard.demo.plan:build_tiny", devices=8), HARDWARE["h100"])
      >>> e.step >= e.compute > 0, e.step == e.compute + e.exposed
      (True, True)
    """
    report, config = plan.report, plan.config
    a = report.analytic
    rate = hardware.bf16_flops if config.mixed_precision else hardware.fp32_flops
    compute = plan.flops / rate
    data_wire = sum(report.collective_bytes.values())
    model_wire = sum(report.model_collective_bytes.values())
    data_time = data_wire / hardware.link_bandwidth
    model_time = model_wire / hardware.link_bandwidth
    host_bytes = 2 * report.memory.host_argument
    host_time = host_bytes / hardware.host_bandwidth
    first_gather = a.gathered_unit_bytes * (a.shard_size - 1) / max(a.shard_size, 1) / hardware.link_bandwidth
    hidden_behind_compute = max(0.0, data_time + host_time - first_gather - compute)
    exposed = min(data_time + host_time, first_gather + hidden_behind_compute) + model_time
    step = compute + exposed
    batch = config.batch_per_device
    dtype = "bf16" if config.mixed_precision else "fp32 (TF32 on GPU, one bf16 pass on TPU)"
    ms = 1e3
    reasoning = (
        f"compute: {plan.flops:.3e} matmul FLOPs/device at {rate / 1e12:.0f} TFLOP/s {dtype} = "
        f"{compute * ms:.2f} ms",
        f"data-parallel collectives: {data_wire / 2**20:.1f} MiB/device at {hardware.link_bandwidth / 1e9:.0f} GB/s "
        f"= {data_time * ms:.2f} ms, hidden behind compute but the first unit's gather ({first_gather * ms:.2f} ms)"
        + (f" and {hidden_behind_compute * ms:.2f} ms beyond the compute" if hidden_behind_compute else ""),
        *([f"model-axis collectives: {model_wire / 2**20:.1f} MiB/device = {model_time * ms:.2f} ms, exposed "
           "(inside each layer)"] if model_wire else []),
        *([f"host transfers (offload): {host_bytes / 2**20:.1f} MiB at {hardware.host_bandwidth / 1e9:.0f} GB/s = "
           f"{host_time * ms:.2f} ms, overlapped like the collectives"] if host_bytes else []),
        f"step {step * ms:.2f} ms = compute {compute * ms:.2f} + exposed {exposed * ms:.2f}; "
        f"{batch / step:.1f} samples/s/device at peak FLOP/s (real MFU lowers both alike)",
    )
    return Estimate(compute, data_time + model_time + host_time, exposed, step, batch / step, reasoning)
