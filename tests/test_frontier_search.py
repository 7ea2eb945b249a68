"""The frontier's first-answer search against the full grid, on synthetic steps that obey its assumptions.

Compiling is replaced by a model of a step whose memory grows with the batch, without
resharding after forward and with a remat that keeps more (in fp32 more or less than in bf16,
with vectors whole or sharded, with weight gradients reduced or from activations: either way),
and whose samples per second grow with the batch and stay under the chip's peak FLOP/s: what
[Note: frontier search] assumes. On every such step the first answer must find the full grid's best, compile a subset
of what the full grid compiles (but for one probe per routed setting), and skip only configurations that cannot fit
or cannot beat it, or that are their reduced twin.
"""

import dataclasses
import itertools
from types import SimpleNamespace

from hypothesis import example, given, settings
from hypothesis import strategies as st

from jshard._plan.search import Grid, first_answer, full_grid
from jshard.report import HARDWARE, Frontier, FrontierRow, PlanConfig

H100 = HARDWARE["h100"]
GRID = Grid(batches=[1, 2, 4, 8, 16], reshard_after_forward=[True, False], remats=["default", "dots", "full"],
            mixed_precision=[True, False], offload=[False], replicate_below=[0, 4096],
            weight_gradients=["reduced", "from_activations"])


def _synthetic_step(keep, recompute, gathered, fp32_factor, whole_factor, reduced_factor, flops_per_sample, wire,
                    routed_below=4):
    """``config -> (peak bytes, FLOPs, samples/s, bytes sent by kind)`` of a step that obeys the search's
    assumptions; weight gradients from activations route matmuls only below ``routed_below`` rows (the
    batch), and are the reduced step from there on."""

    def step(c: PlanConfig):
        routed = c.weight_gradients == "from_activations" and c.batch_per_device < routed_below
        precision = 1.0 if c.mixed_precision else fp32_factor  # either way: XLA:CPU's bf16 plans can hold more
        # Either way too: vectors whole or weight gradients reduced hold more or less, per model on XLA:TPU.
        trade = (whole_factor if c.replicate_below else 1.0) * (1.0 if routed else reduced_factor)
        peak = precision * trade * (1.0 + c.batch_per_device * keep[c.remat]
                                    + (0 if c.reshard_after_forward else gathered))
        flops = c.batch_per_device * flops_per_sample * recompute[c.remat]
        rate = H100.bf16_flops if c.mixed_precision else H100.fp32_flops
        # Routed, the exchanged activations grow with the rows, to the reduction's bytes where the route stops.
        exposed = (wire * (1.5 if c.reshard_after_forward else 1.0) * (1.0 if c.mixed_precision else 2.0)
                   * (c.batch_per_device / routed_below if routed else 1.0))
        sent = {"all-to-all": 1.0} if routed else {"all-gather": 2.0 if c.reshard_after_forward else 1.0}
        return peak, flops, c.batch_per_device / (flops / rate + exposed), sent

    return step


def _compiler(step, budget, log):
    def compile_one(config: PlanConfig) -> FrontierRow:
        log.append(config)
        peak, flops, speed, sent = step(config)
        plan = SimpleNamespace(config=config, flops=flops, report=SimpleNamespace(
            memory=SimpleNamespace(peak=peak), collective_bytes=sent))
        fits = peak <= budget
        return FrontierRow(plan, fits, SimpleNamespace(samples_per_second=speed) if fits else None)

    return compile_one


def _best(rows):
    return max((r.estimate.samples_per_second for r in rows if r.fits), default=None)


increasing = st.lists(st.floats(0.01, 10.0), min_size=3, max_size=3, unique=True).map(sorted)


@settings(max_examples=150, deadline=None)
# Only fp32 fits: a bf16 configuration past the budget says nothing of fp32's memory.
@example(keep=[0.5, 1.0, 3.0], recompute=[1.0, 1.2, 1.5], gathered=1.0, fp32_factor=0.8, whole_factor=1.0,
         reduced_factor=1.0, wire=0.0, budget=1.3, routed_below=4)
# The full grid stops so early that nothing is left to skip.
@example(keep=[2.0, 3.0, 4.0], recompute=[1.0, 2.0, 3.0], gathered=2.0, fp32_factor=1.0, whole_factor=1.0,
         reduced_factor=1.0, wire=0.0078125, budget=5.0, routed_below=4)
