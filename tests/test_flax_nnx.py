"""jshard.flax.nnx: per-module units for Flax NNX, against unsharded NNX training."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import run_nnx_blocks
from jax.sharding import NamedSharding, PartitionSpec

import jshard as js
from jshard.flax import nnx as jnnx

STEPS = 10
BATCH = 16


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 37
    seq: int = 8
    dim: int = 16
    heads: int = 2
    layers: int = 2
    tied: bool = False
    scan: bool = False
    embed_dtype: object = None  # nnx.Embed fixes its compute dtype at construction


class Attention(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.qkv = nnx.Linear(cfg.dim, 3 * cfg.dim, rngs=rngs)
        self.out = nnx.Linear(cfg.dim, cfg.dim, rngs=rngs)
        self.heads = cfg.heads

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = (y.reshape(b, t, self.heads, d // self.heads) for y in jnp.split(self.qkv(x), 3, axis=-1))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / (d // self.heads) ** 0.5
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v).reshape(b, t, d))


class Block(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(cfg.dim, rngs=rngs)
        self.attn = Attention(cfg, rngs)
        self.ln2 = nnx.LayerNorm(cfg.dim, rngs=rngs)
        self.up = nnx.Linear(cfg.dim, 4 * cfg.dim, rngs=rngs)
        self.down = nnx.Linear(4 * cfg.dim, cfg.dim, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class Transformer(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.dim, rngs=rngs, dtype=cfg.embed_dtype)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.seq, cfg.dim)))
        if cfg.scan:

            @nnx.split_rngs(splits=cfg.layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def create(rngs):
                return Block(cfg, rngs)

            self.blocks = create(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.ln_f = nnx.LayerNorm(cfg.dim, rngs=rngs)
        if not cfg.tied:
            self.head = nnx.Linear(cfg.dim, cfg.vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.ln_f(run_nnx_blocks(self.blocks, self.embed(tokens) + self.pos[...], self.cfg.scan))
        return self.embed.attend(x) if self.cfg.tied else self.head(x)


def loss_fn(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()


def batches(cfg: Config):
    key = jax.random.key(1)
    for _ in range(STEPS):
        k1, k2, key = jax.random.split(key, 3)
        yield {
            "x": jax.random.randint(k1, (BATCH, cfg.seq), 0, cfg.vocab),
            "y": jax.random.randint(k2, (BATCH, cfg.seq), 0, cfg.vocab),
        }


def shard(model: Transformer, block_policy=None, root_policy=None) -> Transformer:
    """FSDP2's pattern: every block, then the root."""
    if model.cfg.scan:
        jnnx.fully_shard(model.blocks, policy=dataclasses.replace(block_policy or js.FullyShardPolicy(), scan_axis=0))
    else:
        for block in model.blocks:
            jnnx.fully_shard(block, policy=block_policy)
    return jnnx.fully_shard(model, policy=root_policy)


def on_mesh(tree):
    """Commit unsharded leaves (optimizer step counter) to the mesh: one compile, not two."""
    mesh = js.make_mesh()
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: x if isinstance(x.sharding, NamedSharding) else jax.device_put(x, replicated), tree)


def train(model, grad_fn, cfg: Config, jit: str = "nnx"):
    optimizer = nnx.Optimizer(model, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)
    nnx.update(optimizer, on_mesh(nnx.state(optimizer)))
    if jit == "nnx":

        @nnx.jit
        def step(model, optimizer, batch):
            loss, grads = grad_fn(loss_fn)(model, batch)
            optimizer.update(model, grads)
            return loss

        losses = [float(step(model, optimizer, b)) for b in batches(cfg)]
    else:  # nnx.split / nnx.merge around jax.jit
        graphdef, state = nnx.split((model, optimizer))

        @jax.jit
        def pure_step(state, batch):
            model, optimizer = nnx.merge(graphdef, state)
            loss, grads = grad_fn(loss_fn)(model, batch)
            optimizer.update(model, grads)
            return loss, nnx.state((model, optimizer))

        losses = []
        for b in batches(cfg):
            loss, state = pure_step(state, b)
            losses.append(float(loss))
        nnx.update((model, optimizer), state)
    return np.array(losses), model


