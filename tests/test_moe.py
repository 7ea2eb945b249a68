"""The Mixtral-style NNX model of jshard.demo.moe trained sharded (experts over `expert`, FSDP over
`data`; dense over all 8 devices; tokens by all_to_all) against the same model on one device."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import docs_example_output
from jax.sharding import PartitionSpec as P

import jshard as js
from jshard.demo import moe_jax
from jshard.demo.moe import Mixtral, MoEConfig, dispatch_slots, lm_loss
from jshard.demo.moe_train import expert_mesh, init_params, loss_step, shard_mixtral, shard_mixtral_nnx, train_step
from jshard.flax import nnx as jnnx

# d=10 and f=17: the data axis (2 or 4) divides neither, so fully_shard pads expert and dense leaves.
CFG = MoEConfig(vocab=32, dim=10, heads=2, layers=2, experts=4, hidden=17, capacity_factor=1.0, aux_weight=0.1)
STEPS, BATCH, SEQ = 10, 16, 8


def _tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, CFG.vocab, size=(BATCH, SEQ + 1)).astype(np.int32)


def _adamw() -> optax.GradientTransformation:
    return optax.adamw(3e-2, weight_decay=0.1)


@functools.cache
def _reference(cfg: MoEConfig = CFG, compute_dtype: jnp.dtype | None = None) -> tuple[list[float], dict]:
    """The unsharded model on one device: losses and parameters after STEPS AdamW steps.
    With ``compute_dtype``, fp32 master weights cast to it for the forward (what bf16 gathers give)."""
    graphdef, params = init_params(cfg)
    tx, tokens = _adamw(), jnp.asarray(_tokens())
    if compute_dtype is None:
        step = jax.jit(train_step(graphdef, tx, sharded=False))
    else:
        def loss_fn(params, tokens):
            return lm_loss(nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(compute_dtype), params)), tokens)

        @jax.jit
        def step(params, state, tokens):
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss
    state, losses = tx.init(params), []
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes Python floats with its int32 count
        for _ in range(STEPS):
            params, state, loss = step(params, state, tokens)
            losses.append(float(loss))
    return losses, params


def _train_sharded(data: int, mp: js.MixedPrecisionPolicy | None = None, cfg: MoEConfig = CFG, plain: bool = False):
    """STEPS sharded AdamW steps from the NNX model's initial parameters, of the NNX model or
    (``plain``) of the plain-JAX one on the same dict."""
    mesh = expert_mesh(cfg.experts, expert_degree=8 // data)
    cfg = dataclasses.replace(cfg, expert_axis="expert")
    graphdef, params = init_params(cfg)
    sharded = shard_mixtral(params, mesh, mp)
    tx = js.shard_optimizer(_adamw())
    step = jax.jit(loss_step(lambda p, t: moe_jax.lm_loss(p, t, cfg), tx) if plain else train_step(graphdef, tx))
    state, losses, tokens = tx.init(sharded), [], _tokens()
    with jax.numpy_dtype_promotion("standard"):
        for _ in range(STEPS):
            sharded, state, loss = step(sharded, state, tokens)
            losses.append(float(loss))
    return losses, sharded


def _max_rel(got: dict, want: dict) -> float:
    errs = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a, np.float32) - b)) / np.max(np.abs(b))),
                        got, want)
    return max(jax.tree.leaves(errs))


def test_the_batch_overflows_capacity_and_the_balancing_loss_moves_the_weights():
    """Guards on what the parity tests cover: some tokens are dropped (capacity factor 1), and
    the load-balancing term changes the trained weights far beyond the parity tolerance."""
    graphdef, params = init_params(CFG)
    model = jax.tree.map(lambda x: x, params)
    x = jnp.asarray(params["embed"]["embedding"])[_tokens()[:, :-1]]
    probs = jax.nn.softmax(x @ model["blocks"][0]["moe"]["router"]["kernel"], axis=-1)
    gates, idx = jax.lax.top_k(probs, CFG.top_k)
    dispatch, _ = dispatch_slots(jax.nn.one_hot(idx, CFG.experts), gates, CFG.capacity(SEQ))
    kept = float(dispatch.sum()) / (BATCH * SEQ * CFG.top_k)
    assert 0.5 < kept < 1.0, kept
    _, with_aux = _reference()
    _, without = _reference(dataclasses.replace(CFG, aux_weight=0.0))
    assert _max_rel(with_aux["blocks"][0]["moe"]["router"], without["blocks"][0]["moe"]["router"]) > 1e-3


# (data 4 x expert 2) in the slow run: test_gradients_equal_one_device[4] covers that mesh by default.
@pytest.mark.parametrize("data", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_mixtral_trains_like_one_device_in_fp32(data):
    """10 AdamW steps on (data 2 x expert 4) and (data 4 x expert 2), load-balancing loss included."""
    ref_losses, ref = _reference()
    losses, sharded = _train_sharded(data)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), js.unshard(sharded), ref)
    w_down = sharded["blocks"][0]["moe"]["experts"]["w_down"]
    assert w_down.sharding.spec[0] == "expert" and "data" in w_down.sharding.spec
    assert w_down.addressable_shards[0].data.size * 8 > CFG.experts * CFG.hidden * CFG.dim  # padded: 17 rows over data


# (data 4 x expert 2) in the slow run: test_gradients_equal_one_device[4] covers that mesh by default.
@pytest.mark.parametrize("data", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_the_plain_jax_model_sharded_with_the_core_api_trains_like_the_nnx_model_on_one_device(data):
    """jshard.demo.moe_jax (pure functions over the dict, its own initializer laying the dict out
    as nnx.split does) sharded by shard_mixtral: 10 AdamW steps within 1e-5 of the unsharded NNX model."""
    assert jax.tree.map(jnp.shape, jax.eval_shape(functools.partial(moe_jax.init_params, CFG), jax.random.key(0))) == \
        jax.tree.map(jnp.shape, init_params(CFG)[1])
    ref_losses, ref = _reference()
    losses, sharded = _train_sharded(data, plain=True)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), js.unshard(sharded), ref)
    assert sharded["blocks"][1]["moe"]["experts"]["w_gate"].sharding.spec == P("expert", "data")


@pytest.mark.parametrize("data", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_the_nnx_model_sharded_through_the_nnx_adapter_trains_like_one_device(data):
    """jshard.flax.nnx.fully_shard keeps the experts' P('expert') placement and adds FSDP over
    `data`; 10 AdamW steps (nnx.Optimizer, jnnx.value_and_grad) within 1e-5 of one device.
    (data 4 x expert 2) runs with -m slow: the default run is at its time budget, and the
    adapter's path is the same on both meshes (the core API's tests run both)."""
    ref_losses, ref = _reference()
    cfg = dataclasses.replace(CFG, expert_axis="expert")
    model = shard_mixtral_nnx(Mixtral(cfg, nnx.Rngs(0)), expert_mesh(cfg.experts, expert_degree=8 // data))
    assert model.blocks[0].moe.experts.w_down.get_value().sharding.spec == P("expert", "data")
    assert model.head.kernel.get_value().sharding.spec == P(("data", "expert"))
    optimizer = nnx.Optimizer(model, _adamw(), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, tokens):
        loss, grads = jnnx.value_and_grad(lm_loss)(model, tokens)
        optimizer.update(model, grads)
        return loss

    with jax.numpy_dtype_promotion("standard"):
        losses = [float(step(model, optimizer, _tokens())) for _ in range(STEPS)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jnnx.unshard(model)
    got = nnx.state(model, nnx.Param).to_pure_dict()
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), got, ref)


def test_the_nnx_guard_knows_an_expert_units_shard_shape():
    """Inside the step an expert Param holds (E / M, d / data, f): read outside its module's
    forward, the guard names it instead of letting the loss compute on a shard."""
    cfg = dataclasses.replace(CFG, expert_axis="expert")
    model = shard_mixtral_nnx(Mixtral(cfg, nnx.Rngs(0)), expert_mesh(cfg.experts, expert_degree=4))

    def peek(model, tokens):
        return lm_loss(model, tokens) + model.blocks[1].moe.experts.w_up[...].sum()

    with pytest.raises(RuntimeError, match=r"Param `blocks\[1\]\.moe\.experts\.w_up` of a fully sharded module was "
                                           r"read inside the step while its module's parameters are not gathered"):
        jax.jit(lambda m, t: jnnx.value_and_grad(peek)(m, t)).lower(model, _tokens())


@pytest.mark.parametrize("data", [2, 4])
def test_gradients_equal_one_device(data):
    """The first step's gradients (AdamW hides a wrong gradient scale from the losses)."""
    graphdef, params = init_params(CFG)
    want = jax.jit(jax.grad(lambda p, t: lm_loss(nnx.merge(graphdef, p), t)))(params, jnp.asarray(_tokens()))
    cfg = dataclasses.replace(CFG, expert_axis="expert")
    sharded_graphdef, _ = init_params(cfg)
    sharded = shard_mixtral(params, expert_mesh(cfg.experts, expert_degree=8 // data))
    grad_fn = js.value_and_grad(lambda p, t: lm_loss(nnx.merge(sharded_graphdef, p), t))
    _, grads = jax.jit(grad_fn)(sharded, _tokens())
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), js.unshard(grads), want)


