"""Token dispatch left to GSPMD (``MoEConfig(exchange="gspmd")``) against the one-device model,
and benchmarks/moe_dispatch.py, which sets it beside jshard's ``all_to_all`` step."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from benchmarks import moe_dispatch
from jshard._report.hlo import hlo_collectives
from jshard.demo.moe import MoEConfig, lm_loss
from jshard.demo.moe_train import expert_mesh, init_params
from jshard.report import PlanConfig

# Even dims: a GSPMD program's arguments must divide over their mesh axes.
CFG = MoEConfig(vocab=32, dim=8, heads=2, layers=1, experts=4, hidden=16, capacity_factor=1.0, aux_weight=0.1)


def test_gspmd_dispatch_gives_the_one_device_gradients():
    """Experts P('expert', 'data'), the rest over all 8 devices, the batch over all 8; the slots
    constrained over `expert`: GSPMD emits the all-to-alls (none in the lowered program)."""
    tokens = np.random.default_rng(0).integers(0, CFG.vocab, size=(16, 9)).astype(np.int32)
    graphdef, params = init_params(CFG)
    want_loss, want = jax.jit(jax.value_and_grad(lambda p, t: lm_loss(nnx.merge(graphdef, p), t)))(params, tokens)
    mesh = expert_mesh(CFG.experts, expert_degree=4)
    gspmd_graphdef, _ = init_params(dataclasses.replace(CFG, expert_axis="expert", exchange="gspmd"))
    placed = jax.tree.map_with_path(lambda p, x: jax.device_put(x, moe_dispatch._placed(p, x, mesh).sharding), params)
    tokens = jax.device_put(tokens, NamedSharding(mesh, jax.P(mesh.axis_names)))
    grad_fn = jax.jit(jax.value_and_grad(lambda p, t: lm_loss(nnx.merge(gspmd_graphdef, p), t)))
    with jax.set_mesh(mesh):
        lowered = grad_fn.lower(placed, tokens)
        loss, grads = lowered.compile()(placed, tokens)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    # GSPMD sums partial products in another order: entries near zero differ by up to ~1e-7 absolute
    # (1.2e-7 measured on an entry of 1.7e-3, about 1e-6 of the leaf's largest entries: 0.14).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, want)
    assert "all_to_all" not in lowered.as_text()
    assert any(c.kind == "all-to-all" for c in hlo_collectives(lowered.compile().as_text()))


def test_the_benchmark_sets_both_programs_side_by_side():
    """Tiny shapes on CPU: every figure for both programs, and jshard's all-to-alls as counted
    (dispatch and return, forward and backward, per MoE layer) at tokens x d x top-k x cf x 4 B."""
    figures = moe_dispatch.compare(expert_mesh(8, expert_degree=4), PlanConfig(batch_per_device=1),
                                   dataclasses.replace(CFG, experts=8, expert_axis="expert"), seq_len=8)
    table = moe_dispatch.format_table(figures)
    print(table)
    assert table.splitlines()[0].split() == ["per", "device", "all_to_all", "gspmd", "gspmd", "/", "a2a"]
    a2a = figures["all_to_all"]
    assert a2a["all-to-all count"] == 4 * CFG.layers
    per_exchange = 8 * CFG.dim * CFG.top_k * 1.0 * 4 * 3 / 4  # 8 tokens; a ring all-to-all sends (M - 1) / M
    assert a2a["all-to-all bytes"] == pytest.approx(4 * CFG.layers * per_exchange)
    assert figures["gspmd"]["flops"] > 0 and a2a["peak"] > a2a["argument"] > 0
