"""Llama-3-8B-shaped plan builders: an NNX model of our own and Hugging Face's ``FlaxLlamaForCausalLM``.

``python -m jshard.report plan jshard.demo.llama3:build_nnx --devices 256`` (and
``build_hf``) plans training either on 256 devices, compile only: 32 layers, hidden
4096, FFN 14336, vocabulary 128256, 32 query heads and 8 KV heads (about 8.03e9
parameters), context 2048 tokens per sequence, AdamW. The NNX model stacks its layers
(``nnx.vmap``) and runs them with ``nnx.scan``, one unit for the stack; Hugging Face's
model runs its code unchanged with one unit per decoder layer (``jlinen.ModuleUnits``).
``TINY`` is a small shape of the same model for tests.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding

import jshard as js
from jshard.demo.plan import DEFAULT, data_devices, data_spec, standard_promotion
from jshard.report import PlanConfig, StackModel, abstract_result


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """A Llama-3 shape (defaults: 8B)."""

    vocab: int = 128256
    dim: int = 4096
    ffn: int = 14336
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    seq_len: int = 2048
    rope_theta: float = 500000.0
    dtype: str = "float32"  # the compute dtype (bf16 under a MixedPrecisionPolicy)


def _rope(x: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding over the last dim of ``[batch, seq, heads, head_dim]``."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freqs[None]
    cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def _causal_gqa(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal grouped-query attention: each KV head serves ``heads // kv_heads`` query heads;
    scores and softmax in float32, products in the inputs' dtype."""
    b, s, heads, head = q.shape
    groups = heads // k.shape[2]
    q = q.reshape(b, s, k.shape[2], groups, head)
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k).astype(jnp.float32) / jnp.sqrt(jnp.float32(head))
    causal = jnp.tril(jnp.ones((s, s), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(b, s, heads, head)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        head = cfg.dim // cfg.heads
        self.cfg = cfg
        linear = functools.partial(nnx.Linear, use_bias=False, dtype=cfg.dtype, rngs=rngs)
        self.q = linear(cfg.dim, cfg.heads * head)
        self.k = linear(cfg.dim, cfg.kv_heads * head)
        self.v = linear(cfg.dim, cfg.kv_heads * head)
        self.o = linear(cfg.heads * head, cfg.dim)

    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, (b, s, _) = self.cfg, x.shape
        head = cfg.dim // cfg.heads
        q = _rope(self.q(x).reshape(b, s, cfg.heads, head), cfg.rope_theta)
        k = _rope(self.k(x).reshape(b, s, cfg.kv_heads, head), cfg.rope_theta)
        v = self.v(x).reshape(b, s, cfg.kv_heads, head)
        return self.o(_causal_gqa(q, k, v).reshape(b, s, cfg.heads * head))


class Block(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        linear = functools.partial(nnx.Linear, use_bias=False, dtype=cfg.dtype, rngs=rngs)
        self.attn_norm = nnx.RMSNorm(cfg.dim, dtype=cfg.dtype, rngs=rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.dim, dtype=cfg.dtype, rngs=rngs)
        self.gate = linear(cfg.dim, cfg.ffn)
        self.up = linear(cfg.dim, cfg.ffn)
        self.down = linear(cfg.ffn, cfg.dim)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Llama(nnx.Module):
    """Llama 3 in NNX: embedding, stacked decoder blocks under ``nnx.scan``, norm, untied head."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.dim, dtype=cfg.dtype, rngs=rngs)

        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return Block(cfg, rngs)

        self.blocks = create(rngs)
        self.norm = nnx.RMSNorm(cfg.dim, dtype=cfg.dtype, rngs=rngs)
        self.head = nnx.Linear(cfg.dim, cfg.vocab, use_bias=False, dtype=cfg.dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return block(x)

        return self.head(self.norm(run(self.embed(tokens), self.blocks)))


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Mean cross-entropy of ``logits`` (one row per position) against the next tokens, ``tokens[:, 1:]``.

    The labels are one-hot rows, not integer indices ([Note: one-hot cross-entropy]).

    Example:
      >>> import jax.numpy as jnp
      >>> round(float(next_token_loss(jnp.zeros((1, 2, 4)), jnp.zeros((1, 3), jnp.int32))), 4)  # uniform: log 4
      1.3863
    """
    # [Note: one-hot cross-entropy] With integer labels the loss picks each position's label
    # logit with a gather, whose gradient is a scatter into a zero logits-sized buffer. XLA:TPU
    # offloads that scatter to the SparseCore, which wants the float32 logit gradient in another
    # layout: a second logits-sized float32 buffer at the step's fullest point (libtpu 0.0.42).
    # Against one-hot labels the gradient is softmax minus the labels, elementwise and fused.
    # Written as logsumexp minus the label logit (MaxText's loss is one-hot too), no
    # log-probabilities are formed: optax's ``softmax_cross_entropy`` with one-hot labels keeps
    # them, a float32 logits-sized buffer more on XLA:CPU. The Llama-3-8B NNX plan (bf16, every
    # layer recomputed), peak per device: v5p-256 7.38 -> 4.95 GiB (optax one-hot 4.92), 256 CPU
    # devices 8.45 -> 8.45 (optax one-hot 8.91); FLOPs and collectives unchanged.
    logits = logits.astype(jnp.float32)
    labels = jax.nn.one_hot(tokens[:, 1:], logits.shape[-1], dtype=logits.dtype)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - jnp.sum(logits * labels, axis=-1))


def _tokens(mesh: Any, config: PlanConfig, cfg: LlamaConfig) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((config.batch_per_device * data_devices(mesh), cfg.seq_len + 1), jnp.int32,
                                sharding=NamedSharding(mesh, data_spec(mesh)))


def _policies(config: PlanConfig, reduce_dtype: Any = jnp.float32) -> dict[str, Any]:
    mp = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=reduce_dtype) if config.mixed_precision \
        else js.MixedPrecisionPolicy()
    return {"mp_policy": mp, "offload_policy": js.CPUOffloadPolicy() if config.offload else js.OffloadPolicy(),
            "replicate_below": config.replicate_below, "weight_gradients": config.weight_gradients}


def build_nnx_model(mesh: Any, config: PlanConfig, cfg: LlamaConfig,
                    reduce_dtype: Any = jnp.float32) -> tuple[Any, tuple]:
    """The NNX Llama of shape ``cfg``: the training step and its abstract arguments
    (``reduce_dtype``: the gradients' reduction dtype under ``config.mixed_precision``)."""
    from jshard.flax import nnx as jnnx

    cfg = dataclasses.replace(cfg, dtype="bfloat16" if config.mixed_precision else "float32")
    model = nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(0)))  # abstract: nothing allocated
    jnnx.fully_shard(model.blocks, mesh, js.FullyShardPolicy(
        scan_axis=0, reshard_after_forward=config.reshard_after_forward, **_policies(config, reduce_dtype)))
    jnnx.fully_shard(model, mesh, js.FullyShardPolicy(**_policies(config, reduce_dtype)))
    tx = jnnx.shard_optimizer(model, optax.adamw(1e-4))
    optimizer = nnx.eval_shape(lambda m: nnx.Optimizer(m, tx, wrt=nnx.Param), model)
    graphdef, state = nnx.split((model, optimizer))
    grad_fn = jnnx.value_and_grad(lambda m, t: next_token_loss(m(t[:, :-1]), t),
                                  remat_policy=config.remat_policy())

    def step(state, tokens):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = grad_fn(model, tokens)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    jitted = jax.jit(standard_promotion(step), donate_argnums=(0,))
    return jitted, (state, _tokens(mesh, config, cfg)), jnnx.units(model)