def test_bf16_mixed_precision_stays_within_its_tolerance():
    """bf16 gathers and compute, fp32 reductions and fp32 master weights, on (data 2 x expert 4),
    against the one-device model computing in bf16 from fp32 masters (the same casts, no sharding).
    Measured (10 AdamW steps at lr 3e-2, tokens dispatched in bf16): step 1 equal, step 2 within
    1.6e-4, then bf16 rounding flips routing and capacity decisions and the trajectories part
    (2.7% at most over 10 steps, 2.9% from fp32; the one-device bf16 run is itself up to 4.9%
    from fp32). Tolerances: 1e-5 for step 1, 5e-4 for step 2, 5% for all ten."""
    mp = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
    losses, sharded = _train_sharded(2, mp)
    assert sharded["head"]["kernel"].dtype == jnp.float32
    bf16_losses, _ = _reference(CFG, jnp.bfloat16)
    np.testing.assert_allclose(losses[0], bf16_losses[0], rtol=1e-5)
    np.testing.assert_allclose(losses[1], bf16_losses[1], rtol=5e-4)
    np.testing.assert_allclose(losses, bf16_losses, rtol=5e-2)
    np.testing.assert_allclose(losses, _reference()[0], rtol=5e-2)
    assert losses[-1] < losses[0] - 1.0


