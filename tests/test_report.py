"""jshard.report: measured memory and collectives of compiled steps against the analytic model."""

import json

import jax
import jax.numpy as jnp
import optax
import pytest

import jshard as js
from jshard.report import Report, step_report

LAYERS, D, N = 4, 13, 8  # D pads to 16: 2 rows per device


def _stack(policy_kwargs):
    key = jax.random.key(0)
    stack = {"w": jax.random.normal(key, (LAYERS, D, D)) * 0.1}
    return js.fully_shard(stack, policy=js.FullyShardPolicy(scan_axis=0, **policy_kwargs))


def _loss_fn(p, x):
    def body(h, layer):
        # Backward needs w itself, so it re-gathers it. (It would save, not re-gather, any
        # value computed from a gathered leaf, e.g. a broadcast bias: see the final report.)
        return jnp.tanh(h @ layer["w"]).astype(h.dtype), None

    h, _ = js.scan(body, x, p)
    return jnp.mean(h.astype(jnp.float32) ** 2)


def _train_step(params, opt_state, x):
    loss, grads = js.value_and_grad(_loss_fn, unshard_params=False)(params, x)
    updates, opt_state = optax.sgd(0.1, momentum=0.9).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def _report(**policy_kwargs):
    params = _stack(policy_kwargs)
    opt_state = optax.sgd(0.1, momentum=0.9).init(params)
    return step_report(_train_step, params, opt_state, jnp.ones((16, D)))


@pytest.fixture(scope="module")
def fp32():
    return _report(reshard_after_forward=True)


def test_persistent_arguments_are_total_over_n_plus_padding(fp32):
    # w is padded from 13 to 16 rows (2 per device); params and momentum, then the batch.
    padded = LAYERS * 16 * D
    state = 2 * padded * 4 // N
    batch = 16 * D * 4 // N
    assert fp32.analytic.state_bytes == state
    assert fp32.memory.argument == fp32.analytic.argument_bytes == state + batch
    assert fp32.analytic.params == LAYERS * D * D
    assert fp32.analytic.padded_params == padded
    assert fp32.ratios()["argument bytes"] == 1.0


def test_stacked_collective_bytes_equal_the_model(fp32):
    padded_bytes = LAYERS * 16 * D * 4
    measured = fp32.collective_bytes
    assert measured["reduce-scatter"] == fp32.analytic.reduce_scatter == padded_bytes * (N - 1) / N
    # reshard_after_forward=True: gathered in forward and again in backward.
    assert measured["all-gather"] == fp32.analytic.all_gather == 2 * padded_bytes * (N - 1) / N


def test_loop_collectives_carry_the_trip_count(fp32):
    in_loop = [c for c in fp32.collectives if c.kind in ("all-gather", "reduce-scatter")]
    assert in_loop and all(c.in_loop and c.trip_count == LAYERS and c.executions == LAYERS for c in in_loop)
    assert all(c.group_size == N and c.replica_groups for c in fp32.collectives)
    loss = [c for c in fp32.collectives if c.kind == "all-reduce"]
    assert [(c.shapes, c.executions, c.in_loop) for c in loss] == [(((),), 1, False)]


def test_mixed_precision_dtypes_come_from_the_lowered_program():
    mp = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
    report = _report(reshard_after_forward=False, mp_policy=mp)
    kinds = {(c.kind, c.dtype) for c in report.collectives if c.kind != "all-reduce"}
    assert kinds == {("all-gather", "bfloat16"), ("reduce-scatter", "float32")}
    gathers = [c for c in report.collectives if c.kind == "all-gather"]
    if jax.default_backend() == "cpu":
        assert {c.compiled_dtype for c in gathers} == {"float32"}  # XLA:CPU upcasts after compiling
    padded = LAYERS * 16 * D
    assert report.collective_bytes["all-gather"] == report.analytic.all_gather == padded * 2 * (N - 1) / N
    assert report.collective_bytes["reduce-scatter"] == report.analytic.reduce_scatter == padded * 4 * (N - 1) / N


def test_hsdp_all_reduce_matches_the_model():
    mesh = js.make_mesh(replicate=2)
    stack = js.fully_shard({"w": jnp.ones((LAYERS, 16, 16))}, mesh, js.FullyShardPolicy(scan_axis=0))

    def loss_fn(p, x):
        h, _ = js.scan(lambda h, layer: (jnp.tanh(h @ layer["w"]), None), x, p)
        return jnp.mean(h ** 2)

    report = step_report(js.value_and_grad(loss_fn, unshard_params=False), stack, jnp.ones((16, 16)))
    n, r = 4, 2
    shard_bytes = LAYERS * 16 * 16 * 4 / n
    assert report.analytic.all_reduce == 2 * shard_bytes * (r - 1) / r
    loss_scalar = 2 * 4 * 7 / 8  # the loss pmean over all 8 devices, which the model leaves out
    assert report.collective_bytes["all-reduce"] == pytest.approx(report.analytic.all_reduce + loss_scalar)
    assert report.collective_bytes["reduce-scatter"] == report.analytic.reduce_scatter


def test_offloaded_state_is_reported_as_host_memory():
    report = _report(offload_policy=js.CPUOffloadPolicy())
    state = 2 * LAYERS * 16 * D * 4 // N
    assert report.memory.host_argument == report.analytic.host_argument_bytes == state
    assert report.memory.argument == report.analytic.argument_bytes == 16 * D * 4 // N


