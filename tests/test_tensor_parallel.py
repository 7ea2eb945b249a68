"""2-D parallelism: FSDP over leaves that tensor parallelism already splits ("model axes").

Parity against one device, per-device bytes and FLOPs, and the collectives of the
compiled step: FSDP gathers only each device's tensor-parallel block.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import max_diff
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jshard as js
from jshard.report import step_collectives, step_report

STEPS = 10
AUTO = AxisType.Auto


def tp_mesh(shape=(4, 2), names=("fsdp", "tp"), types=None):
    return jax.make_mesh(shape, names, axis_types=types or (AUTO,) * len(names))


# ---------------------------------------------------------------------------------------
# Models: a Megatron MLP (column- then row-parallel) and a transformer block with its
# attention heads split over "tp". Each returns (params, tensor-parallel specs, loss).

def mlp(d=15, f=32, seed=0):
    rng = np.random.default_rng(seed)
    params = {"w1": rng.normal(size=(d, f)) * 0.3, "b1": np.full(f, 0.1), "w2": rng.normal(size=(f, d)) * 0.3,
              "b2": np.zeros(d)}
    specs = {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None), "b2": P()}

    def loss(p, batch):
        h = jax.nn.relu(batch["x"] @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] + p["b2"] - batch["y"]) ** 2)

    return {k: v.astype(np.float32) for k, v in params.items()}, specs, loss


def block(d=10, heads=4, head_dim=4, f=32, seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "ln1": np.ones(d), "wq": rng.normal(size=(d, heads, head_dim)) * 0.3,
        "wk": rng.normal(size=(d, heads, head_dim)) * 0.3, "wv": rng.normal(size=(d, heads, head_dim)) * 0.3,
        "wo": rng.normal(size=(heads, head_dim, d)) * 0.3, "ln2": np.ones(d),
        "up": rng.normal(size=(d, f)) * 0.3, "down": rng.normal(size=(f, d)) * 0.3,
    }
    specs = {"ln1": P(), "wq": P(None, "tp"), "wk": P(None, "tp"), "wv": P(None, "tp"), "wo": P("tp"),
             "ln2": P(), "up": P(None, "tp"), "down": P("tp")}

    def norm(x, scale):
        return (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5) * scale

    def loss(p, batch):
        x = batch["x"]
        h = norm(x, p["ln1"])
        q, k, v = (jnp.einsum("btd,dhe->bthe", h, p[w]) for w in ("wq", "wk", "wv"))
        s = jnp.einsum("bqhe,bkhe->bhqk", q, k) / math.sqrt(q.shape[-1])
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -1e9)
        x = x + jnp.einsum("bqhe,hed->bqd", jnp.einsum("bhqk,bkhe->bqhe", jax.nn.softmax(s, -1), v), p["wo"])
        x = x + jax.nn.gelu(norm(x, p["ln2"]) @ p["up"]) @ p["down"]
        return jnp.mean((x - batch["y"]) ** 2)

    return {k: v.astype(np.float32) for k, v in params.items()}, specs, loss


def batches(shape, seed=1):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=shape).astype(np.float32), "y": rng.normal(size=shape).astype(np.float32)}
            for _ in range(STEPS)]


TX = optax.sgd(0.05, momentum=0.9)


def train_reference(params, loss, data):
    params = jax.tree.map(jnp.asarray, params)
    state, losses = TX.init(params), []

    @jax.jit
    def step(p, s, b):
        value, g = jax.value_and_grad(loss)(p, b)
        u, s = TX.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    for b in data:
        params, state, value = step(params, state, b)
        losses.append(float(value))
    return np.array(losses), params


def place(params, specs, mesh):
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}


def jshard_step(loss, grad=js.value_and_grad, **grad_kw):
    """``(optimizer, step)``: SGD-momentum through ``shard_optimizer``, gradients from ``grad``
    (``js.value_and_grad`` or an adapter's)."""
    optimizer = js.shard_optimizer(TX)

    @jax.jit
    def step(p, s, b):
        value, g = grad(loss, **grad_kw)(p, b)
        u, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    return optimizer, step


def train_sharded(sharded, loss, data, **grad_kw):
    optimizer, step = jshard_step(loss, **grad_kw)
    state, losses = optimizer.init(sharded), []
    for b in data:
        sharded, state, value = step(sharded, state, b)
        losses.append(float(value))
    return np.array(losses), sharded, state, step


# ---------------------------------------------------------------------------------------
# Layout

def test_fully_shard_keeps_the_tensor_parallel_split_and_adds_fsdp():
    mesh = tp_mesh()
    params, specs, _ = mlp(d=15)
    sharded = js.fully_shard(place(params, specs, mesh), mesh)
    got = {k: (v.shape, v.sharding.spec) for k, v in sharded.tree.items()}
    assert got == {
        "w1": ((16, 32), P("fsdp", "tp")),  # FSDP on the free dim 0 (15 padded to 16)
        "w2": ((32, 16), P("tp", "fsdp")),  # dim 0 belongs to tp: FSDP goes to dim 1
        "b1": ((32,), P(("fsdp", "tp"),)),  # no free dim: both split dim 0, FSDP outermost
        "b2": ((16,), P("fsdp",)),
    }
    for k, v in sharded.tree.items():  # every device holds 1/(N x TP) of a model-split leaf
        parts = 8 if k != "b2" else 4
        assert v.addressable_shards[0].data.size == v.size // parts
    full = js.unshard(sharded)
    assert full["w1"].sharding.spec == P(None, "tp") and full["w2"].sharding.spec == P("tp")
    assert all(np.array_equal(np.asarray(full[k]), params[k]) for k in params)
    abstract = js.fully_shard({k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, specs[k]))
                               for k, v in params.items()}, mesh)
    assert {k: v.sharding.spec for k, v in abstract.tree.items()} == {k: s for k, (_, s) in got.items()}