@functools.cache
def reference(cfg: Config):
    losses, model = train(Transformer(cfg, nnx.Rngs(0)), nnx.value_and_grad, cfg)
    return losses, nnx.to_pure_dict(nnx.state(model, nnx.Param))


def params_of_sharded(model) -> dict:
    state = nnx.to_pure_dict(nnx.state(jnnx.unshard(model), nnx.Param))  # arrays: reshard rewrites the Params
    jnnx.reshard(model)
    return state


def max_diff(a, b) -> float:
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(jnp.abs(x - y.astype(x.dtype)).max()), a, b)))


@pytest.mark.parametrize(
    "cfg,jit",
    [(Config(), "jax"), (Config(scan=True, tied=True), "nnx")],
    ids=["unrolled-untied-jax.jit", "scan-tied-nnx.jit"],
)
def test_parity_fp32(cfg, jit):
    ref_losses, ref_params = reference(cfg)
    losses, model = train(shard(Transformer(cfg, nnx.Rngs(0))), jnnx.value_and_grad, cfg, jit)
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=1e-5)
    assert max_diff(ref_params, params_of_sharded(model)) <= 1e-5
    assert losses[-1] < losses[0]


def test_parity_mixed_precision():
    """bf16 gathers and compute, fp32 master shards and reduce-scatters, vs fp32 training.

    Bound: loss within 5e-3 relative, parameters within 1e-2 (measured 6e-4 and 2.6e-3).
    nnx.LayerNorm promotes bf16 with f32 (jnp.promote_types), which strict promotion refuses.
    """
    cfg = Config(scan=True, tied=True)
    ref_losses, ref_params = reference(cfg)
    mp = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
    block = js.FullyShardPolicy(mp_policy=mp)  # the scan carry keeps bf16: no output cast
    root = js.FullyShardPolicy(mp_policy=dataclasses.replace(mp, output_dtype=jnp.float32))
    model = shard(Transformer(dataclasses.replace(cfg, embed_dtype=jnp.bfloat16), nnx.Rngs(0)), block, root)
    with jax.numpy_dtype_promotion("standard"):
        losses, model = train(model, jnnx.value_and_grad, cfg)
    assert model.embed.embedding.get_value().dtype == jnp.float32  # the master copy
    np.testing.assert_allclose(losses, ref_losses, rtol=5e-3)
    assert max_diff(ref_params, params_of_sharded(model)) <= 1e-2


# ----------------------------------------------------------------------------------------
# Memory: block-wise units vs one root unit, from the compiled step.

MEMORY_CFG = Config(vocab=64, seq=32, dim=256, heads=4, layers=6, scan=True)


def step_memory(block_wise: bool):
    model = nnx.eval_shape(lambda: Transformer(MEMORY_CFG, nnx.Rngs(0)))  # abstract: compile only
    model = shard(model) if block_wise else jnnx.fully_shard(model)
    graphdef, state = nnx.split(model)

    def step(state, batch):
        return jnnx.value_and_grad(loss_fn)(nnx.merge(graphdef, state), batch)

    tokens = jax.ShapeDtypeStruct((BATCH, MEMORY_CFG.seq), jnp.int32)
    return jax.jit(step).lower(state, {"x": tokens, "y": tokens}).compile().memory_analysis()


