"""The out-of-memory frontier: which training configurations fit a per-device budget, ranked.

[Note: frontier] Memory grows with the batch for every other setting fixed, so for each
combination of ``reshard_after_forward``, remat, mixed precision and offload the search
compiles batches in increasing order and stops at the first that does not fit: each
combination's frontier costs at most one compile past it. Every configuration that fits
is ranked by the analytic step time (:func:`estimate`) per sample. The budget is
compared with the compiled peak (arguments + outputs + temporaries - aliased), which is
what the device must hold at once.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jshard._plan.compiler import CompileTarget
from jshard._plan.estimate import Estimate, estimate
from jshard._plan.hardware import HardwareProfile
from jshard._plan.planner import Plan, compile_target, plan_here, plan_mesh, run_in_devices
from jshard._plan.target import REMATS, PlanConfig, spec_of

CPU_CAVEAT = (
    "Memory is XLA:CPU's compiled program for simulated devices. A GPU or TPU compiler fuses, schedules and "
    "lays out buffers differently, so its peak may differ (activations and scratch most; arguments and "
    "collectives are the same program); keep headroom, and check a chosen configuration on one device "
    "with `python -m benchmarks.accelerator`, which prints measured against planned memory."
)


@dataclasses.dataclass(frozen=True)
class FrontierRow:
    """One compiled configuration: its peak, whether it fits, and its estimate if it does."""

    plan: Plan
    fits: bool
    estimate: Estimate | None


@dataclasses.dataclass(frozen=True)
class Frontier:
    """Every configuration the search compiled, the fitting ones ranked fastest first per sample."""

    budget: float
    hardware: HardwareProfile
    rows: tuple[FrontierRow, ...]

    @property
    def ranked(self) -> list[FrontierRow]:
        return sorted((r for r in self.rows if r.fits), key=lambda r: -r.estimate.samples_per_second)

    def __str__(self) -> str:
        gib, ranked = 2.0**30, self.ranked
        lines = [f"out-of-memory frontier on {self.hardware.name} (budget {self.budget / gib:.1f} GiB/device; "
                 f"{len(self.rows)} configurations compiled, {len(ranked)} fit)", "",
                 f"  {'configuration':<60}{'peak GiB':>10}{'step ms':>10}{'samples/s/dev':>15}{'MFU@peak':>10}"]
        for row in ranked:
            e = row.estimate
            lines.append(f"  {row.plan.config.describe():<60}{row.plan.report.memory.peak / gib:>10.2f}"
                         f"{e.step * 1e3:>10.2f}{e.samples_per_second:>15.2f}{e.compute_share:>10.2f}")
        over = [r for r in self.rows if not r.fits]
        if over:
            lines += ["", "  past the frontier (first batch that does not fit, per combination):"]
            lines += [f"  {r.plan.config.describe():<60}{r.plan.report.memory.peak / gib:>10.2f}" for r in over]
        if ranked:
            lines += ["", f"best: {ranked[0].plan.config.describe()}, because"]
            lines += [f"  {why}" for why in ranked[0].estimate.reasoning]
        on_cpu = any(r.plan.platform == "cpu" for r in self.rows)
        return "\n".join(lines + (["", CPU_CAVEAT] if on_cpu else []))


def frontier(build: Callable[..., Any] | str, *, devices: int | None = None, budget: float, hardware: HardwareProfile,
             replicate: int = 1, tensor_parallel: int = 1, batches: Sequence[int] = (1, 2, 4, 8, 16),
             reshard_after_forward: Sequence[bool] = (True, False), remats: Sequence[str] = REMATS,
             mixed_precision: Sequence[bool] = (True, False), offload: Sequence[bool] = (False,),
             target: str | CompileTarget | None = None) -> Frontier:
    """Search the configurations of ``build`` that fit ``budget`` bytes per device, compile only.

    With fewer devices here than ``devices``, the search runs in one subprocess with that
    many simulated CPU devices (as :func:`plan` does); ``target`` plans on another compiler
    (``"tpu:v5p-256"``: see [Note: compile target]). See [Note: frontier].

    Example:
      >>> import jshard as js
      >>> from jshard.report import HARDWARE, frontier
      >>> f = frontier("jshard.demo.plan:build_tiny", devices=8, budget=2**20, hardware=HARDWARE["h100"],
      ...              batches=(64, 128), reshard_after_forward=(True,), remats=("full",), mixed_precision=(False,))
      >>> [(row.plan.config.batch_per_device, row.fits) for row in f.rows], f.ranked
      ([(64, False)], [])
    """
    where = compile_target(target, devices)
    devices = where.devices
    if where.platform == "cpu" and len(jax.devices()) < devices:
        grid = {"batches": list(batches), "reshard_after_forward": list(reshard_after_forward),
                "remats": list(remats), "mixed_precision": list(mixed_precision), "offload": list(offload)}
        argv = ["frontier", spec_of(build), "--devices", str(devices), "--replicate", str(replicate),
                "--tensor-parallel", str(tensor_parallel), "--hbm", str(budget), "--hardware-json",
                json.dumps(dataclasses.asdict(hardware)), "--grid", json.dumps(grid)]
        return frontier_from_dict(run_in_devices(argv, devices))
    mesh = plan_mesh(devices, replicate, tensor_parallel, where.tpu_devices() if where.platform == "tpu" else None)
    rows = []
    for raf, remat, mp, off in itertools.product(reshard_after_forward, remats, mixed_precision, offload):
        for batch in sorted(batches):
            config = PlanConfig(batch, raf, remat, mp, off)
            planned = plan_here(build, config, mesh)
            fits = planned.report.memory.peak <= budget
            rows.append(FrontierRow(planned, fits, estimate(planned, hardware) if fits else None))
            if not fits:
                break
    return Frontier(budget, hardware, tuple(rows))


def frontier_to_dict(result: Frontier) -> dict[str, Any]:
    return {"budget": result.budget, "hardware": dataclasses.asdict(result.hardware),
            "rows": [{"plan": r.plan.to_dict(), "fits": r.fits} for r in result.rows]}


def frontier_from_dict(data: dict[str, Any]) -> Frontier:
    hardware = HardwareProfile(**data["hardware"])
    rows = []
    for r in data["rows"]:
        planned = Plan.from_dict(r["plan"])
        rows.append(FrontierRow(planned, r["fits"], estimate(planned, hardware) if r["fits"] else None))
    return Frontier(data["budget"], hardware, tuple(rows))
