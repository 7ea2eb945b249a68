"""Which configurations the frontier search compiles: the whole grid, or a first answer that prunes it.

[Note: frontier search] Compiling is the search's whole cost (seconds to a minute per
configuration for an 8B model on 256 devices), so by default it compiles only what can
change the answer, from what it has compiled so far. It assumes what holds for a training
step: peak memory does not fall when the batch grows, without resharding after forward,
with a remat policy that keeps more (``full`` < ``dots`` < ``default``), or on device
instead of offloaded; the samples per second of one setting do not fall when its batch
grows (the collectives are the same per step); its matmul FLOPs grow with the batch in
proportion and do not depend on the precision, on which leaves are kept whole
(``replicate_below``) or on how weight gradients are formed (``weight_gradients``: the routed
matmuls do the same arithmetic). Nothing is assumed of memory across precisions (on XLA:CPU a
bf16 plan can hold more than the fp32 one, its collectives run in float32), across
``replicate_below`` or across ``weight_gradients`` (each a trade per model on XLA:TPU): a
configuration only bounds another with the same three. Then:

- a configuration that needs at least the memory of one past the budget is not compiled;
- each setting climbs its batches from the largest known to fit (one that needs no more
  memory than a configuration that fits) to the first past the budget: smaller batches are
  not compiled;
- a setting whose samples per second at the chip's peak FLOP/s (its FLOPs per sample from
  any compiled configuration with its remat, nothing exposed) cannot beat the best found is
  not compiled (fp32 on a GPU, whose fp32 rate is half its bf16 rate, once a bf16 setting
  runs near its peak);
- a setting with weight gradients from activations whose plan at some batch sends exactly what
  the reduced plan of that batch sends routes no matmul there (each is routed only where that
  sends less, and ``sends_less`` fails for more rows once it fails), so its larger batches are
  not compiled: they are the reduced setting's (a transformer at thousands of tokens per
  device routes nothing, and asking for both options then costs one compile more, not a
  second climb). A routed setting's memory can fall where a larger batch stops routing (and
  routing held more); the batches past its frontier are then its reduced twin's, compiled
  under that setting, so the ranking loses nothing;
- settings are tried fastest first: bf16 before fp32, resharding after forward (what large
  models need) before not, then the remat that recomputes least, on device before offload,
  then the larger ``replicate_below`` (fewer collectives), weight gradients reduced before
  routed (so that a routed plan can be compared with its reduced twin). The order only
  decides what is compiled first; the ranking compares what was compiled.

``--full`` (``frontier(..., full=True)``) compiles the whole grid: every setting's batches in
increasing order up to the first past the budget, which is also how the assumptions can be
checked for a model.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

from jshard._plan.estimate import Estimate
from jshard._plan.hardware import HardwareProfile
from jshard._plan.planner import Plan
from jshard._plan.target import PlanConfig

_REMAT_KEEPS = {"full": 0, "dots": 1, "default": 2}  # how much a remat policy keeps for backward, in order
# weight gradients in order: a routed plan's reduced twin first
_ROUTE_ORDER = {"reduced": 0, "from_activations": 1, "in_blocks": 2, "from_activations+in_blocks": 3}


@dataclasses.dataclass(frozen=True)
class FrontierRow:
    """One compiled configuration: its peak, whether it fits, and its estimate if it does."""

    plan: Plan
    fits: bool
    estimate: Estimate | None


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A configuration of the grid the first-answer search did not compile, and why.

    ``kind`` is ``"cannot fit"``, ``"smaller batch"``, ``"cannot beat the best"`` or ``"routes
    nothing"`` (weight gradients from activations where its plan at a smaller batch was the reduced one's).
    """

    config: PlanConfig
    kind: str
    why: str