def test_memory_block_wise_vs_root_only():
    """Measured (JAX 0.10.2, CPU, 8 devices): params 18.2 MiB; arguments 2.3 MiB (block-wise) and
    3.0 MiB (root-only); temp 18.7 MiB (block-wise) vs 51.1 MiB (root-only)."""
    params = nnx.eval_shape(lambda: Transformer(MEMORY_CFG, nnx.Rngs(0)))
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(params, nnx.Param)))
    block, root = step_memory(True), step_memory(False)
    n = len(jax.devices())
    assert block.argument_size_in_bytes <= 1.05 * param_bytes / n + 8 * BATCH * MEMORY_CFG.seq
    assert block.temp_size_in_bytes < 0.45 * root.temp_size_in_bytes
    assert block.temp_size_in_bytes + block.argument_size_in_bytes < 1.25 * param_bytes


# ----------------------------------------------------------------------------------------
# FSDPModule controls, on small models (most read the lowered program: no compile).

EVENTS: list = []


class Rec(nnx.Linear):
    """A Linear that records its calls (at trace time)."""

    def __call__(self, x):
        EVENTS.append(("call", self.in_features))
        return super().__call__(x)


def record_gather(x, axes, dim):
    EVENTS.append(("gather", x.shape))
    return js.collectives.all_gather(x, axes, dim)


def forward_events() -> list:
    """Calls and kernel gathers of the forward trace (the gathers' VJP rules trace them again later)."""
    last = max(i for i, e in enumerate(EVENTS) if e[0] == "call")
    return [e for e in EVENTS[: last + 1] if e[0] == "call" or len(e[1]) == 2]


