"""The analytic plan of pipeline stages over FSDP x TP ([Note: stage plan]): its formulas on a toy
shape, and its ranking of Llama-3-70B's meshes on 256 and 1024 devices (estimated, not compiled)."""

import dataclasses

import pytest

from jshard.demo.llama3 import stack_70b
from jshard.report import HARDWARE, StackModel, estimate_stages, main, rank_stages

TOY = StackModel("toy", 5, 1000, 100, 8, 16, 2000.0, 200.0, 64.0)


def test_the_estimate_follows_the_pipeline_formulas():
    """(stage 2 x fsdp 4), L=5 (K=3), M=4: 5 ticks, bubble 1/5, the stage's layers gathered per tick or once."""
    h100 = HARDWARE["h100"]
    every = estimate_stages(TOY, 2, 4, 1, 4, "per_microbatch", 32, h100)
    once = estimate_stages(TOY, 2, 4, 1, 4, "once", 32, h100)
    assert every.bubble == once.bubble == pytest.approx(1 / 5)
    assert every.memory["state"] == 16 * (6 * 1000 + 100) / 8  # S K layer slots and the rest, over 8 devices
    assert every.traffic["fsdp all-gather"] == 2 * 5 * 3 * 1000 * 2 * 3 / 4  # 2 t K bf16 layers, (F-1)/F each
    assert once.traffic["fsdp all-gather"] == 2 * 3 * 1000 * 2 * 3 / 4
    assert once.traffic["fsdp reduce-scatter"] == 3 * 1000 * 4 * 3 / 4
    column = 32 * 16 / 4  # an fsdp column's tokens
    assert every.traffic["stage ppermute"] == 2 * 5 * column / 4 * 8 * 2  # 2 t microbatches of bf16 activations
    assert every.memory["gathered"] == 1000 * (2 + 2 + 4) and once.memory["gathered"] == 3 * 1000 * (2 + 4)
    assert every.compute == pytest.approx(4 * 32 * 16 * (2000 * 5 / 4 * 6 + 200) / 8 / h100.bf16_flops)
    assert every.memory["activations"] == 3 * column * 8 * 2 + column / 4 * 64  # GPipe: K inputs of all M microbatches
    # 1F1B: min(2S - 1, M) = 3 of the 4 microbatches in flight; the head on both stages; the same bytes moved
    f1b = estimate_stages(TOY, 2, 4, 1, 4, "per_microbatch", 32, h100, schedule="1f1b")
    assert f1b.memory["activations"] == 3 * column * 3 / 4 * 8 * 2 + column / 4 * 64
    assert f1b.compute == pytest.approx(4 * 32 * 16 * (2000 * 5 / 4 * 6 + 200 * 2) / 8 / h100.bf16_flops)
    assert f1b.traffic == every.traffic and f1b.bubble == every.bubble and "1f1b M=4" in f1b.describe()
    with pytest.raises(ValueError, match="schedule must be 'gpipe' or '1f1b', got 'zb'"):
        estimate_stages(TOY, 2, 4, 1, 4, "once", 32, h100, schedule="zb")
    alone = estimate_stages(TOY, 1, 8, 1, 1, "per_microbatch", 32, h100)  # FSDP alone: every layer, no bubble
    assert alone.bubble == 0 and alone.traffic["fsdp all-gather"] == 2 * 5 * 1000 * 2 * 7 / 8
    assert alone.traffic["stage ppermute"] == alone.traffic["stage rows in and out"] == 0


@pytest.mark.parametrize("devices,best_alone,best_staged,speedup", [
    (256, (1, 128, 2), (8, 32, 1, 32, "once"), 1.365),
    (1024, (1, 256, 4), (8, 128, 1, 8, "once"), 2.063),
])
def test_llama3_70b_stages_win_on_slow_links_and_lose_on_fast_ones(devices, best_alone, best_staged, speedup):
    """1024 sequences of 2048 tokens on H100s: on NVLink's 450 GB/s everywhere FSDP x TP alone hides its
    gathers behind compute and ranks first; on 50 GB/s links (across nodes) its gathers are exposed and a
    pipeline whose stages gather their layers once ranks first, bubble and all."""
    fast = rank_stages(stack_70b(), devices, 1024, HARDWARE["h100"])
    assert fast[0].stages == 1 and fast[0].fits
    slow = rank_stages(stack_70b(), devices, 1024, dataclasses.replace(HARDWARE["h100"], link_bandwidth=50e9))
    alone = next(p for p in slow if p.stages == 1)
    assert (slow[0].stages, slow[0].fsdp, slow[0].tp, slow[0].microbatches, slow[0].gather) == best_staged
    assert (alone.stages, alone.fsdp, alone.tp) == best_alone
    assert slow[0].fits and alone.step / slow[0].step == pytest.approx(speedup, rel=1e-3)


def test_the_stages_command_says_it_estimates(capsys):
    main(["stages", "jshard.demo.llama3:stack_70b", "--devices", "256", "--global-batch", "1024", "--top", "2",
          "--link", "50GB"])
    lines = capsys.readouterr().out.splitlines()
    assert "ESTIMATED from the shape, not compiled" in lines[0] and len(lines) == 4
    assert lines[1].startswith("stage 8 x fsdp 32 x tp 1") and lines[3].startswith("best without stages: stage 1")


def test_a_stack_model_is_validated():
    with pytest.raises(ValueError, match=r"StackModel 'toy': `layers` must be a positive int, got 0"):
        dataclasses.replace(TOY, layers=0)