@dataclasses.dataclass(frozen=True)
class Grid:
    """The settings the search varies (each a sequence of the values to try)."""

    batches: Sequence[int]
    reshard_after_forward: Sequence[bool]
    remats: Sequence[str]
    mixed_precision: Sequence[bool]
    offload: Sequence[bool]
    replicate_below: Sequence[int] = (0,)
    weight_gradients: Sequence[str] = ("reduced",)

    def __post_init__(self):
        empty = [f.name for f in dataclasses.fields(self) if not len(getattr(self, f.name))]
        if empty:
            raise ValueError(f"The frontier's grid needs at least one value of each setting; {', '.join(empty)} "
                             "got none.")
        for setting in self.settings():
            self.configs(setting)  # PlanConfig checks every value: a bad one fails before anything compiles

    def settings(self, fastest_first: bool = False) -> list[tuple]:
        """Every ``(reshard_after_forward, remat, mixed_precision, offload, replicate_below,
        weight_gradients)``: in the grid's order, or in the first answer's (fastest first)."""
        if not fastest_first:
            return list(itertools.product(self.reshard_after_forward, self.remats, self.mixed_precision,
                                          self.offload, self.replicate_below, self.weight_gradients))
        ordered = itertools.product(sorted(set(self.mixed_precision), reverse=True),
                                    sorted(set(self.reshard_after_forward), reverse=True),
                                    sorted(set(self.remats), key=_REMAT_KEEPS.get, reverse=True),
                                    sorted(set(self.offload)), sorted(set(self.replicate_below), reverse=True),
                                    sorted(set(self.weight_gradients), key=_ROUTE_ORDER.get))
        return [(raf, remat, mp, *rest) for mp, raf, remat, *rest in ordered]

    def configs(self, setting: tuple) -> list[PlanConfig]:
        """The setting's configurations, batches in increasing order."""
        raf, remat, mp, off, below, route = setting
        return [PlanConfig(b, raf, remat, mp, off, below, route) for b in sorted(set(self.batches))]


def _memory_order(config: PlanConfig) -> tuple[int, ...]:
    return (config.batch_per_device, int(not config.reshard_after_forward), _REMAT_KEEPS[config.remat],
            int(not config.offload))


def needs_no_more_than(a: PlanConfig, b: PlanConfig) -> bool:
    """Whether ``a`` needs no more memory than ``b`` by the search's assumptions (same precision, leaves kept
    whole and weight-gradient route; every other setting no larger)."""
    same = (a.mixed_precision, a.replicate_below, a.weight_gradients) == (
        b.mixed_precision, b.replicate_below, b.weight_gradients)
    return same and all(x <= y for x, y in zip(_memory_order(a), _memory_order(b), strict=True))


def full_grid(compile_one: Callable[[PlanConfig], FrontierRow], grid: Grid) -> tuple[list[FrontierRow], list]:
    """Every setting, its batches in increasing order up to the first past the budget."""
    rows = []
    for setting in grid.settings():
        for config in grid.configs(setting):
            rows.append(compile_one(config))
            if not rows[-1].fits:
                break
    return rows, []