def test_report_is_plain_data_and_text(fp32):
    data = json.loads(fp32.to_json())
    assert set(data) >= {"memory", "collectives", "analytic", "mesh", "collective_bytes", "ratios"}
    assert data["memory"]["peak"] == fp32.memory.peak > 0
    assert Report.from_dict(data) == fp32
    text = str(fp32)
    assert "reduce-scatter bytes/step" in text and "groups of 8 x4 in loop" in text


def test_abstract_inputs_give_the_same_report(fp32):
    params = _stack({"reshard_after_forward": True})
    opt_state = optax.sgd(0.1, momentum=0.9).init(params)
    def abstract(x):
        sharding = x.sharding if isinstance(x.sharding, jax.NamedSharding) else None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    abstract = jax.tree.map(abstract, (params, opt_state, jnp.ones((16, D))))
    report = step_report(_train_step, *abstract)
    assert report.memory == fp32.memory
    assert report.collective_bytes == fp32.collective_bytes


def test_report_shows_each_leafs_placement_and_padding_share():
    params = js.fully_shard({"conv": jnp.ones((3, 3, 4, 16)), "odd": jnp.ones((7, 15))})
    grad_fn = js.value_and_grad(lambda p, x: jnp.sum(p["conv"]) * jnp.mean(x @ p["odd"]))
    report = step_report(grad_fn, params, jnp.ones((8, 7)))
    placed = {p.path: (p.dim, p.stored, round(p.padding_share, 4)) for p in report.placements}
    assert placed == {"['conv']": (3, (3, 3, 4, 16), 0.0), "['odd']": (0, (8, 15), 0.125)}
    text = str(report)
    assert "placement per leaf (2 leaves; most padding first)" in text
    assert "['odd']" in text.split("placement per leaf")[1].splitlines()[1]  # the most padded first
    assert Report.from_dict(json.loads(report.to_json())) == report


# A windowed einsum as XLA:TPU compiles a recipe's backward dot on 8 devices (abridged from
# the compiled step of benchmarks.memory_sweep's GELU 8x1536 b512 bf16): the loop carries no
# known_trip_count and its counter runs from 0 to 4 by 2.
WINDOWED_EINSUM = """\
%body (p: (bf16[64,576], u32[])) -> (bf16[64,576], u32[]) {
  %p = (bf16[64,576], u32[]) parameter(0)
  %constant.2 = u32[] constant(2)
  %acc = bf16[64,576]{1,0} get-tuple-element(%p), index=0
  %w = bf16[576,1536]{1,0} constant({...})
  %x = bf16[64,1536]{1,0} constant({...})
  %dot.1 = bf16[64,576]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %sum = bf16[64,576]{1,0} add(%acc, %dot.1)
  %i = u32[] get-tuple-element(%p), index=1
  %next = u32[] add(%i, %constant.2)
  ROOT %tuple.1 = (bf16[64,576], /*index=1*/u32[]) tuple(%sum, %next)
}

%cond (p: (bf16[64,576], u32[])) -> pred[] {
  %p = (bf16[64,576], u32[]) parameter(0)
  %constant.4 = u32[] constant(4)
  %i = u32[] get-tuple-element(%p), index=1
  ROOT %lt = pred[] compare(%i, %constant.4), direction=LT
}

ENTRY %main () -> bf16[64,576] {
  %zeros = bf16[64,576]{1,0} constant(0)
  %start = u32[] constant(START)
  %init = (bf16[64,576], u32[]) tuple(%zeros, %start)
  %loop = (bf16[64,576], u32[]) while(%init), condition=%cond, body=%body
  ROOT %out = bf16[64,576]{1,0} get-tuple-element(%loop), index=0
}
"""


@pytest.mark.parametrize(("start", "trips"), [(0, 2), (1, 2), (2, 1), (4, 0)])
def test_loop_trips_read_the_counters_start_and_step(start, trips):
    """[Note: loop trips]: ceil((4 - start) / 2) trips, so the dot counts that many times
    (read as 4 trips from 0, the recipe's windowed backward matmuls counted twice)."""
    from jshard._report.loop_trips import trip_counts
    from jshard.report import matmul_flops

    text = WINDOWED_EINSUM.replace("START", str(start))
    assert trip_counts(text) == {"body": trips}
    assert matmul_flops(text) == trips * 2 * 64 * 576 * 1536


BROADCAST_CONVOLUTION = """\
HloModule m

ENTRY %main {
  %x = bf16[1024,1024,1]{2,1,0} parameter(0)
  %w = bf16[8,128,1024]{2,1,0} parameter(1)
  ROOT %q = bf16[1024,8,128]{2,1,0} convolution(%x, %w), window={size=8 pad=7_7 rhs_reversal=1}, dim_labels=bf0_0oi->b0f
}
"""


def test_a_convolution_counts_only_the_window_taps_on_its_input():
    """[Note: convolution taps]: XLA:TPU's projection of 1024 tokens onto 8 heads of 128, written
    as a convolution whose window of 8 slides over a padded input of spatial size 1, multiplies
    each output by one input position: 2 * 1024 * 8 * 128 * 1024 FLOPs, not eight times that."""
    from jshard.report import matmul_flops

    assert matmul_flops(BROADCAST_CONVOLUTION) == 2 * 1024 * 8 * 128 * 1024
    same_padding = BROADCAST_CONVOLUTION.replace("bf16[1024,1024,1]", "bf16[1024,1024,8]")
    same_padding = same_padding.replace("window={size=8 pad=7_7", "window={size=8 pad=3_4")
    taps = (5 + 6 + 7 + 8 + 7 + 6 + 5 + 4) / 8  # output o meets inputs o - 3 ... o + 4 of 0 ... 7
    assert matmul_flops(same_padding) == 2 * 1024 * 8 * 128 * 1024 * taps