class Tiny(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.blocks = nnx.List([Rec(8, 16, rngs=rngs), Rec(16, 24, rngs=rngs), Rec(24, 8, rngs=rngs)])
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = jnp.tanh(block(x))
        return self.head(x)


def tiny_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


TINY_BATCH = {"x": jnp.linspace(-1.0, 1.0, 16 * 8).reshape(16, 8), "y": jnp.ones((16, 2))}


def tiny(policy=None) -> Tiny:
    model = Tiny(nnx.Rngs(0))
    for block in model.blocks:
        jnnx.fully_shard(block, policy=policy)
    return jnnx.fully_shard(model)


def lowered(model, microbatches: int = 1) -> list[tuple[str, str]]:
    from jshard._report.hlo import lowered_collectives

    graphdef, state = nnx.split(model)

    def step(state, batch):
        return jnnx.value_and_grad(tiny_loss, microbatches=microbatches)(nnx.merge(graphdef, state), batch)

    EVENTS.clear()
    return lowered_collectives(jax.jit(step).lower(state, TINY_BATCH).as_text())


def grads(model, microbatches: int = 1):
    return nnx.jit(lambda m, b: jnnx.value_and_grad(tiny_loss, microbatches=microbatches)(m, b))(model, TINY_BATCH)


def count(collectives, kind: str) -> int:
    return sum(k == kind for k, _ in collectives)


def test_reshard_after_forward_setter_removes_backward_gathers():
    model = tiny()
    gathers = count(lowered(model), "all-gather")
    model.set_reshard_after_forward(False)
    assert all(m.policy.reshard_after_forward is False for m in [model, *model.blocks])
    assert count(lowered(model), "all-gather") < gathers  # backward reuses the forward gathers
    model.blocks[0].set_reshard_after_forward(True, recurse=False)
    assert model.blocks[0].policy.reshard_after_forward is True and model.policy.reshard_after_forward is False
    with pytest.raises(ValueError, match=r"`reshard_after_forward=3` must divide the shard size"):
        model.set_reshard_after_forward(3)


def test_custom_collective_hooks():
    model = tiny()
    seen = []
    model.blocks[0].set_custom_all_gather(js.int8_all_gather)
    model.blocks[1].set_custom_reduce_scatter(
        lambda g, axes, dim: seen.append("rs") or js.collectives.reduce_scatter(g, axes, dim)
    )
    model.set_all_reduce_hook(lambda g, axes: seen.append(("ar", axes)) or g)
    collectives = lowered(model)
    assert ("all-gather", "int8") in collectives
    assert "rs" in seen and ("ar", ()) in seen
    with pytest.raises(ValueError, match="`stream` is not applicable"):
        model.set_all_reduce_hook(lambda g, axes: g, stream=object())


def test_gradient_divide_factor():
    model = tiny()
    _, before = grads(model)
    model.blocks[2].set_gradient_divide_factor(2 * len(jax.devices()))
    model.set_force_sum_reduction_for_comms(True)
    _, after = grads(model)
    kernel = lambda g, i: g["blocks"][i]["kernel"][...]  # noqa: E731
    np.testing.assert_allclose(kernel(after, 2), kernel(before, 2) / 2, rtol=1e-6)
    np.testing.assert_allclose(after["head"]["kernel"][...], before["head"]["kernel"][...], rtol=1e-6)


def test_gradient_sync_and_reshard_after_backward_select_gather_once():
    model = tiny()
    loss, ref = grads(model, microbatches=2)
    per_microbatch = count(lowered(model, microbatches=2), "all-gather")
    model.set_requires_gradient_sync(False)
    once = lowered(model, microbatches=2)
    loss2, synced_once = grads(model, microbatches=2)
    np.testing.assert_allclose(loss2, loss, rtol=1e-6)
    assert max_diff(ref, synced_once) < 1e-6
    model.set_requires_gradient_sync(True)
    model.set_reshard_after_backward(False)
    assert lowered(model, microbatches=2) == once and count(once, "all-gather") < per_microbatch
    model.blocks[0].set_reshard_after_backward(True, recurse=False)
    with pytest.raises(ValueError, match=r"`blocks\[0\]` \(Rec\) has reshard_after_backward=True but the root has"):
        lowered(model)


def test_requires_all_reduce_on_hsdp():
    mesh = js.make_mesh(replicate=2)
    model = Tiny(nnx.Rngs(0))
    for block in model.blocks:
        jnnx.fully_shard(block, mesh)
    jnnx.fully_shard(model, mesh)
    _, ref = grads(model, microbatches=2)
    model.set_requires_all_reduce(False)
    assert count(lowered(model, microbatches=2), "all-reduce") > 0
    _, once = grads(model, microbatches=2)
    assert max_diff(ref, once) < 1e-6


def test_forward_prefetch_gathers_before_the_previous_block_runs():
    policy = js.FullyShardPolicy(custom_all_gather=record_gather)
    model = tiny(policy)
    lowered(model)
    plain = forward_events()
    model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1]])
    model.blocks[1].set_modules_to_backward_prefetch([model.blocks[0]])
    assert unit_uids(model.blocks[1]) == (model.blocks[0]._jshard.uid,)
    lowered(model)
    prefetched = forward_events()
    g0, g1, g2 = ("gather", (1, 16)), ("gather", (2, 24)), ("gather", (3, 8))
    assert plain == [g0, ("call", 8), g1, ("call", 16), g2, ("call", 24)]
    assert prefetched == [g0, g1, ("call", 8), ("call", 16), g2, ("call", 24)]
    with pytest.raises(ValueError, match=r"modules\[0\] \(Linear\) is not fully sharded"):
        model.blocks[0].set_modules_to_forward_prefetch([nnx.Linear(2, 2, rngs=nnx.Rngs(0))])


def unit_uids(module):
    return module._jshard.backward_prefetch


class Reuse(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.block = Rec(8, 8, rngs=rngs)
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.block(jnp.tanh(self.block(x))))


def test_unshard_in_step_gathers_once_until_reshard():
    reference = nnx.value_and_grad(tiny_loss)(Reuse(nnx.Rngs(0)), TINY_BATCH)
    model = Reuse(nnx.Rngs(0))
    jnnx.fully_shard(model.block, policy=js.FullyShardPolicy(custom_all_gather=record_gather))
    jnnx.fully_shard(model)

    def explicit(model, batch):
        handle = model.block.unshard(async_op=True)
        handle.wait()
        out = tiny_loss(model, batch)
        model.block.reshard()
        return out

    graphdef, state = nnx.split(model)
    for fn, gathers in [(tiny_loss, 2), (explicit, 1)]:
        EVENTS.clear()
        step = jax.jit(lambda s, b, fn=fn: jnnx.value_and_grad(fn)(nnx.merge(graphdef, s), b))
        loss, g = step(state, TINY_BATCH)
        assert sum(e[0] == "gather" for e in forward_events()) == gathers
        np.testing.assert_allclose(loss, reference[0], rtol=1e-6)
        ref_kernel = reference[1]["block"]["kernel"][...]
        np.testing.assert_allclose(g["block"]["kernel"][...], ref_kernel, rtol=1e-5, atol=1e-7)