def test_a_model_split_that_does_not_divide_the_dim_is_refused():
    mesh = tp_mesh()
    with pytest.raises(ValueError, match=r"Leaf \['w'\] of shape \(4, 7\).*dim 1 \(size 7\) arrives split over model "
                                         r"axes \('tp',\) \(size 2\), which does not divide it"):
        js.fully_shard({"w": jax.ShapeDtypeStruct((4, 7), jnp.float32, sharding=NamedSharding(mesh, P(None, "tp")))},
                       mesh)


# ---------------------------------------------------------------------------------------
# Parity: 10 SGD-momentum steps against one device, fp32, within 1e-5.

MESHES = {
    "fsdp4-tp2": lambda: tp_mesh(),
    "replicate2-fsdp2-tp2": lambda: tp_mesh((2, 2, 2), ("replicate", "fsdp", "tp")),
}


@pytest.mark.parametrize("model", [mlp, block], ids=["megatron-mlp", "transformer-block"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_parity_with_one_device(model, mesh_name):
    mesh = MESHES[mesh_name]()
    params, specs, loss = model()
    shape = (16, params["w1"].shape[0]) if model is mlp else (8, 8, params["ln1"].shape[0])
    data = batches(shape)
    ref_losses, ref = train_reference(params, loss, data)
    losses, sharded, _, _ = train_sharded(js.fully_shard(place(params, specs, mesh), mesh), loss, data)
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=1e-5)
    assert max_diff(ref, js.unshard(sharded)) <= 1e-5
    assert losses[-1] < losses[0]


# ---------------------------------------------------------------------------------------
# The compiled step: bytes, FLOPs, collectives.

def _collectives(compiled, mesh):
    """``(kind, result shape, mesh axes)`` of every collective of a compiled step."""
    return [(c.kind, c.shapes[0], c.axes) for c in step_collectives(compiled.as_text(), "", dict(mesh.shape))]


def test_fsdp_gathers_each_devices_tensor_parallel_block_and_tp_reduces_activations():
    mesh = tp_mesh()
    d, f = 64, 256
    params, specs, loss = mlp(d=d, f=f)
    sharded = js.fully_shard(place(params, specs, mesh), mesh)
    found = _collectives(jax.jit(js.value_and_grad(loss)).lower(sharded, batches((32, d))[0]).compile(), mesh)
    fsdp_gathers = {shape for kind, shape, axis in found if kind == "all-gather" and axis == ("fsdp",)}
    assert {(d, f // 2), (f // 2, d)} <= fsdp_gathers  # w1, w2: this device's tp block, never the whole weight
    assert not {(d, f), (f, d)} & {shape for _, shape, _ in found}
    assert {(f // 2, d // 4), (d // 4, f // 2)} <= {s for k, s, a in found if k == "reduce-scatter" and a == ("fsdp",)}
    assert ("all-reduce", (32 // 4, d), ("tp",)) in found  # Megatron: the row-parallel partial sums over tp


def test_per_device_bytes_and_flops_are_split_over_fsdp_and_tp():
    mesh = tp_mesh()
    d, f, batch = 64, 256, 64
    params, specs, loss = mlp(d=d, f=f)
    sharded = js.fully_shard(place(params, specs, mesh), mesh)
    optimizer, step = jshard_step(loss)
    state = optimizer.init(sharded)
    data = batches((batch, d))[0]
    compiled = step.lower(sharded, state, data).compile()
    # params and momentum: (d*f + f + f*d) / 8 each and b2 (d,) / 4; the batch split over fsdp only
    per_device = 2 * 4 * ((d * f + f + f * d) // 8 + d // 4) + 2 * 4 * batch * d // 4
    assert compiled.memory_analysis().argument_size_in_bytes == per_device
    flops = compiled.cost_analysis()
    flops = (flops if isinstance(flops, dict) else flops[0])["flops"]
    one = jax.jit(lambda p, b: jax.value_and_grad(loss)(p, b)).lower(params, data).compile().cost_analysis()
    one = (one if isinstance(one, dict) else one[0])["flops"]
    assert 0.9 / 8 < flops / one < 1.35 / 8


def test_the_report_lists_tensor_parallel_collectives_apart_and_matches_the_analytic_model():
    mesh = tp_mesh()
    params, specs, loss = mlp(d=64, f=256)
    sharded = js.fully_shard(place(params, specs, mesh), mesh)
    report = step_report(js.value_and_grad(loss), sharded, batches((32, 64))[0])
    ratios = report.ratios()
    assert ratios["argument bytes"] == 1.0
    assert 0.95 <= ratios["all-gather bytes/step"] <= 1.0 and ratios["reduce-scatter bytes/step"] == 1.0
    assert report.model_collective_bytes["all-reduce"] > 0  # Megatron's partial sums over tp
    assert report.analytic.param_bytes == 4 * ((64 * 256 * 2 + 256) // 8 + 64 // 4)
    text = str(report)
    assert text.startswith("jshard step report: mesh {fsdp=4, tp=2}, 8 devices, shard size N=4, replicate R=1")
    assert "along model axes ('tp',) (placed by GSPMD, not in the analytic model): " in text
    assert " over fsdp" in text and " over tp" in text


# ---------------------------------------------------------------------------------------
# The rest of jshard on a 2-D mesh.

def _mlp_run(policy=None, **grad_kw):
    mesh = tp_mesh()
    params, specs, loss = mlp()
    data = batches((16, params["w1"].shape[0]))
    ref_losses, ref = train_reference(params, loss, data)
    sharded = js.fully_shard(place(params, specs, mesh), mesh, policy)
    losses, trained, _, _ = train_sharded(sharded, loss, data, **grad_kw)
    return losses, ref_losses, js.unshard(trained), ref


@pytest.mark.parametrize("kw", [{"reshard_after_forward": True}, {"reshard_after_forward": False},
                                {"reshard_after_forward": 2}, {"offload_policy": js.CPUOffloadPolicy()}],
                         ids=["raf-true", "raf-false", "raf-2", "offload"])
def test_policies_on_a_tp_mesh(kw):
    losses, ref_losses, trained, ref = _mlp_run(js.FullyShardPolicy(**kw))
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=1e-5)
    assert max_diff(ref, trained) <= 1e-5


@pytest.mark.parametrize("grad_kw", [{"microbatches": 2}, {"requires_gradient_sync": False, "microbatches": 2}],
                         ids=["accumulate", "deferred-sync"])
def test_accumulation_on_a_tp_mesh(grad_kw):
    losses, ref_losses, trained, ref = _mlp_run(**grad_kw)
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=1e-5)
    assert max_diff(ref, trained) <= 1e-5


def test_mixed_precision_gathers_in_bf16_and_reduces_in_fp32_on_a_tp_mesh():
    from jshard._report.hlo import lowered_collectives

    mp = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
    with jax.numpy_dtype_promotion("standard"):
        losses, ref_losses, trained, ref = _mlp_run(js.FullyShardPolicy(mp_policy=mp))
        mesh = tp_mesh()
        params, specs, loss = mlp()
        sharded = js.fully_shard(place(params, specs, mesh), mesh, js.FullyShardPolicy(mp_policy=mp))
        lowered = jax.jit(js.value_and_grad(loss)).lower(sharded, batches((16, 15))[0]).as_text()
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)
    assert max_diff(ref, trained) <= 2e-2
    kinds = set(lowered_collectives(lowered))
    assert ("all-gather", "bfloat16") in kinds and ("reduce-scatter", "float32") in kinds
    assert ("reduce-scatter", "bfloat16") not in kinds and ("all-gather", "float32") not in kinds


def test_stacked_layers_under_js_scan_on_a_tp_mesh():
    mesh = tp_mesh()
    rng = np.random.default_rng(0)
    layers, d, f = 3, 15, 32
    params = {"w1": (rng.normal(size=(layers, d, f)) * 0.3).astype(np.float32),
              "w2": (rng.normal(size=(layers, f, d)) * 0.3).astype(np.float32)}
    specs = {"w1": P(None, None, "tp"), "w2": P(None, "tp", None)}

    def layer(h, p):
        return h + jnp.tanh(h @ p["w1"]) @ p["w2"], None

    def reference_loss(p, batch):
        return jnp.mean((jax.lax.scan(layer, batch["x"], p)[0] - batch["y"]) ** 2)

    def loss(p, batch):
        return jnp.mean((js.scan(layer, batch["x"], p)[0] - batch["y"]) ** 2)

    data = batches((16, d))
    ref_losses, ref = train_reference(params, reference_loss, data)
    stack = js.fully_shard(place(params, specs, mesh), mesh, js.FullyShardPolicy(scan_axis=0))
    assert stack.tree["w1"].sharding.spec == P(None, "fsdp", "tp")
    losses, trained, _, _ = train_sharded(stack, loss, data, unshard_params=False)
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=1e-5)
    assert max_diff(ref, js.unshard(trained)) <= 1e-5


def _on(mesh, params, specs):
    """``params`` fully sharded on ``mesh``, tensor-parallel where ``mesh`` has a "tp" axis."""
    if "tp" not in mesh.axis_names:
        return js.fully_shard(jax.tree.map(jnp.asarray, params), mesh)
    return js.fully_shard(place(params, specs, mesh), mesh)


def test_checkpoints_and_state_dicts_restore_onto_other_meshes_bit_exact(tmp_path):
    from jshard.checkpoint import CheckpointManager
    from jshard.state_dict import full_state_dict, load_full_state_dict

    params, specs, loss = mlp()
    _, trained, opt_state, _ = train_sharded(_on(tp_mesh(), params, specs), loss, batches((16, 15))[:2])
    saved = {"params": trained, "opt": opt_state}
    want = jax.tree.map(np.asarray, full_state_dict(saved))
    targets = {
        "fsdp8": js.make_mesh(),
        "fsdp2-tp4": tp_mesh((2, 4)),
        "one-device": js.make_mesh(devices=jax.devices()[:1]),
    }
    optimizer = js.shard_optimizer(TX)
    with CheckpointManager(tmp_path) as ckpt:
        ckpt.save(2, saved)
        for name, mesh in targets.items():
            like_params = _on(mesh, params, specs)
            like = {"params": like_params, "opt": optimizer.init(like_params)}
            restored = ckpt.restore(like)
            got = jax.tree.map(np.asarray, full_state_dict(restored))
            assert jax.tree.all(jax.tree.map(np.array_equal, got, want)), name
            if "tp" in mesh.axis_names:
                assert restored["params"]["w1"].sharding.spec == P("fsdp", "tp")
            loaded = load_full_state_dict(want, like)
            assert jax.tree.all(jax.tree.map(np.array_equal, jax.tree.map(np.asarray, full_state_dict(loaded)), want))


# ---------------------------------------------------------------------------------------
# The Flax adapters, with the models' own partitioning metadata.

def test_nnx_modules_with_partitioning_metadata_train_on_a_tp_mesh():
    from flax import nnx

    from jshard.flax import nnx as jnnx

    lecun = nnx.initializers.lecun_normal()

    class MLP(nnx.Module):
        def __init__(self, d, f, rngs):
            self.up = nnx.Linear(d, f, kernel_init=nnx.with_partitioning(lecun, (None, "tp")),
                                 bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("tp",)), rngs=rngs)
            self.down = nnx.Linear(f, d, kernel_init=nnx.with_partitioning(lecun, ("tp", None)), rngs=rngs)

        def __call__(self, x):
            return x + self.down(jax.nn.relu(self.up(x)))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([MLP(15, 32, rngs) for _ in range(2)])
            self.head = nnx.Linear(15, 3, rngs=rngs)

        def __call__(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    def loss_fn(m, batch):
        return jnp.mean((m(batch["x"]) - batch["y"][:, :3]) ** 2)

    def train(model, grad_fn):
        optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer, b):
            value, g = grad_fn(loss_fn)(model, b)
            optimizer.update(model, g)
            return value

        return np.array([float(step(model, optimizer, b)) for b in batches((16, 15))])

    one = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1], axis_types=(AUTO, AUTO))
    with jax.set_mesh(one):  # Flax creates annotated Variables only under a mesh
        reference = Model(nnx.Rngs(0))
        ref_losses = train(reference, nnx.value_and_grad)
    mesh = tp_mesh()
    with jax.set_mesh(mesh):
        model = Model(nnx.Rngs(0))
        for b in model.blocks:
            jnnx.fully_shard(b, mesh)
        jnnx.fully_shard(model, mesh)
        assert model.blocks[0].up.kernel.get_value().sharding.spec == P("fsdp", "tp")
        losses = train(model, jnnx.value_and_grad)
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=1e-5)
    full = nnx.to_pure_dict(nnx.state(jnnx.unshard(model), nnx.Param))
    assert max_diff(full, nnx.to_pure_dict(nnx.state(reference, nnx.Param))) <= 1e-5


def test_linen_params_with_partitioning_metadata_train_on_a_tp_mesh():
    import flax.linen as nn

    from jshard.flax import linen as jlinen

    lecun = nn.initializers.lecun_normal()

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(32, kernel_init=nn.with_partitioning(lecun, (None, "tp")),
                         bias_init=nn.with_partitioning(nn.initializers.zeros_init(), ("tp",)), name="up")(x)
            down = nn.Dense(15, kernel_init=nn.with_logical_partitioning(lecun, ("mlp", "embed")), name="down")
            return x + down(jax.nn.relu(h))  # logical axis names, mapped to "tp" by the rules below

    class Model(nn.Module):
        block: type = MLP

        @nn.compact
        def __call__(self, x):
            for i in range(2):
                x = self.block(name=f"block_{i}")(x)
            return nn.Dense(3, name="head")(x)

    def loss_of(model):
        return lambda p, b: jnp.mean((model.apply({"params": p}, b["x"]) - b["y"][:, :3]) ** 2)

    x = jnp.ones((16, 15))
    boxed = Model().init(jax.random.key(0), x)["params"]
    plain = nn.unbox(boxed)
    data = batches((16, 15))
    ref_losses, ref = train_reference(plain, loss_of(Model()), data)
    mesh = tp_mesh()
    model = jlinen.fully_shard(Model, mesh=mesh)(block=jlinen.fully_shard(MLP, mesh=mesh))
    with nn.logical_axis_rules([("mlp", "tp"), ("embed", None)]):
        sharded = jlinen.shard_params(model, boxed, x)
    assert sharded["block_0"]["up"]["kernel"].sharding.spec == P("fsdp", "tp")
    assert sharded["block_1"]["down"]["kernel"].sharding.spec == P("tp", "fsdp")
    losses, sharded, _, _ = train_sharded(sharded, loss_of(model), data, grad=jlinen.value_and_grad)
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=1e-5)
    assert max_diff(js.unshard(sharded), ref) <= 1e-5