def first_answer(compile_one: Callable[[PlanConfig], FrontierRow], grid: Grid,
                 hardware: HardwareProfile) -> tuple[list[FrontierRow], list[Skipped]]:
    """Compile only what can change the answer ([Note: frontier search]); the rows and what was skipped."""
    rows: list[FrontierRow] = []
    skipped: list[Skipped] = []
    for setting in grid.settings(fastest_first=True):
        configs = grid.configs(setting)
        fit = [i for i, c in enumerate(configs) if any(r.fits and needs_no_more_than(c, r.plan.config) for r in rows)]
        start, end = max(fit, default=0), len(configs)
        probe = _twin_fits_at(configs, rows)
        probed = probe is not None and probe > start and not (_cannot_fit(configs[probe], rows)
                                                               or _cannot_win(configs[probe], rows, hardware))
        if probed:  # where its reduced twin fits: one compile, if it routes nothing there
            rows.append(compile_one(configs[probe]))
            if rows[-1].fits:
                start = probe
            else:
                end = probe
                skipped += _past(configs[probe], configs[probe + 1 :])
        skipped += [Skipped(c, "smaller batch", f"batch {configs[start].batch_per_device} of the same setting "
                            "fits, at least as fast per sample") for c in configs[:start]]
        for i, config in enumerate(configs[start:end], start):
            if not (probed and i == probe):  # the probe, compiled above
                reason = _cannot_fit(config, rows) or _cannot_win(config, rows, hardware)
                if reason:
                    skipped += [Skipped(c, *reason) for c in configs[i:end]]
                    break
                rows.append(compile_one(config))
            if not rows[-1].fits:
                skipped += _past(config, configs[i + 1 : end])
                break
            if _routes_nothing(rows[-1], rows):
                skipped += [Skipped(c, "routes nothing", f"at batch {config.batch_per_device} its plan sends what "
                                    "the reduced one sends: no matmul is routed, nor with more rows")
                            for c in configs[i + 1 : end]]
                break
    return rows, skipped


def _past(config: PlanConfig, larger: list[PlanConfig]) -> list[Skipped]:
    return [Skipped(c, "cannot fit", f"batch {config.batch_per_device} of the same setting is past the budget")
            for c in larger]


def _twin_fits_at(configs: list[PlanConfig], rows: list[FrontierRow]) -> int | None:
    """For a setting with weight gradients from activations: the largest of its batches at which its
    reduced twin was compiled and fits (compiled there first: if nothing is routed, the setting is its
    twin from there on, and its smaller batches are no faster per sample)."""
    if configs[0].weight_gradients != "from_activations":
        return None
    fitting = {r.plan.config for r in rows if r.fits}
    return max((i for i, c in enumerate(configs) if _reduced_twin(c) in fitting), default=None)


def _routes_nothing(row: FrontierRow, rows: list[FrontierRow]) -> bool:
    """Whether ``row`` forms weight gradients from activations and its plan sends, by collective kind,
    exactly what its reduced twin's (compiled before it) sends: the step routed no matmul."""
    config = row.plan.config
    if config.weight_gradients != "from_activations":  # in blocks: the reduced bytes, every matmul rewritten
        return False
    reduced = next((r for r in rows if r.plan.config == _reduced_twin(config)), None)
    return reduced is not None and reduced.plan.report.collective_bytes == row.plan.report.collective_bytes


def _reduced_twin(config: PlanConfig) -> PlanConfig:
    """``config`` with FSDP2's reduced weight gradients: what a routed configuration is where it routes nothing."""
    return dataclasses.replace(config, weight_gradients="reduced")


def _cannot_fit(config: PlanConfig, rows: list[FrontierRow]) -> tuple[str, str] | None:
    over = next((r for r in rows if not r.fits and needs_no_more_than(r.plan.config, config)), None)
    if over is None:
        return None
    return "cannot fit", (f"needs at least the memory of {over.plan.config.describe()} "
                          f"({over.plan.report.memory.peak / 2**30:.2f} GiB), past the budget")


def _cannot_win(config: PlanConfig, rows: list[FrontierRow], hardware: HardwareProfile) -> tuple[str, str] | None:
    """At most ``rate / FLOPs per sample`` samples/s (nothing exposed): no better than the best found?"""
    fitting = [r for r in rows if r.fits]
    same = next((r.plan for r in rows if r.plan.config.remat == config.remat), None)
    if not fitting or same is None or same.flops <= 0:
        return None
    rate = hardware.bf16_flops if config.mixed_precision else hardware.fp32_flops
    ceiling = rate * same.config.batch_per_device / same.flops
    best = max(r.estimate.samples_per_second for r in fitting)
    if ceiling > best:
        return None
    return "cannot beat the best", (f"at most {ceiling:.2f} samples/s/device at peak FLOP/s with remat {config.remat}, "
                                    f"no more than the best found ({best:.2f})")