# Weight gradients reduced hold less, routed send less: a routed configuration past the budget says nothing of
# the reduced ones', nor one with vectors whole of one with them sharded.
@example(keep=[0.5, 1.0, 3.0], recompute=[1.0, 1.2, 1.5], gathered=1.0, fp32_factor=1.0, whole_factor=1.5,
         reduced_factor=0.5, wire=1e-2, budget=2.0, routed_below=4)
# Nothing routed at any batch: each routed setting compiles once, then is its reduced twin's.
@example(keep=[0.5, 1.0, 3.0], recompute=[1.0, 1.2, 1.5], gathered=1.0, fp32_factor=1.0, whole_factor=1.5,
         reduced_factor=0.5, wire=1e-2, budget=60.0, routed_below=1)
@given(keep=increasing, recompute=increasing, gathered=st.floats(0.0, 40.0), fp32_factor=st.floats(0.8, 1.5),
       whole_factor=st.floats(0.5, 2.0), reduced_factor=st.floats(0.5, 2.0), wire=st.floats(0.0, 1e-2),
       budget=st.floats(1.0, 120.0), routed_below=st.sampled_from([1, 2, 4, 8, 32]))
def test_the_first_answer_finds_the_full_grids_best_with_fewer_compiles(keep, recompute, gathered, fp32_factor,
                                                                         whole_factor, reduced_factor, wire, budget,
                                                                         routed_below):
    step = _synthetic_step(dict(zip(("full", "dots", "default"), keep, strict=True)),
                           dict(zip(("default", "dots", "full"), recompute, strict=True)),
                           gathered, fp32_factor, whole_factor, reduced_factor, 1e12, wire, routed_below)
    full_log, quick_log = [], []
    full_rows, _ = full_grid(_compiler(step, budget, full_log), GRID)
    rows, skipped = first_answer(_compiler(step, budget, quick_log), GRID, H100)
    best = _best(full_rows)
    assert _best(rows) == best
    # A subset, but for a routed setting's probe at the batch its reduced twin fits, where the full grid stopped
    # at a smaller batch that routing made hold more: at most one per routed setting.
    extra = set(quick_log) - set(full_log)
    assert all(c.weight_gradients == "from_activations" for c in extra), extra
    assert len(extra) == len({dataclasses.replace(c, batch_per_device=1) for c in extra}), extra
    assert len(set(quick_log)) == len(quick_log)  # nothing compiled twice
    every = {PlanConfig(b, raf, remat, mp, off, below, route) for b, raf, remat, mp, off, below, route in
             itertools.product(GRID.batches, GRID.reshard_after_forward, GRID.remats, GRID.mixed_precision,
                               GRID.offload, GRID.replicate_below, GRID.weight_gradients)}
    assert set(quick_log) | {s.config for s in skipped} == every  # every configuration accounted for, once
    assert len(quick_log) + len(skipped) == len(every)
    for s in skipped:  # none that was skipped fits and beats the best
        peak, _, speed, _ = step(s.config)
        assert peak > budget or best is None or speed <= best, s
        if s.kind == "routes nothing":  # only a routed configuration that is its reduced twin
            assert step(s.config) == step(dataclasses.replace(s.config, weight_gradients="reduced")), s
    if routed_below == 1:  # nothing is ever routed: no routed setting climbs its batches
        routed = [c for c in quick_log if c.weight_gradients == "from_activations"]
        assert len(routed) <= len(GRID.settings()) // 2, routed


def test_a_tie_ranks_the_lower_peak_then_fsdp2s_layout_first():
    """An option that changes nothing for a model (no matmul routed at its batch) is not the one recommended."""
    def row(peak, speed=100.0, **options):
        # a plan records the values it compiled
        config = PlanConfig(batch_per_device=2, **{"replicate_below": 0, "weight_gradients": "reduced", **options})
        plan = SimpleNamespace(config=config, report=SimpleNamespace(memory=SimpleNamespace(peak=peak)))
        return FrontierRow(plan, True, SimpleNamespace(samples_per_second=speed))

    routed, whole, reduced = row(5, weight_gradients="from_activations"), row(5, replicate_below=4096), row(5)
    lower, faster = row(4, weight_gradients="from_activations"), row(9, speed=101.0, replicate_below=4096)
    ranked = Frontier(2**30, H100, (routed, whole, reduced, lower, faster)).ranked
    assert ranked == [faster, lower, reduced, whole, routed]
