"""Pipeline stages over FSDP: a stack of L layers run as S stages over ``stage`` (GPipe and 1F1B),
each stage's layers FSDP-sharded over ``fsdp``, against the unsharded model ([Note: pipeline
schedule], [Note: 1F1B schedule])."""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import docs_example_output
from jax.sharding import Mesh

import jshard as js
from jshard.optim import shard_optimizer

D_IN, D, D_OUT, BATCH, STEPS = 5, 6, 3, 16, 10


def _mesh(stages: int) -> Mesh:
    return Mesh(np.asarray(jax.devices()).reshape(stages, 8 // stages), ("stage", "fsdp"))


def _params(layers: int) -> dict:
    rng = np.random.default_rng(0)
    f32 = lambda scale, *shape: (rng.normal(size=shape) * scale).astype(np.float32)  # noqa: E731
    return {"w_in": f32(0.5, D_IN, D), "w_out": f32(0.5, D, D_OUT),
            "stack": {"w": f32(0.4, layers, D, D), "b": f32(0.1, layers, D)}}


def _batch() -> dict:
    rng = np.random.default_rng(1)
    return {"x": rng.normal(size=(BATCH, D_IN)).astype(np.float32),
            "y": rng.normal(size=(BATCH, D_OUT)).astype(np.float32)}


def _layer(h: jax.Array, layer: dict) -> jax.Array:
    return h + jnp.tanh(h @ layer["w"] + layer["b"])


def _loss(p: dict, batch: dict, run_stack) -> jax.Array:
    h = run_stack(jnp.tanh(batch["x"] @ p["w_in"]), p["stack"])
    return jnp.mean((h @ p["w_out"] - batch["y"]) ** 2)


def _scan_stack(h, stack):
    return jax.lax.scan(lambda h, layer: (_layer(h, layer), None), h, stack)[0]


def _adamw():
    return optax.adamw(3e-2, weight_decay=0.1)


def _update(tx, grads, state, params):
    with jax.numpy_dtype_promotion("standard"):  # Optax's Adam raises a Python float to its int32 count
        updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def _cast(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype), tree)


@functools.cache
def _reference(layers: int, compute_dtype=jnp.float32) -> tuple[list[float], dict]:
    """The unsharded model on one device: losses and parameters after ``STEPS`` AdamW steps;
    fp32 masters cast to ``compute_dtype`` for the forward (what bf16 gathers give)."""
    tx, params, batch = _adamw(), _params(layers), _batch()

    def loss_fn(p, b):
        return _loss(_cast(p, compute_dtype), _cast(b, compute_dtype), _scan_stack).astype(jnp.float32)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return loss, *_update(tx, grads, state, params)

    state, losses = tx.init(params), []
    for _ in range(STEPS):
        loss, params, state = step(params, state)
        losses.append(float(loss))
    return losses, params


def _sharded(params: dict, mesh: Mesh, mp: js.MixedPrecisionPolicy | None = None):
    mp = mp or js.MixedPrecisionPolicy()
    on_fsdp = js.FullyShardPolicy(scan_axis=0, dp_mesh_dims=js.DataParallelMeshDims(shard="fsdp"), mp_policy=mp)
    stack = js.fully_shard(js.stage_layers(params["stack"], mesh), mesh, on_fsdp)
    dense = js.FullyShardPolicy(dp_mesh_dims=js.DataParallelMeshDims(shard=("stage", "fsdp")), mp_policy=mp)
    return js.fully_shard({"w_in": params["w_in"], "w_out": params["w_out"], "stack": stack}, mesh, dense)


def _pipelined_loss(p: dict, batch: dict, policy: js.PipelinePolicy, head_gathered_in_loss: bool = False) -> jax.Array:
    """``_loss`` in the step: the stack pipelined, and under 1F1B the head and loss in the schedule
    (``head_gathered_in_loss``: the loss gathers the head's unit itself, inside the schedule)."""
    full = js.unshard(p)
    h = jnp.tanh(batch["x"] @ full["w_in"])
    if policy.schedule == "1f1b":
        w_out = (lambda: js.unshard(p)["w_out"]) if head_gathered_in_loss else (lambda: full["w_out"])
        head = lambda h, y: jnp.mean((h @ w_out() - y) ** 2)  # noqa: E731
        return js.pipeline(_layer, h, full["stack"], policy=policy, loss=head, targets=batch["y"])
    return jnp.mean((js.pipeline(_layer, h, full["stack"], policy=policy) @ full["w_out"] - batch["y"]) ** 2)


def _train(step, batch, sharded, state, steps: int) -> tuple[list[float], Any, Any]:
    """``steps`` of ``step`` on ``batch``: the losses, the parameters and the optimizer state."""
    losses = []
    for _ in range(steps):
        loss, sharded, state = step(sharded, state, batch)
        losses.append(float(loss))
    return losses, sharded, state


def _train_step(layers: int, policy: js.PipelinePolicy, tx):
    def loss_fn(p, batch):
        return _pipelined_loss(p, batch, policy)

    @jax.jit
    def step(sharded, state, batch):
        loss, grads = js.value_and_grad(loss_fn, unshard_params=False)(sharded, batch)
        return loss, *_update(tx, grads, state, sharded)

    return step


@pytest.mark.parametrize("stages,layers,microbatches,gather,schedule", [
    (2, 5, 4, "per_microbatch", "gpipe"), (4, 7, 4, "once", "gpipe"),  # M = 2S, M = S, both policies
    (2, 5, 2, "per_microbatch", "1f1b"), (2, 5, 4, "once", "1f1b"),  # 1F1B: M = S, M = 2S on both meshes
    (4, 7, 4, "once", "1f1b"), (4, 7, 8, "per_microbatch", "1f1b"),
    pytest.param(2, 5, 2, "once", "gpipe", marks=pytest.mark.slow),
    pytest.param(4, 7, 8, "per_microbatch", "gpipe", marks=pytest.mark.slow),
])
def test_pipeline_parity_with_unsharded_reference(stages, layers, microbatches, gather, schedule):
    """10 AdamW steps, fp32, on (stage 2 x fsdp 4) and (stage 4 x fsdp 2), L not divisible by S,
    M = S and M = 2S, both gather policies, both schedules: losses and parameters within 1e-5 of one device."""
    mesh, params, batch = _mesh(stages), _params(layers), _batch()
    ref_losses, ref = _reference(layers)
    tx = shard_optimizer(_adamw())
    sharded = _sharded(params, mesh)
    state = tx.init(sharded)
    step = _train_step(layers, js.PipelinePolicy(microbatches=microbatches, gather=gather, schedule=schedule), tx)
    losses = []
    for _ in range(STEPS):
        loss, sharded, state = step(sharded, state, batch)
        losses.append(float(loss))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    full = js.unshard(sharded)  # the stack's L layers: its unit records L
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), full, ref)
    padding = [np.asarray(w)[layers:] for w in jax.tree.leaves(sharded["stack"])]  # the stored slots past L
    assert all(len(w) == -(-layers // stages) * stages - layers and not np.any(w) for w in padding)  # stay zero
    assert sharded["stack"]["w"].sharding.spec == jax.sharding.PartitionSpec("stage", "fsdp")


@pytest.mark.parametrize("stages,layers,microbatches,gather,head_gathered_in_loss", [
    (2, 5, 4, "per_microbatch", False), (4, 7, 4, "once", True)])
def test_1f1b_gradients_equal_the_unsharded_ones(stages, layers, microbatches, gather, head_gathered_in_loss):
    """One step's loss and gradients (AdamW's parity above hides a constant factor on them) within
    1e-5 of one device's: the schedule's per-microbatch backward, the head's gradients, the input's;
    also where the loss gathers the head itself (its gradient reduce-scattered inside the schedule)."""
    params, batch = _params(layers), _batch()
    ref_loss, ref = jax.value_and_grad(lambda p: _loss(p, batch, _scan_stack))(params)
    policy = js.PipelinePolicy(microbatches=microbatches, gather=gather, schedule="1f1b")
    grad_fn = js.value_and_grad(lambda p, b: _pipelined_loss(p, b, policy, head_gathered_in_loss),
                                unshard_params=False)
    loss, grads = jax.jit(grad_fn)(_sharded(params, _mesh(stages)), batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), js.unshard(grads), ref)


def _compiled(stages: int, layers: int, policy: js.PipelinePolicy, width: int, batch: int):
    """The compiled step of a model ``width`` wide on ``batch`` rows (compiled only, not run)."""
    rng = np.random.default_rng(0)
    f32 = lambda *shape: (rng.normal(size=shape) * 0.1).astype(np.float32)  # noqa: E731
    params = {"w_in": f32(D_IN, width), "w_out": f32(width, D_OUT),
              "stack": {"w": f32(layers, width, width), "b": f32(layers, width)}}
    mesh = _mesh(stages)
    data = {"x": np.zeros((batch, D_IN), np.float32), "y": np.zeros((batch, D_OUT), np.float32)}

    def loss_fn(p, b):
        return _loss(js.unshard(p), b, lambda h, s: js.pipeline(_layer, h, s, policy=policy))

    lowered = jax.jit(js.value_and_grad(loss_fn, unshard_params=False)).lower(_sharded(params, mesh), data)
    return lowered, lowered.compile(), mesh


@pytest.mark.parametrize("gather", ["per_microbatch", "once"])
def test_pipeline_program_moves_the_analytic_bytes(gather):
    """From the compiled step on (stage 2 x fsdp 4), L=5, M=4, width 64, 64 rows: the schedule
    loop runs M + S - 1 = 5 times (bubble (S-1)/(M+S-1) = 1/5); one ppermute of a microbatch's
    activations per schedule step, forward and backward; the stage's FSDP all-gathers and
    reduce-scatters per the policy; arguments per device exactly the analytic share."""
    from jshard._report.flops import matmul_flops
    from jshard._report.step_collectives import step_collectives

    stages, fsdp, layers, m, width, batch = 2, 4, 5, 4, 64, 64
    per_stage = -(-layers // stages)
    lowered, compiled, mesh = _compiled(stages, layers, js.PipelinePolicy(microbatches=m, gather=gather), width, batch)
    found = step_collectives(compiled.as_text(), lowered.as_text(), dict(mesh.shape))
    permutes = [c for c in found if c.kind == "collective-permute"]
    ticks = m + stages - 1
    microbatch_bytes = stages * batch // (stages * fsdp) // m * width * 4  # S x b rows of a column, in M microbatches
    assert {c.trip_count for c in permutes} == {ticks} and {c.axes for c in permutes} == {("stage",)}
    assert (stages - 1) / permutes[0].trip_count == pytest.approx(0.2)  # the bubble
    one_device = jax.jit(jax.value_and_grad(lambda p, b: _loss(p, b, _scan_stack))).lower(
        {"w_in": jnp.zeros((D_IN, width)), "w_out": jnp.zeros((width, D_OUT)),
         "stack": {"w": jnp.zeros((layers, width, width)), "b": jnp.zeros((layers, width))}},
        {"x": jnp.zeros((batch, D_IN)), "y": jnp.zeros((batch, D_OUT))}).compile()
    work = matmul_flops(compiled.as_text()) / (matmul_flops(one_device.as_text()) / 8)  # 1: no bubble, no padding
    assert work == pytest.approx(ticks / m * stages * per_stage / layers, rel=0.01)  # 1.5 = 5/4 x 6/5
    assert sum(c.executions for c in permutes) == 2 * ticks  # forward, and its transpose in backward
    assert sum(c.wire_bytes_per_step for c in permutes) == 2 * ticks * microbatch_bytes
    layer_bytes, w_bytes = (width * width + width) * 4, width * width * 4  # one gathered layer W; its matrix
    stack = [c for c in found if c.axes == ("fsdp",)]
    gathered = sum(c.wire_bytes_per_step for c in stack if c.kind == "all-gather")
    scattered = sum(c.wire_bytes_per_step for c in stack if c.kind == "reduce-scatter")
    share = (fsdp - 1) / fsdp
    if gather == "per_microbatch":  # every matrix at every schedule step, again in backward; the bias is kept
        # ([Note: loop residuals]): its gather reads only the weights, and XLA runs it once per layer of the
        # stage, out of the schedule's loop
        assert gathered == (ticks * per_stage * 2 * w_bytes + per_stage * (layer_bytes - w_bytes)) * share
        assert scattered == ticks * per_stage * layer_bytes * share
    else:  # the stage's K layers once (XLA keeps the forward gather for backward) and one reduce-scatter
        assert gathered == per_stage * layer_bytes * share
        assert scattered == per_stage * layer_bytes * share
    slots = stages * per_stage
    dense = -(-D_IN // 8) * width + width // 8 * D_OUT  # w_in (5, 64) padded to 8 rows on its dim 0
    stack_share = slots * (width * width + width) // (stages * fsdp)
    rows = batch // 8 * (D_IN + D_OUT)
    assert compiled.memory_analysis().argument_size_in_bytes == (dense + stack_share + rows) * 4


@pytest.mark.parametrize("stages,ms", [pytest.param(2, (4, 8), marks=pytest.mark.slow), (4, (8, 16))])
def test_1f1b_keeps_activations_of_2S_1_microbatches_not_M(stages, ms):
    """From the compiled step on (stage S x fsdp 8/S), L=7, width 256, microbatches of 8 rows
    per column (the batch grows with M): GPipe's temporaries grow by at least one microbatch's
    saved activations K A per microbatch (A: one layer's, 2 x (8, 256) f32 here: h and h @ w; tanh
    is recomputed from them, [Note: loop residuals]),
    1F1B's, past its min(2S - 1, M) slots, only by the rows ((2 + 2/S) x 8 x 256 f32: the
    stages' rows and their cotangents, this device's rows and theirs; 25% allowed for the narrow
    inputs and targets) and stay below GPipe's."""
    from benchmarks.pipeline_program import pipeline_step

    layers, width, rows = 7, 256, 8
    per_stage, fsdp = -(-layers // stages), 8 // stages
    temp = {}
    for schedule in ("gpipe", "1f1b"):
        for m in ms:
            policy = js.PipelinePolicy(microbatches=m, schedule=schedule)
            compiled = pipeline_step(jax.devices(), stages, layers, width, fsdp * m * rows, policy)[2]
            temp[schedule, m] = compiled.memory_analysis().temp_size_in_bytes
    activation, (few, many) = rows * width * 4, ms
    assert (temp["gpipe", many] - temp["gpipe", few]) / (many - few) >= per_stage * 2 * activation
    assert (temp["1f1b", many] - temp["1f1b", few]) / (many - few) <= 1.25 * (2 + 2 / stages) * activation
    assert temp["1f1b", many] < temp["gpipe", many]


def _stage_stack(mesh: Mesh, layers: int = 5, staged: bool = True):
    stack = {"w": np.ones((layers, D, D), np.float32), "b": np.zeros((layers, D), np.float32)}
    on_fsdp = js.FullyShardPolicy(scan_axis=0, dp_mesh_dims=js.DataParallelMeshDims(shard="fsdp"))
    return js.fully_shard(js.stage_layers(stack, mesh) if staged else stack, mesh, on_fsdp)


def test_pipeline_misuse_is_named():
    mesh = _mesh(2)
    dense = js.FullyShardPolicy(dp_mesh_dims=js.DataParallelMeshDims(shard=("stage", "fsdp")))
    x = np.ones((BATCH, D), np.float32)

    def step(stack, policy=None):
        params = js.fully_shard({"stack": stack, "scale": np.ones(D, np.float32)}, mesh, dense)

        def loss_fn(p, x):
            h = x * js.unshard(p)["scale"]
            return js.pipeline(_layer, h, p["stack"], policy=policy).mean()

        return jax.jit(js.value_and_grad(loss_fn, unshard_params=False))(params, x)

    with pytest.raises(ValueError, match=r"Leaf \['b'\] of shape \(5, 6\) is not laid out as stages over mesh axis "
                                         r"'stage' \(size 2\) on its layer axis 0; lay the stack out"):
        step(_stage_stack(mesh, staged=False))
    with pytest.raises(ValueError, match=r"the 4 rows the 2 stages \(mesh axis 'stage'\) share do not split into "
                                         r"3 microbatches; make the global batch a multiple of 24 \(lcm\(M=3, S=2\)"):
        step(_stage_stack(mesh), policy=js.PipelinePolicy(microbatches=3))
    with pytest.raises(ValueError, match=r"schedule='1f1b'\) runs each microbatch's backward inside the schedule, "
                                         r"from its loss on the last stage: pass loss="):
        step(_stage_stack(mesh), policy=js.PipelinePolicy(schedule="1f1b"))
    with pytest.raises(ValueError, match=r"targets\['y'\] of shape \(3,\) does not hold this device's 2 rows on dim 0"):
        jax.jit(js.value_and_grad(lambda p, x: js.pipeline(_layer, x, p["stack"], loss=lambda h, t: h.mean(),
                                                           targets={"y": jnp.ones(3)}), unshard_params=False))(
            js.fully_shard({"stack": _stage_stack(mesh), "scale": np.ones(D, np.float32)}, mesh, dense), x)
    with pytest.raises(ValueError, match=r"js.scan got a stack whose layer axis 0 is split over mesh axes "
                                         r"\('stage',\).*run it with js.pipeline"):
        jax.jit(js.value_and_grad(lambda s, x: js.scan(lambda h, layer: (_layer(h, layer), None), x, s)[0].mean(),
                                  unshard_params=False))(_stage_stack(mesh), x)


def test_pipeline_needs_a_step_manual_over_the_stage_axis():
    """A stack alone shards over ``fsdp``: the batch is not split over ``stage``, so the schedule cannot run."""
    mesh = _mesh(2)
    loss_fn = lambda s, x: js.pipeline(_layer, x, s).mean()  # noqa: E731
    with pytest.raises(ValueError, match=r"this step is manual over \('fsdp',\) only, so the batch is not split "
                                         r"over 'stage'; shard the model's other units over it too"):
        jax.jit(js.value_and_grad(loss_fn, unshard_params=False))(_stage_stack(mesh), np.ones((BATCH, D), np.float32))


def test_pipeline_policy_is_validated():
    with pytest.raises(ValueError, match=r"`gather` must be one of \('per_microbatch', 'once'\), got 'twice'"):
        js.PipelinePolicy(gather="twice")
    with pytest.raises(ValueError, match=r"`microbatches` must be a positive int or None .*got 0"):
        js.PipelinePolicy(microbatches=0)
    with pytest.raises(ValueError, match=r"`schedule` must be one of \('gpipe', '1f1b'\), got 'pipedream'"):
        js.PipelinePolicy(schedule="pipedream")
    with pytest.raises(ValueError, match=r"`axis` must be a mesh axis name, got ''"):
        js.PipelinePolicy(axis="")
    with pytest.raises(ValueError, match=r"The mesh \{'stage': 2, 'fsdp': 4\} has no axis 'pipe'"):
        js.stage_layers({"w": np.ones((3, 2))}, _mesh(2), axis="pipe")


def test_pipeline_on_the_tpu_compiler():
    """XLA:TPU (v5p 2x2x2, compile only) runs the same schedule: M + S - 1 = 5 steps, one
    ppermute of a microbatch over ``stage`` per step each way, and the stage's matrices gathered
    over ``fsdp`` at every step, forward and backward (2 (M + S - 1) K times)."""
    from jax.experimental import topologies

    from benchmarks.pipeline_program import pipeline_step
    from jshard._report.step_collectives import step_collectives

    stages, layers, m, width, batch = 2, 5, 4, 256, 64
    devices = topologies.get_topology_desc(topology_name="v5p:2x2x2", platform="tpu").devices
    mesh, lowered, compiled = pipeline_step(devices, stages, layers, width, batch, js.PipelinePolicy(microbatches=m))
    found = step_collectives(compiled.as_text(), lowered.as_text(), dict(mesh.shape))
    permutes = [c for c in found if c.kind == "collective-permute"]
    ticks, per_stage = m + stages - 1, -(-layers // stages)
    assert {(c.trip_count, c.axes) for c in permutes} == {(ticks, ("stage",))}
    assert sum(c.wire_bytes_per_step for c in permutes) == 2 * ticks * (batch // 4 // m) * width * 4
    matrices = [c for c in found
                if c.kind == "all-gather" and c.axes == ("fsdp",) and c.shapes[0][-2:] == (width, width)]
    assert sum(c.executions for c in matrices) == 2 * ticks * per_stage


def test_1f1b_on_the_tpu_compiler():
    """XLA:TPU (v5p 2x2x2, compile only), 1F1B, S=2, L=5, M=4: the middle loop runs M = 4 steps
    with one ppermute of a microbatch each way, the warm-up one forward send (the cool-down's
    last send, to no reader, is gone): 2M + 1 in all; the stage's matrices are gathered over
    ``fsdp`` 2 (M + S - 1) K times, as under GPipe."""
    from jax.experimental import topologies

    from benchmarks.pipeline_program import pipeline_step
    from jshard._report.step_collectives import step_collectives

    stages, layers, m, width, batch = 2, 5, 4, 256, 64
    devices = topologies.get_topology_desc(topology_name="v5p:2x2x2", platform="tpu").devices
    policy = js.PipelinePolicy(microbatches=m, schedule="1f1b")
    mesh, lowered, compiled = pipeline_step(devices, stages, layers, width, batch, policy)
    found = step_collectives(compiled.as_text(), lowered.as_text(), dict(mesh.shape))
    permutes = [c for c in found if c.kind == "collective-permute"]
    assert {c.axes for c in permutes} == {("stage",)} and {c.trip_count for c in permutes} == {m, None}
    microbatch = batch // 4 // m * width * 4
    assert sum(c.wire_bytes_per_step for c in permutes) == (2 * m + 1) * microbatch
    matrices = [c for c in found
                if c.kind == "all-gather" and c.axes == ("fsdp",) and c.shapes[0][-2:] == (width, width)]
    assert sum(c.executions for c in matrices) == 2 * (m + stages - 1) * -(-layers // stages)


def test_the_docs_pipeline_examples_run(capsys):
    """docs/parallelism.md's GPipe example (the stack's layout; the loss going down), then its 1F1B
    block in the same namespace (the same loss and gradients as GPipe's)."""
    lines = docs_example_output("docs/parallelism.md", "pipeline-1f1b-example", capsys, after="pipeline-example")
    assert lines[:3] == ["P('stage', 'fsdp')", "True", "True True"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_bf16_mixed_precision_stays_within_its_tolerance(schedule):
    """bf16 gathers, compute and activations between stages, fp32 reductions and masters, on
    (stage 2 x fsdp 4), L=5, M=4, against the one-device model computing in bf16 from fp32
    masters. The activations (and 1F1B's cotangents) travel between stages in bf16 (read from
    the lowered program: XLA:CPU runs bf16 collectives in f32). Measured over 10 AdamW steps:
    the first four losses equal, the others equal or one bf16 ulp apart on jax 0.10.2 (0.56% at
    most under GPipe, 0.70% under 1F1B; the loss is a bf16 mean), two apart once under 1F1B on
    jax 0.12.0.1 (0.85%, step 9); the one-device bf16 run is itself up to 0.84% from fp32."""
    import re

    mesh, params, batch = _mesh(2), _params(5), _batch()
    mp = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
    tx = shard_optimizer(_adamw())
    sharded = _sharded(params, mesh, mp)
    state = tx.init(sharded)
    step = _train_step(5, js.PipelinePolicy(microbatches=4, schedule=schedule), tx)
    permutes = re.findall(r"collective_permute.*?-> tensor<([^>]*)>", step.lower(sharded, state, batch).as_text())
    sends = 2 if schedule == "gpipe" else 4  # 1F1B: warm-up, the middle loop's two, cool-down
    assert len(permutes) == sends and all(t.endswith("xbf16") for t in permutes), permutes
    losses = []
    for _ in range(STEPS):
        loss, sharded, state = step(sharded, state, batch)
        losses.append(float(loss))
    bf16_losses, _ = _reference(5, jnp.bfloat16)
    np.testing.assert_allclose(losses[0], bf16_losses[0], rtol=1e-6)
    np.testing.assert_allclose(losses, bf16_losses, rtol=2**-6)  # the bf16 loss: two ulps at most


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_tensor_parallel_as_a_third_axis(schedule):
    """(stage 2 x fsdp 2 x tp 2), L=5, M=4: each layer's matrix column-parallel over ``tp`` (placed
    before ``stage_layers``, which keeps that split): 10 AdamW steps within 1e-5 of one device,
    under both schedules (1F1B: GSPMD's tensor parallelism inside each microbatch's ``jax.vjp``)."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 2, 2), ("stage", "fsdp", "tp"), axis_types=(AxisType.Auto,) * 3)
    params, batch = _params(5), _batch()
    params["stack"]["w"] = jax.device_put(params["stack"]["w"], NamedSharding(mesh, P(None, None, "tp")))
    ref_losses, ref = _reference(5)
    tx = shard_optimizer(_adamw())
    sharded = _sharded(params, mesh)
    assert sharded["stack"]["w"].sharding.spec == P("stage", "fsdp", "tp")
    state = tx.init(sharded)
    step = _train_step(5, js.PipelinePolicy(microbatches=4, schedule=schedule), tx)
    losses = []
    for _ in range(STEPS):
        loss, sharded, state = step(sharded, state, batch)
        losses.append(float(loss))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    full = js.unshard(sharded)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), full, ref)


def _one_device() -> Mesh:
    return Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("stage", "fsdp"))


@pytest.mark.parametrize("target", ["stage 4 x fsdp 2", pytest.param("one device", marks=pytest.mark.slow)])
def test_checkpoint_restores_onto_another_stage_count(tmp_path, target):
    """AdamW on (stage 2 x fsdp 4), L=5 (6 layer slots): 3 steps, saved; restored onto (stage 4 x fsdp 2)
    (8 slots; slow: onto one device, 5 slots), parameters and optimizer state, 3 more steps: losses,
    parameters and optimizer state within 1e-6 of 6 uninterrupted steps. The checkpoint records the L
    layers, not the slots."""
    import json

    from jshard.checkpoint import CheckpointManager

    layers, policy, batch = 5, js.PipelinePolicy(microbatches=2), _batch()
    tx = shard_optimizer(_adamw())
    step = _train_step(layers, policy, tx)

    train = functools.partial(_train, step, batch)

    sharded = _sharded(_params(layers), _mesh(2))
    first, sharded, state = train(sharded, tx.init(sharded), 3)
    with CheckpointManager(tmp_path) as ckpt:
        ckpt.save(3, {"params": sharded, "opt": state})
    saved = json.loads(next(tmp_path.glob("3/layouts/*")).read_text())["leaves"]
    assert saved["params/stack/w"]["shape"] == saved["opt/0/mu/stack/w"]["shape"] == [layers, D, D]
    ref_losses, ref_sharded, ref_state = train(sharded, state, 3)
    mesh, slots = (_mesh(4), 8) if target == "stage 4 x fsdp 2" else (_one_device(), 5)
    like = _sharded(_params(layers), mesh)
    with CheckpointManager(tmp_path) as ckpt:
        restored = ckpt.restore({"params": like, "opt": tx.init(like)})
    assert restored["params"]["stack"]["w"].shape == restored["opt"][0].mu["stack"]["w"].shape == (slots, D, D)
    losses, params, opt = train(restored["params"], restored["opt"], 3)
    np.testing.assert_allclose(first + losses, first + ref_losses, rtol=1e-6)
    for got, want in ((params, ref_sharded), (opt, ref_state)):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                     js.unshard(got), js.unshard(want))


def test_factored_optimizer_state_restores_onto_another_stage_count(tmp_path):
    """Adafactor's factored moments are shaped unlike their parameter (``v_row`` of a ``(L, d, d)``
    stack is ``(L, d)``): Optax sees the ``L`` layers, not the ``S * K`` slots, so the state is the
    one-device state. On (stage 2 x fsdp 4), L=5: 3 steps equal the one-device run within 1e-6;
    saved, restored onto (stage 4 x fsdp 2) and onto one device, 3 more steps equal 6 uninterrupted
    ones (losses, parameters, optimizer state) within 1e-6."""
    import json

    from jshard.checkpoint import CheckpointManager

    layers, batch = 5, _batch()
    adafactor = optax.adafactor(1e-2, min_dim_size_to_factor=2)  # factors the (L, 6, 6) and (L, 6) leaves
    tx = shard_optimizer(adafactor)
    step = _train_step(layers, js.PipelinePolicy(microbatches=2), tx)

    train = functools.partial(_train, step, batch)

    @jax.jit
    def one_device_step(p, s):
        loss, grads = jax.value_and_grad(_loss)(p, batch, _scan_stack)
        return loss, *_update(adafactor, grads, s, p)

    params = _params(layers)
    one_losses, one_params, one_state = [], params, adafactor.init(params)
    for _ in range(3):
        loss, one_params, one_state = one_device_step(one_params, one_state)
        one_losses.append(float(loss))
    sharded = _sharded(params, _mesh(2))
    first, sharded, state = train(sharded, tx.init(sharded), 3)
    np.testing.assert_allclose(first, one_losses, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), js.unshard(state), one_state)
    with CheckpointManager(tmp_path) as ckpt:
        ckpt.save(3, {"params": sharded, "opt": state})
    saved = json.loads(next(tmp_path.glob("3/layouts/*")).read_text())["leaves"]
    assert saved["opt/0/v_row/stack/w"]["shape"] == saved["opt/0/v_col/stack/w"]["shape"] == [layers, D]
    assert saved["opt/0/v_row/stack/b"]["shape"] == [layers]
    ref_losses, ref_sharded, ref_state = train(sharded, state, 3)
    for mesh in (_mesh(4), _one_device()):
        like = _sharded(_params(layers), mesh)
        with CheckpointManager(tmp_path) as ckpt:
            restored = ckpt.restore({"params": like, "opt": tx.init(like)})
        losses, got_params, got_state = train(restored["params"], restored["opt"], 3)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
        for got, want in ((got_params, ref_sharded), (got_state, ref_state)):
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                         js.unshard(got), js.unshard(want))


def test_the_global_view_holds_the_L_layers():
    """The unit records L: js.unshard, js.reshard and the full state dicts show the 5 layers of a stack
    stored in 6 slots on (stage 2 x fsdp 4), and load them onto (stage 4 x fsdp 2)'s 8 slots, the rest zeros."""
    from jshard.state_dict import full_state_dict, load_full_state_dict

    layers, params = 5, _params(5)
    sharded = _sharded(params, _mesh(2))
    assert {lay.layers for lay in sharded["stack"].meta.layouts} == {layers}
    full = full_state_dict(sharded)
    jax.tree.map(np.testing.assert_array_equal, full, params)
    jax.tree.map(np.testing.assert_array_equal, js.unshard(sharded), params)
    like = _sharded(_params(5), _mesh(4))
    for moved in (load_full_state_dict(full, like), js.reshard(full, like)):
        stored = np.asarray(moved["stack"]["w"])
        assert stored.shape == (8, D, D) and not np.any(stored[layers:])
        np.testing.assert_array_equal(stored[:layers], params["stack"]["w"])


def test_a_staged_stack_is_a_unit_of_its_own():
    mesh = _mesh(2)
    staged = js.stage_layers({"w": np.ones((5, D, D), np.float32)}, mesh)
    with pytest.raises(ValueError, match=r"a stack of 5 layers laid out as pipeline stages with "
                                         r"FullyShardPolicy\(scan_axis=None\); pass FullyShardPolicy\(scan_axis=0"):
        js.fully_shard(staged, mesh)
    with pytest.raises(ValueError, match=r"a stack laid out as pipeline stages at \['stack'\]; make it a unit of its "
                                         r"own first"):
        js.fully_shard({"stack": staged}, mesh)