class Tied(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(11, 8, rngs=rngs)
        self.mix = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, tokens):
        return self.embed.attend(jnp.tanh(self.mix(self.embed(tokens))))


def test_register_fsdp_forward_method_gathers_for_attend():
    model = Tied(nnx.Rngs(0))
    tokens = {"x": jnp.arange(16).reshape(8, 2) % 11}
    loss = lambda m, b: jnp.mean(m(b["x"]) ** 2)  # noqa: E731
    ref_loss, ref_grads = nnx.value_and_grad(loss)(nnx.clone(model), tokens)
    jnnx.fully_shard(model.embed)
    jnnx.fully_shard(model)
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, b: jnnx.value_and_grad(loss)(nnx.merge(graphdef, s), b))
    with pytest.raises(RuntimeError, match=r"Param `embed.embedding` of a fully sharded module was read inside"):
        step(state, tokens)  # attend is not a registered forward method
    jnnx.register_fsdp_forward_method(model.embed, "attend")
    graphdef, state = nnx.split(model)
    value, g = jax.jit(lambda s, b: jnnx.value_and_grad(loss)(nnx.merge(graphdef, s), b))(state, tokens)
    np.testing.assert_allclose(value, ref_loss, rtol=1e-6)
    ref_embedding = ref_grads["embed"]["embedding"][...]
    np.testing.assert_allclose(np.asarray(g["embed"]["embedding"][...])[:11], ref_embedding, atol=1e-6)
    with pytest.raises(RuntimeError, match=r"`embed` \(Embed\) is fully sharded and was called outside the step"):
        model.embed.attend(jnp.ones((1, 8)))
    with pytest.raises(ValueError, match=r"`embed` \(Embed\) has no method `generate`"):
        jnnx.register_fsdp_forward_method(model.embed, "generate")


