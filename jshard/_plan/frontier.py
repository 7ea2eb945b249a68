"""The out-of-memory frontier: which training configurations fit a per-device budget, ranked.

[Note: frontier] Memory grows with the batch for every other setting fixed, so for each
combination of ``reshard_after_forward``, remat, mixed precision, offload and, where asked,
``replicate_below`` and ``weight_gradients`` (each a trade per model on XLA:TPU) the search
compiles batches in increasing order and stops at the first that does not fit: each
combination's frontier costs at most one compile past it. By default it compiles less, a
first answer, from what the configurations compiled so far show ([Note: frontier search]
in ``search.py``); ``full=True`` compiles every combination. Every configuration that fits
is ranked by the analytic step time (:func:`estimate`) per sample. The budget is compared
with the compiled peak (arguments + outputs + temporaries - aliased), which is what the
device must hold at once.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jshard._plan.compiler import CompileTarget
from jshard._plan.estimate import Estimate, estimate
from jshard._plan.hardware import HardwareProfile
from jshard._plan.planner import Plan, compile_target, plan_here, plan_mesh, run_in_devices
from jshard._plan.search import FrontierRow, Grid, Skipped, first_answer, full_grid
from jshard._plan.target import REMATS, PlanConfig, spec_of
from jshard._sharding.platform_defaults import platform_layout

CPU_CAVEAT = (
    "Memory is XLA:CPU's compiled program for simulated devices. A GPU or TPU compiler fuses, schedules and "
    "lays out buffers differently, so its peak may differ (activations and scratch most; arguments and "
    "collectives are the same program); keep headroom, and check a chosen configuration on one device "
    "with `python -m benchmarks.accelerator`, which prints measured against planned memory."
)


@dataclasses.dataclass(frozen=True)
class Frontier:
    """Every configuration the search compiled, the fitting ones ranked fastest first per sample (on a
    tie, the lower peak, then jshard's defaults).

    ``skipped``: the grid's configurations a first-answer search did not compile, with why
    (empty for the full grid, ``full=True``).
    """

    budget: float
    hardware: HardwareProfile
    rows: tuple[FrontierRow, ...]
    skipped: tuple[Skipped, ...] = ()
    full: bool = True

    @property
    def ranked(self) -> list[FrontierRow]:
        return sorted((r for r in self.rows if r.fits), key=_rank)

    def __str__(self) -> str:
        ranked = self.ranked
        unit, scale = ("GiB", 2.0**30) if self.budget >= 2**30 else ("MiB", 2.0**20)  # a small budget in MiB
        width = max([60] + [len(r.plan.config.describe()) + 2 for r in self.rows])
        head = f"  {'configuration':<{width}}{f'peak {unit}':>10}{'step ms':>10}{'samples/s/dev':>15}{'MFU@peak':>10}"
        lines = [f"out-of-memory frontier on {self.hardware.name} (budget {self.budget / scale:.1f} {unit}/device; "
                 f"{len(self.rows)} configurations compiled, {len(ranked)} fit)", *self._search_lines(), "", head]
        for row in ranked:
            e = row.estimate
            lines.append(f"  {row.plan.config.describe():<{width}}{row.plan.report.memory.peak / scale:>10.2f}"
                         f"{e.step * 1e3:>10.2f}{e.samples_per_second:>15.2f}{e.compute_share:>10.2f}")
        over = [r for r in self.rows if not r.fits]
        if over:
            lines += ["", "  past the frontier (first batch that does not fit, per combination):"]
            lines += [f"  {r.plan.config.describe():<{width}}{r.plan.report.memory.peak / scale:>10.2f}" for r in over]
        if ranked:
            lines += ["", f"best: {ranked[0].plan.config.describe()}, because"]
            lines += [f"  {why}" for why in ranked[0].estimate.reasoning]
        on_cpu = any(r.plan.platform == "cpu" for r in self.rows)
        return "\n".join(lines + (["", CPU_CAVEAT] if on_cpu else []))

    def _search_lines(self) -> list[str]:
        if self.full:
            return []
        kinds = collections.Counter(s.kind for s in self.skipped)
        return [f"first answer: {len(self.skipped)} of the grid's configurations not compiled ("
                + ", ".join(f"{n} {kind}" for kind, n in kinds.items()) + "; see [Note: frontier search]); "
                "--full compiles the whole grid"]


def _rank(row: FrontierRow) -> tuple:
    """Fastest per sample first; on a tie the lower peak, then FSDP2's layout (weight gradients reduced,
    every leaf sharded): an option that changes nothing for this model is not the one recommended."""
    config = row.plan.config
    return (-row.estimate.samples_per_second, row.plan.report.memory.peak, config.weight_gradients != "reduced",
            config.replicate_below)


def frontier(build: Callable[..., Any] | str, *, devices: int | None = None, budget: float, hardware: HardwareProfile,
             replicate: int = 1, tensor_parallel: int = 1, batches: Sequence[int] = (1, 2, 4, 8, 16),
             reshard_after_forward: Sequence[bool] = (True, False), remats: Sequence[str] = REMATS,
             mixed_precision: Sequence[bool] = (True, False), offload: Sequence[bool] = (False,),
             replicate_below: Sequence[int | None] = (None,), weight_gradients: Sequence[str | None] = (None,),
             target: str | CompileTarget | None = None, full: bool = False) -> Frontier:
    """Search the configurations of ``build`` that fit ``budget`` bytes per device, compile only.

    By default a first answer: only what can change the ranking's top is compiled, judged from
    what has been compiled ([Note: frontier search]); ``full=True`` compiles every combination.
    With fewer devices here than ``devices``, the search runs in one subprocess with that
    many simulated CPU devices (as :func:`plan` does); ``target`` plans on another compiler
    (``"tpu:v5p-256"``: see [Note: compile target]). ``replicate_below`` and ``weight_gradients``
    are :class:`PlanConfig`'s, each value tried as a setting of its own (``(0, 4096)``,
    ``("reduced", "from_activations")``: plan both, as docs/planning.md advises on XLA:TPU); ``None``
    (the default) is the target's choice ([Note: platform defaults]).
    See [Note: frontier].

    Example:
      >>> import jshard as js
      >>> from jshard.report import HARDWARE, frontier
      >>> f = frontier("jshard.demo.plan:build_tiny", devices=8, budget=2**20, hardware=HARDWARE["h100"],
      ...              batches=(64, 128), reshard_after_forward=(True,), remats=("full",), mixed_precision=(False,))
      >>> [(row.plan.config.batch_per_device, row.fits) for row in f.rows], f.ranked
      ([(64, False)], [])
    """
    where = compile_target(target, devices)
    layout = platform_layout(where.device_kind)
    chosen = {name: list(dict.fromkeys(layout[name] if v is None else v for v in values))
              for name, values in (("replicate_below", replicate_below), ("weight_gradients", weight_gradients))}
    grid = Grid(list(batches), list(reshard_after_forward), list(remats), list(mixed_precision), list(offload),
                **chosen)
    devices = where.devices
    if where.platform == "cpu" and len(jax.devices()) < devices:
        argv = ["frontier", spec_of(build), "--devices", str(devices), "--replicate", str(replicate),
                "--tensor-parallel", str(tensor_parallel), "--hbm", str(budget), "--hardware-json",
                json.dumps(dataclasses.asdict(hardware)), "--grid", json.dumps({**dataclasses.asdict(grid),
                                                                                  "full": full})]
        return frontier_from_dict(run_in_devices(argv, devices))
    mesh = plan_mesh(devices, replicate, tensor_parallel, where.tpu_devices() if where.platform == "tpu" else None)

    def compile_one(config: PlanConfig) -> FrontierRow:
        planned = plan_here(build, config, mesh)
        fits = planned.report.memory.peak <= budget
        return FrontierRow(planned, fits, estimate(planned, hardware) if fits else None)

    rows, skipped = full_grid(compile_one, grid) if full else first_answer(compile_one, grid, hardware)
    return Frontier(budget, hardware, tuple(rows), tuple(skipped), full)


def frontier_to_dict(result: Frontier) -> dict[str, Any]:
    """What the text shows, as data: every compiled row with its rank and estimate, the ranking, what was skipped.

    ``ranking`` lists row indices, fastest per sample first; each fitting row's ``estimate``
    has the step time's parts (seconds) and the reasoning.
    """
    ranked = result.ranked
    rank = {id(row): i + 1 for i, row in enumerate(ranked)}
    rows = [{"plan": r.plan.to_dict(), "fits": r.fits, "rank": rank.get(id(r)),
             "estimate": {**dataclasses.asdict(r.estimate), "compute_share": r.estimate.compute_share}
             if r.estimate else None} for r in result.rows]
    index = {id(row): i for i, row in enumerate(result.rows)}
    return {"budget": result.budget, "hardware": dataclasses.asdict(result.hardware), "full": result.full,
            "ranking": [index[id(r)] for r in ranked], "rows": rows, "caveat": CPU_CAVEAT,
            "skipped": [{"config": dataclasses.asdict(s.config), "kind": s.kind, "why": s.why}
                        for s in result.skipped]}


def frontier_from_dict(data: dict[str, Any]) -> Frontier:
    """The frontier :func:`frontier_to_dict` gave."""
    fields = [f.name for f in dataclasses.fields(Estimate)]
    rows = tuple(FrontierRow(Plan.from_dict(r["plan"]), r["fits"], Estimate(**{
        **{k: r["estimate"][k] for k in fields}, "reasoning": tuple(r["estimate"]["reasoning"])})
        if r["estimate"] else None) for r in data["rows"])
    skipped = tuple(Skipped(PlanConfig(**s["config"]), s["kind"], s["why"]) for s in data["skipped"])
    return Frontier(data["budget"], HardwareProfile(**data["hardware"]), rows, skipped, data["full"])