def test_the_docs_example_runs_and_trains(capsys):
    import pathlib

    text = (pathlib.Path(__file__).parents[1] / "docs" / "parallelism.md").read_text()
    code = re.search(r"<!-- tp-example -->\s*```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    with jax.numpy_dtype_promotion("standard"):  # a user program: JAX's default promotion (Adam's step count)
        exec(code, scope)
    specs, loss = capsys.readouterr().out.strip().splitlines()
    assert specs == "{'down': P('tp', 'fsdp'), 'up': P('fsdp', 'tp'), 'up_bias': P(('fsdp', 'tp'),)}"
    assert math.isfinite(float(loss))
    assert scope["sharded"]["down"].sharding.spec == P("tp", "fsdp")


def test_explicit_model_axes_train_like_one_device():
    """With Explicit axes the model states the sharding JAX asks for (the row-parallel contraction's)."""
    explicit = AxisType.Explicit
    mesh = tp_mesh(types=(explicit, explicit))
    params, specs, _ = mlp()

    def loss(p, batch):
        h = jax.nn.relu(batch["x"] @ p["w1"] + p["b1"])
        out = jnp.einsum("bf,fd->bd", h, p["w2"], out_sharding=P()) if "tp" in jax.typeof(h).sharding.mesh.axis_names \
            else h @ p["w2"]
        return jnp.mean((out + p["b2"] - batch["y"]) ** 2)

    data = batches((16, 15))
    ref_losses, ref = train_reference(params, loss, data)
    losses, trained, _, _ = train_sharded(js.fully_shard(place(params, specs, mesh), mesh), loss, data)
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=1e-5)
    assert max_diff(ref, js.unshard(trained)) <= 1e-5
