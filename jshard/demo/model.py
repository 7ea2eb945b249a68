"""A small decoder-only transformer language model in Flax linen, with stacked blocks.

Shared by the demo (``jshard/demo.py``), the memory planner (``jshard/report.py``) and
the benchmarks: its blocks are stacked along axis 0 (one slice per layer), so a loss
runs them with ``jax.lax.scan`` or :func:`jshard.scan`, whichever ``run_blocks`` says.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Sizes of the model: vocabulary, width, heads, depth, MLP width, context length."""

    vocab: int = 128
    d_model: int = 128
    heads: int = 4
    layers: int = 4
    d_ff: int = 512
    seq_len: int = 128


SIZES = {
    "tiny": TransformerConfig(vocab=128, d_model=64, heads=2, layers=2, d_ff=256, seq_len=64),
    "small": TransformerConfig(vocab=128, d_model=128, heads=4, layers=4, d_ff=512, seq_len=128),
    "medium": TransformerConfig(vocab=128, d_model=256, heads=8, layers=6, d_ff=1024, seq_len=128),
    "1b": TransformerConfig(vocab=32768, d_model=2048, heads=16, layers=18, d_ff=8192, seq_len=1024),
}


class LayerNorm(nn.Module):
    """Layer norm computed in float32 whatever the input dtype, returned in the input dtype.

    (Flax's ``nn.LayerNorm`` promotes bf16 to float32 implicitly, which strict dtype
    promotion refuses.)
    """

    eps: float = 1e-6

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        bias = self.param("bias", nn.initializers.zeros, (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


class Block(nn.Module):
    """Pre-norm block: causal self-attention, then a GELU MLP, each with a residual."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        batch, seq, _ = x.shape
        h = LayerNorm(name="ln1")(x)
        qkv = nn.Dense(3 * c.d_model, use_bias=False, name="qkv")(h)
        q, k, v = jnp.split(qkv.reshape(batch, seq, 3 * c.heads, c.d_model // c.heads), 3, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))
        mask = jnp.tril(jnp.ones((seq, seq), bool))
        scores = jnp.where(mask, scores, jnp.asarray(-1e9, scores.dtype))
        attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        x = x + nn.Dense(c.d_model, use_bias=False, name="proj")(attn.reshape(batch, seq, c.d_model))
        h = LayerNorm(name="ln2")(x)
        h = nn.Dense(c.d_ff, name="up")(h)
        return x + nn.Dense(c.d_model, name="down")(jax.nn.gelu(h))


class Embed(nn.Module):
    """Token and learned position embeddings."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        pos = self.param("pos", nn.initializers.normal(0.02), (c.seq_len, c.d_model))
        return nn.Embed(c.vocab, c.d_model, name="tokens")(tokens) + pos[: tokens.shape[1]]


class Head(nn.Module):
    """Final norm and the projection to vocabulary logits."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(self.config.vocab, use_bias=False, name="out")(LayerNorm(name="ln")(x))


def init_params(config: TransformerConfig, key: jax.Array) -> dict[str, Any]:
    """``{"embed", "blocks", "head"}``; every leaf of ``blocks`` is stacked along axis 0."""
    k_embed, k_blocks, k_head = jax.random.split(key, 3)
    tokens = jnp.zeros((1, config.seq_len), jnp.int32)
    x = jnp.zeros((1, config.seq_len, config.d_model))
    block_keys = jax.random.split(k_blocks, config.layers)
    return {
        "embed": Embed(config).init(k_embed, tokens)["params"],
        "blocks": jax.vmap(lambda k: Block(config).init(k, x)["params"])(block_keys),
        "head": Head(config).init(k_head, x)["params"],
    }


def abstract_params(config: TransformerConfig) -> dict[str, Any]:
    """The parameters' shapes and dtypes (``jax.ShapeDtypeStruct``), nothing allocated."""
    return jax.eval_shape(functools.partial(init_params, config), jax.random.key(0))


def count_params(params: Any) -> int:
    """Number of elements over all leaves."""
    return sum(x.size for x in jax.tree.leaves(params))


RunBlocks = Callable[[Callable[[Any, Any], tuple[Any, Any]], Any, Any], tuple[Any, Any]]


def lax_scan_blocks(body: Callable[[Any, Any], tuple[Any, Any]], h: Any, blocks: Any) -> tuple[Any, Any]:
    """Run stacked blocks with ``jax.lax.scan`` (the plain-JAX way, for reference steps)."""
    return jax.lax.scan(body, h, blocks)


def recompute_in_backward(fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """``fn(h, layer)`` keeping only its inputs for backward, which recomputes it.

    What ``jax.checkpoint`` does, but as a ``custom_vjp`` so that an enclosing remat
    policy cannot override it. [Note: nested remat] ``js.scan`` (and the step) wrap the
    body in ``jax.checkpoint(policy=...)`` that saves everything but gathered
    parameters, and in JAX the outer policy decides for every equation of a nested
    ``jax.checkpoint`` too: a block under ``jax.checkpoint`` inside ``js.scan`` still
    saves all its activations (attention scores included). The inputs this keeps are the
    carry and the gathered layer, which jshard's policy re-gathers instead of saving.
    """

    @jax.custom_vjp
    def wrapped(h, layer):
        return fn(h, layer)

    def fwd(h, layer):
        return fn(h, layer), (h, layer)

    def bwd(residuals, ct):
        return jax.vjp(fn, *residuals)[1](ct)

    wrapped.defvjp(fwd, bwd)
    return wrapped


def logits_fn(params: Any, tokens: jax.Array, config: TransformerConfig, run_blocks: RunBlocks,
              remat: str = "checkpoint") -> jax.Array:
    """Next-token logits; ``run_blocks(body, h, params["blocks"])`` runs the stack.

    Each block is rematerialised: backward recomputes it from its input, with
    ``jax.checkpoint`` (``remat="checkpoint"``, the plain-JAX way) or with
    :func:`recompute_in_backward` (``"custom_vjp"``, which ``js.scan`` needs); ``"none"``
    leaves it to the step's remat policy.
    """
    block = Block(config)

    def apply(h, layer):
        return block.apply({"params": layer}, h)

    if remat != "none":
        apply = jax.checkpoint(apply) if remat == "checkpoint" else recompute_in_backward(apply)

    def body(h, layer):
        return apply(h, layer), None

    h = Embed(config).apply({"params": params["embed"]}, tokens)
    h = h.astype(jax.tree.leaves(params["head"])[0].dtype)
    h, _ = run_blocks(body, h, params["blocks"])
    return Head(config).apply({"params": params["head"]}, h)


def lm_loss(params: Any, tokens: jax.Array, config: TransformerConfig, run_blocks: RunBlocks,
            remat: str = "checkpoint") -> jax.Array:
    """Mean next-character cross-entropy of ``tokens`` (``[batch, seq_len + 1]``), in float32."""
    logits = logits_fn(params, tokens[:, :-1], config, run_blocks, remat).astype(jnp.float32)
    targets = tokens[:, 1:]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


# Megatron's split of a block over the "tp" axis: column-parallel qkv and up (heads and MLP
# width split), row-parallel proj and down. Leaves are stacked along axis 0 (the layers).
BLOCK_TP_SPECS = {
    "qkv": {"kernel": PartitionSpec(None, None, "tp")},
    "proj": {"kernel": PartitionSpec(None, "tp", None)},
    "up": {"kernel": PartitionSpec(None, None, "tp"), "bias": PartitionSpec(None, "tp")},
    "down": {"kernel": PartitionSpec(None, "tp", None)},
}


def place_tensor_parallel(params: Any, mesh: Any) -> Any:
    """``params`` placed on ``mesh`` with the blocks split over its ``"tp"`` axis (Megatron-style),
    the rest replicated; ``fully_shard`` then adds the FSDP split (docs/parallelism.md)."""
    replicated = PartitionSpec()

    def place(path, x):
        keys = [k.key for k in path]
        spec = replicated
        if keys[0] == "blocks" and keys[1] in BLOCK_TP_SPECS:
            spec = BLOCK_TP_SPECS[keys[1]].get(keys[2], replicated)
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(place, params)


def shard_lm(params: Any, mesh: Any, mp_policy: Any = None, offload_policy: Any = None,
             custom_all_gather: Any = None, unit_collectives: bool = False,
             reshard_after_forward: bool = True, replicate_below: int | None = None,
             weight_gradients: str | None = None) -> Any:
    """The model as jshard units: the stacked blocks (``scan_axis=0``) inside a root unit;
    ``replicate_below``: leaves under that many elements (per layer) kept whole;
    ``weight_gradients``: ``FullyShardPolicy``'s."""
    import jshard as js

    kwargs = {
        "mp_policy": mp_policy or js.MixedPrecisionPolicy(),
        "offload_policy": offload_policy or js.OffloadPolicy(),
        "custom_all_gather": custom_all_gather,
        "unit_collectives": unit_collectives,
        "replicate_below": replicate_below,
        "weight_gradients": weight_gradients,
    }
    blocks = js.fully_shard(params["blocks"], mesh, js.FullyShardPolicy(
        scan_axis=0, reshard_after_forward=reshard_after_forward, **kwargs))
    return js.fully_shard({**params, "blocks": blocks}, mesh, js.FullyShardPolicy(**kwargs))


def plain_train_step(config: TransformerConfig, optimizer: Any,
                     run_blocks: RunBlocks = lax_scan_blocks) -> Callable[..., Any]:
    """The same step without jshard: ``jax.value_and_grad`` of the loss over ``lax.scan``.

    Its parallelism is whatever the arguments' shardings make ``jit`` do (replicated
    parameters: data parallel; parameters sharded by hand: the GSPMD FSDP recipe).
    """
    import optax

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(lm_loss)(params, tokens, config, run_blocks)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def init_opt_state(optimizer: Any, params: Any, mesh: Any) -> Any:
    """``optimizer.init(params)``, leaves that follow no parameter (step counts) replicated on ``mesh``.

    Run eagerly, so the state keeps each parameter's sharding and memory kind (offloaded
    state stays in host memory); a count made on one device would be refused by a step
    over the whole mesh. Abstract ``params`` (``jax.ShapeDtypeStruct`` with shardings) give
    the abstract state, placed the same way (``jshard.report.abstract_result``).
    """
    from jshard.report import abstract_result

    replicated = NamedSharding(mesh, PartitionSpec())
    if all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
        state = abstract_result(optimizer.init, params)

        def place(x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)
    else:
        with jax.set_mesh(mesh):
            state = optimizer.init(params)

        def place(x):
            return jax.device_put(x, replicated)
    return jax.tree.map(lambda x: x if isinstance(x.sharding, NamedSharding) else place(x), state)


def jshard_train_step(config: TransformerConfig, optimizer: Any, remat: str = "custom_vjp",
                      remat_policy: Any = None) -> Callable[..., Any]:
    """``step(params, opt_state, tokens) -> (params, opt_state, loss)`` for :func:`shard_lm` params.

    The root unit is gathered once; the blocks one layer at a time by :func:`jshard.scan`.
    Each block is recomputed in backward (``remat="custom_vjp"``), or with ``"none"`` what
    backward recomputes is ``remat_policy``'s choice (``js.value_and_grad``'s).
    """
    import optax

    import jshard as js

    def loss_fn(params, tokens):
        return lm_loss(js.unshard(params), tokens, config, js.scan, remat=remat)

    grad_fn = js.value_and_grad(loss_fn, unshard_params=False, remat_policy=remat_policy)

    def step(params, opt_state, tokens):
        loss, grads = grad_fn(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step