def test_config_and_mesh_errors_say_what_to_do():
    with pytest.raises(ValueError, match=r"`dim` 10 is not a multiple of `heads` 3"):
        MoEConfig(dim=10, heads=3)
    with pytest.raises(ValueError, match=r"`top_k` 5 must be in \[1, experts=4\]"):
        MoEConfig(experts=4, top_k=5)
    with pytest.raises(ValueError, match=r"Expert degree 3 must divide both the 8 devices and the 4 experts"):
        expert_mesh(4, expert_degree=3)


def _per_device_bytes(leaf: np.ndarray, sharded: jax.Array, mesh) -> int:
    """Analytic bytes of one device's shard: each dim of the original shape divided by the mesh
    axes its spec names, rounded up (the padding fully_shard adds)."""
    spec = tuple(sharded.sharding.spec) + (None,) * leaf.ndim
    rows = []
    for n, axes in zip(leaf.shape, spec, strict=False):
        ways = int(np.prod([mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ())]))
        rows.append(-(-n // ways))
    return int(np.prod(rows)) * leaf.dtype.itemsize


@pytest.mark.parametrize("data", [2, 4])
def test_arguments_and_all_to_all_bytes_match_the_analytic_figures(data):
    """From the compiled gradient step on CPU: arguments per device = expert weights / (M x FSDP) +
    dense / 8 + padding + the batch shard; all-to-all bytes per device = local tokens x d x top-k x
    capacity factor x 4 bytes, four per MoE layer (dispatch and return, forward and backward)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jshard._report.hlo import hlo_collectives

    m = 8 // data
    mesh = expert_mesh(CFG.experts, expert_degree=m)
    cfg = dataclasses.replace(CFG, expert_axis="expert")
    graphdef, params = init_params(cfg)
    sharded = shard_mixtral(params, mesh)
    tokens = jax.device_put(_tokens(), NamedSharding(mesh, P(("data", "expert"))))
    grad_fn = js.value_and_grad(lambda p, t: lm_loss(nnx.merge(graphdef, p), t))
    compiled = jax.jit(grad_fn).lower(sharded, tokens).compile()

    leaves = [np.asarray(x) for x in jax.tree.leaves(params)]
    expert = [i for i, (path, _) in enumerate(jax.tree_util.tree_leaves_with_path(params)) if "'experts'" in str(path)]
    expert_bytes = sum(leaves[i].nbytes for i in expert)
    dense_bytes = sum(x.nbytes for x in leaves) - expert_bytes
    unpadded = expert_bytes / (m * data) + dense_bytes / 8
    analytic = sum(_per_device_bytes(x, s, mesh) for x, s in zip(leaves, jax.tree.leaves(sharded), strict=True))
    batch_bytes = tokens.nbytes // 8
    argument = compiled.memory_analysis().argument_size_in_bytes
    print(f"arguments per device: {argument} B = {unpadded:.0f} unpadded + {analytic - unpadded:.0f} padding "
          f"+ {batch_bytes} batch")
    assert argument == analytic + batch_bytes
    assert 0 < analytic - unpadded < 0.5 * unpadded  # f=17, d=10 over data 2 / 4 and dense over 8 pad a little

    found = [c for c in hlo_collectives(compiled.as_text()) if c.kind == "all-to-all"]
    local_tokens = BATCH // 8 * SEQ
    per_exchange = local_tokens * CFG.dim * CFG.top_k * CFG.capacity_factor * 4
    assert CFG.experts * CFG.capacity(SEQ) == SEQ * CFG.top_k * CFG.capacity_factor  # no rounding of C here
    print(f"all-to-all: {len(found)} x {[c.bytes for c in found]} B, analytic {per_exchange:.0f} B each")
    assert len(found) == 4 * CFG.layers
    assert all(c.bytes == per_exchange and len(c.replica_groups.split("},{")[0].split(",")) == m for c in found)
    assert sum(c.bytes for c in found) == 4 * CFG.layers * per_exchange


def test_the_docs_moe_example_runs(capsys):
    assert docs_example_output("docs/parallelism.md", "moe-example", capsys)[:2] == ["P('expert', 'data')", "True"]


def test_tokens_travel_in_bf16_under_mixed_precision():
    """The all-to-alls carry the experts' compute dtype, half the fp32 bytes (read from the lowered
    program: XLA:CPU runs bf16 collectives in f32, so the compiled one cannot show it)."""
    import re

    cfg = dataclasses.replace(CFG, expert_axis="expert")
    graphdef, params = init_params(cfg)
    mp = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
    sharded = shard_mixtral(params, expert_mesh(cfg.experts), mp)
    grad_fn = js.value_and_grad(lambda p, t: lm_loss(nnx.merge(graphdef, p), t))
    with jax.numpy_dtype_promotion("standard"):
        text = jax.jit(grad_fn).lower(sharded, _tokens()).as_text()
    found = re.findall(r"all_to_all.*?-> tensor<([^>]*)>", text)
    assert len(found) == 4 * CFG.layers and all(t.endswith("xbf16") for t in found), found


def test_the_step_report_names_each_units_shard_size():
    """Dense units shard over all 8 devices, expert units over `data` only: the report says both."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jshard.report import format_report, step_report

    mesh = expert_mesh(CFG.experts, expert_degree=4)
    cfg = dataclasses.replace(CFG, expert_axis="expert")
    graphdef, params = init_params(cfg)
    tokens = jax.device_put(_tokens(), NamedSharding(mesh, P(("data", "expert"))))
    grad_fn = js.value_and_grad(lambda p, t: lm_loss(nnx.merge(graphdef, p), t))
    report = step_report(grad_fn, shard_mixtral(params, mesh), tokens)
    assert "shard sizes N=8 / 2 (units on different axes)" in format_report(report).splitlines()[0]


def test_the_mixtral_plan_builder_refuses_settings_it_does_not_read():
    """``build_mixtral`` writes its step one way: a plan asking for offload, another remat,
    resharding or small leaves kept whole would be planned without them, so it is refused."""
    from jshard.demo.moe_train import build_mixtral
    from jshard.report import PlanConfig

    mesh = jax.make_mesh((8,), ("fsdp",))
    with pytest.raises(ValueError, match=r"reads only batch_per_device and mixed_precision .* \{'offload': True\}"):
        build_mixtral(mesh, PlanConfig(offload=True), cfg=dataclasses.replace(CFG, expert_axis="expert"))
    with pytest.raises(ValueError, match=r"'remat': 'full', 'replicate_below': 64"):
        build_mixtral(mesh, PlanConfig(remat="full", replicate_below=64), cfg=CFG)
    step, args = build_mixtral(mesh, PlanConfig(batch_per_device=1), cfg=dataclasses.replace(CFG, expert_axis="expert"),
                               seq_len=8)
    assert args[2].shape == (8, 9)