def build_hf_model(mesh: Any, config: PlanConfig, cfg: LlamaConfig) -> tuple[Any, tuple]:
    """Hugging Face's ``FlaxLlamaForCausalLM`` of shape ``cfg``, its code unchanged."""
    import transformers
    from transformers.models.llama.modeling_flax_llama import FlaxLlamaDecoderLayer

    from jshard.flax import linen as jlinen

    hf = transformers.LlamaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.dim, intermediate_size=cfg.ffn, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.seq_len,
        rope_theta=cfg.rope_theta)
    compute = jnp.bfloat16 if config.mixed_precision else jnp.float32
    with jax.numpy_dtype_promotion("standard"):  # Hugging Face's code mixes dtypes implicitly
        model = transformers.FlaxLlamaForCausalLM(hf, _do_init=False, dtype=compute)
        weights = jax.eval_shape(lambda: model.init_weights(jax.random.key(0), (1, 8)))
        policy = js.FullyShardPolicy(reshard_after_forward=config.reshard_after_forward, **_policies(config))
        units = jlinen.ModuleUnits(FlaxLlamaDecoderLayer, mesh=mesh, policy=policy,
                                   root_policy=js.FullyShardPolicy(**_policies(config)))
        params = jlinen.shard_params(lambda p, ids: model(ids, params=p), weights, jnp.zeros((1, 8), jnp.int32),
                                     units=units)
        optimizer = js.shard_optimizer(optax.adamw(1e-4))
        opt_state = abstract_result(optimizer.init, params)
    grad_fn = jlinen.value_and_grad(lambda p, t: next_token_loss(model(t[:, :-1], params=p).logits, t), units=units,
                                    remat_policy=config.remat_policy())

    def step(params, opt_state, tokens):
        loss, grads = grad_fn(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(standard_promotion(step), donate_argnums=(0, 1)), (params, opt_state, _tokens(mesh, config, cfg))


def build_nnx(mesh: Any, config: PlanConfig = DEFAULT) -> tuple[Any, tuple]:
    """Llama-3-8B as an NNX model of our own."""
    return build_nnx_model(mesh, config, LlamaConfig())


def build_hf(mesh: Any, config: PlanConfig = DEFAULT) -> tuple[Any, tuple]:
    """Llama-3-8B as Hugging Face's ``FlaxLlamaForCausalLM``."""
    return build_hf_model(mesh, config, LlamaConfig())


def build_init_model(mesh: Any, cfg: LlamaConfig) -> tuple[Any, tuple]:
    """The init program of the NNX Llama of shape ``cfg``, born sharded: ``(init, ())`` for ``plan --init``."""
    from jshard.flax import nnx as jnnx

    def init():
        model = Llama(cfg, nnx.Rngs(0))
        jnnx.fully_shard(model.blocks, mesh, js.FullyShardPolicy(scan_axis=0))
        return nnx.state(jnnx.fully_shard(model, mesh))

    return init, ()


LLAMA_3_70B = LlamaConfig(dim=8192, ffn=28672, layers=80, heads=64, kv_heads=8)


def build_init_70b(mesh: Any) -> tuple[Any, tuple]:
    """Llama-3-70B's init program (fp32 parameters, 263 GiB), born sharded over ``mesh``."""
    return build_init_model(mesh, LLAMA_3_70B)


TINY = LlamaConfig(vocab=512, dim=64, ffn=160, layers=2, heads=4, kv_heads=2, seq_len=32)  # for tests


def build_nnx_tiny(mesh: Any, config: PlanConfig = DEFAULT) -> tuple[Any, tuple]:
    """The NNX Llama at a test size (``TINY``: 2 layers, hidden 64, vocabulary 512)."""
    return build_nnx_model(mesh, config, TINY)


def build_hf_tiny(mesh: Any, config: PlanConfig = DEFAULT) -> tuple[Any, tuple]:
    """Hugging Face's Llama at the same test size."""
    return build_hf_model(mesh, config, TINY)


def build_init_tiny(mesh: Any) -> tuple[Any, tuple]:
    """The init program of the NNX Llama at the test size."""
    return build_init_model(mesh, TINY)


def stack_model(cfg: LlamaConfig) -> StackModel:
    """``cfg``'s shape for the pipeline-stage plan (``python -m jshard.report stages``, [Note: stage plan]).

    Attention's FLOPs are causal (``2 seq dim`` a token a layer); a layer's recompute holds its
    bf16 projections, ``(6 dim + 2 kv_dim + 3 ffn)`` values a token (attention scores not stored).
    """
    kv_dim = cfg.kv_heads * cfg.dim // cfg.heads
    matmul = 2 * cfg.dim * cfg.dim + 2 * cfg.dim * kv_dim + 3 * cfg.dim * cfg.ffn
    return StackModel(f"Llama-3 dim {cfg.dim} x {cfg.layers} layers", cfg.layers, matmul + 2 * cfg.dim,
                      2 * cfg.vocab * cfg.dim + cfg.dim, cfg.dim, cfg.seq_len,
                      2.0 * matmul + 2.0 * cfg.seq_len * cfg.dim, 2.0 * cfg.vocab * cfg.dim,
                      2.0 * (6 * cfg.dim + 2 * kv_dim + 3 * cfg.ffn))


def stack_70b() -> StackModel:
    """Llama-3-70B for the pipeline-stage plan (70.55e9 parameters, 80 layers).

    Example:
      >>> from jshard.demo.llama3 import stack_70b
      >>> m = stack_70b()
      >>> round((m.layers * m.layer_params + m.other_params) / 1e9, 2)
      70.55
    """
    return stack_model(LLAMA_3_70B)