class Noisy(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(8, 2, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.lin(self.drop(x))


def test_non_param_state_updates_come_back():
    model = jnnx.fully_shard(Noisy(nnx.Rngs(0)))
    count0 = int(model.drop.rngs.count[...])
    step = nnx.jit(lambda m, b: jnnx.value_and_grad(tiny_loss)(m, b)[0])
    first, second = step(model, TINY_BATCH), step(model, TINY_BATCH)
    assert int(model.drop.rngs.count[...]) == count0 + 2
    assert float(first) != float(second)  # new dropout masks each step


def test_unshard_for_evaluation_matches_the_unsharded_model():
    model = tiny()
    reference = Tiny(nnx.Rngs(0))
    with pytest.raises(RuntimeError, match=r"the root module \(Tiny\) is fully sharded and was called outside"):
        model(TINY_BATCH["x"])
    np.testing.assert_allclose(jnnx.unshard(model)(TINY_BATCH["x"]), reference(TINY_BATCH["x"]), rtol=1e-6)
    with pytest.raises(RuntimeError, match=r"`blocks\[0\]` \(Rec\) holds gathered parameters"):
        lowered(model)
    jnnx.reshard(model)
    assert model.blocks[0].kernel.get_value().shape == (8, 16) and model.head.bias.get_value().shape == (8,)


# ----------------------------------------------------------------------------------------
# Misuse: errors name the module path and say what to do.


def test_error_child_sharded_after_its_root():
    model = Tiny(nnx.Rngs(0))
    jnnx.fully_shard(model)
    match = r"Module `blocks\[1\]` \(Rec\) already belongs to the unit of the root module \(Tiny\).*bottom-up"
    with pytest.raises(RuntimeError, match=match):
        jnnx.fully_shard(model.blocks[1])
    with pytest.raises(RuntimeError, match=r"the root module \(Tiny\) is already fully sharded"):
        jnnx.fully_shard(model)


class Pair(nnx.Module):
    def __init__(self, left, right):
        self.left = left
        self.right = right


def test_error_module_shared_by_two_parents():
    shared = jnnx.fully_shard(nnx.Linear(8, 8, rngs=nnx.Rngs(0)))
    shared_by_two = r"Module `{}` of module Pair is shared by two parents \(it is also {}\)"
    with pytest.raises(ValueError, match=shared_by_two.format("right", "at `left`")):
        jnnx.fully_shard(Pair(shared, shared))
    first, second = Pair(shared, nnx.Linear(8, 8, rngs=nnx.Rngs(1))), Pair(nnx.Linear(8, 8, rngs=nnx.Rngs(2)), shared)
    jnnx.fully_shard(first)
    earlier = r"`left` of another root module \(Pair\), sharded earlier"  # not this root: the other parent
    with pytest.raises(ValueError, match=shared_by_two.format("right", earlier)):
        jnnx.fully_shard(second)
    plain = nnx.Linear(8, 8, rngs=nnx.Rngs(3))
    jnnx.fully_shard(Pair(plain, nnx.Linear(8, 8, rngs=nnx.Rngs(4))))
    owned = r"`left` in the unit of the root module \(Pair\)"
    with pytest.raises(ValueError, match=shared_by_two.format("left", owned)):
        jnnx.fully_shard(Pair(plain, nnx.Linear(8, 8, rngs=nnx.Rngs(5))))


def test_error_step_misuse():
    with pytest.raises(ValueError, match=r"The step got Tiny, which is not fully sharded.*then on the root"):
        jnnx.value_and_grad(tiny_loss)(Tiny(nnx.Rngs(0)), TINY_BATCH)
    model = tiny()
    model.extra = nnx.Param(jnp.ones((3,)))
    with pytest.raises(ValueError, match=r"Param `extra` of the root module \(Tiny\) belongs to no unit"):
        lowered(model)
    with pytest.raises(TypeError, match="takes an nnx.Module"):
        jnnx.fully_shard({"w": jnp.ones(3)})
    with pytest.raises(ValueError, match=r"register_fsdp_forward_method got Linear, which is not fully sharded"):
        jnnx.register_fsdp_forward_method(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "__call__")


class Normed(nnx.Module):
    def __init__(self, axis_name, rngs: nnx.Rngs):
        self.lin = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, axis_name=axis_name, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.lin(x))


def test_batch_norm_statistics_are_per_device_unless_named_over_the_mesh_axis():
    """docs/flax.md: inside the step each device normalises with its own batch's statistics;
    ``axis_name="fsdp"`` (the data-parallel axes) gives the global batch's, as unsharded training."""
    x = jax.random.normal(jax.random.key(0), (16, 4)) * jnp.arange(1.0, 17.0)[:, None]
    loss = lambda m, x: jnp.mean(m(x) ** 2)  # noqa: E731
    reference = Normed(None, nnx.Rngs(0))
    ref_loss, _ = nnx.value_and_grad(loss)(reference, x)
    per_device, _ = jnnx.value_and_grad(loss)(jnnx.fully_shard(Normed(None, nnx.Rngs(0))), x)
    model = jnnx.fully_shard(Normed("fsdp", nnx.Rngs(0)))
    global_batch, _ = jnnx.value_and_grad(loss)(model, x)
    assert abs(float(per_device) - float(ref_loss)) > 1e-5
    np.testing.assert_allclose(global_batch, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(model.bn.mean[...], reference.bn.mean[...], atol=1e-6)  # running stats too
