"""Per-device memory against mesh size: the 1/N + constant law of FSDP, measured by planning.

[Note: scaling law] Sharded state (parameters, gradients, optimizer state) falls as 1/N;
what each device computes on (its batch's activations, one or two gathered units, one
unit's full gradient before the reduce-scatter) does not depend on N when the batch per
device is fixed. So peak(N) = S/N + C. :func:`scaling` plans the step at each N and fits
S and C by least squares; C is the FSDP bound's gathered units plus the activations, the
floor no mesh size removes (tensor parallelism, remat and smaller batches lower it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jshard._plan.compiler import CompileTarget
from jshard._plan.planner import Plan, plan
from jshard._plan.target import PlanConfig


@dataclasses.dataclass(frozen=True)
class Scaling:
    """Plans of one builder over mesh sizes, with the fitted law ``peak = sharded / N + constant``."""

    plans: tuple[Plan, ...]
    sharded: float
    constant: float

    @property
    def devices(self) -> list[int]:
        """Mesh sizes, one per plan, counting every axis (with tensor parallelism, data-parallel x tp)."""
        return [math.prod(p.report.mesh.values()) for p in self.plans]

    def __str__(self) -> str:
        mib = 2.0**20
        where = self.plans[0].platform
        lines = [f"per-device memory of {self.plans[0].target} ({self.plans[0].config.describe()}) against N, "
                 f"compiled for {where}",
                 f"  {'N':>6}{'arguments':>12}{'x N':>12}{'temp':>10}{'peak':>10}{'fit':>10}"
                 f"{'3 units':>10}{'all-gather/step':>17}   (MiB)"]
        for n, p in zip(self.devices, self.plans, strict=True):
            m, a = p.report.memory, p.report.analytic
            gather = p.report.collective_bytes["all-gather"]
            lines.append(f"  {n:>6}{m.argument / mib:>12.1f}{m.argument * n / 2**30:>10.2f}Gi{m.temp / mib:>10.1f}"
                         f"{m.peak / mib:>10.1f}{(self.sharded / n + self.constant) / mib:>10.1f}"
                         f"{3 * a.gathered_unit_bytes / mib:>10.1f}{gather / mib:>17.1f}")
        lines.append(f"  fit: peak = {self.sharded / 2**30:.2f} GiB / N + {self.constant / mib:.1f} MiB "
                     "(the constant: gathered units, one unit's gradient, activations and scratch)")
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """Write a PNG of peak, arguments and temporaries against N, with the fitted law."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        n = np.array(self.devices, float)
        mem = [p.report.memory for p in self.plans]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ax.loglog(n, [m.peak / 2**30 for m in mem], "o-", label="peak (compiled)")
        ax.loglog(n, [m.argument / 2**30 for m in mem], "s-", label="arguments (sharded state)")
        ax.loglog(n, [m.temp / 2**30 for m in mem], "^-", label="temporaries")
        ax.loglog(n, (self.sharded / n + self.constant) / 2**30, "k--",
                  label=f"{self.sharded / 2**30:.1f} GiB / N + {self.constant / 2**30:.2f} GiB")
        ax.set_xlabel("devices N")
        ax.set_ylabel("GiB per device")
        ax.set_title(f"{self.plans[0].target}: {self.plans[0].config.describe()}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def scaling(build: Callable[..., Any] | str, devices: Sequence[int] = (8, 16, 32, 64, 128, 256, 512, 1024), *,
            replicate: int = 1, tensor_parallel: int = 1, config: PlanConfig | None = None,
            target: CompileTarget | None = None) -> Scaling:
    """Plan ``build`` at each mesh size and fit ``peak = sharded / N + constant``.

    ``target``: a TPU :class:`CompileTarget` plans each size on a slice of its generation
    (``devices`` counts chips, up to the target's), compiled by XLA:TPU; default simulated CPU.

    Example:
      >>> from jshard.report import scaling
      >>> s = scaling("jshard.demo.plan:build_tiny", (4, 8))
      >>> s.devices, s.plans[0].report.memory.argument > s.plans[1].report.memory.argument
      ([4, 8], True)
    """
    if target is not None and target.platform == "tpu":
        sizes = [n for n in devices if n <= target.devices]
        if not sizes:
            raise ValueError(f"No size of {list(devices)} fits the target's {target.devices} chips: "
                             "give --devices up to the target's size.")
        plans = tuple(plan(build, devices=n, replicate=replicate, tensor_parallel=tensor_parallel, config=config,
                           target=target.resized(n)) for n in sizes)
    else:
        plans = tuple(plan(build, devices=n, replicate=replicate, tensor_parallel=tensor_parallel, config=config)
                      for n in devices)
    n = np.array([math.prod(p.report.mesh.values()) for p in plans], float)
    peak = np.array([p.report.memory.peak for p in plans], float)
    sharded, constant = np.linalg.lstsq(np.stack([1 / n, np.ones_like(n)], 1), peak, rcond=None)[0]
    return Scaling(plans, float(sharded), float(constant))
