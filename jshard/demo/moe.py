"""A Mixtral-style mixture-of-experts language model in Flax NNX, trained with jshard.

Each block is causal self-attention then a sparse MoE layer: a router picks the top 2 of
``E`` experts per token (Mixtral's softmax-then-top-k, gates renormalized over the chosen
two), and every expert is a SwiGLU MLP whose weights are stacked ``(E, d, f)``. Embedding,
attention, norms, router and output are dense.

Tokens are dispatched with a fixed capacity per expert and per *sequence*:
``C = ceil(capacity_factor * seq_len * top_k / E)`` slots, filled first-choice-first, then
in token order. A token routed to an expert whose ``C`` slots are taken is dropped by that
expert: it gets nothing from it (its other expert, if kept, and the residual still reach
it), and the router gets no gradient through that gate. Because capacity and the router's
load-balancing loss (Switch / Mixtral: ``E * sum_e f_e * p_e``, ``f_e`` the share of the
sequence's top-k choices that picked ``e``, ``p_e`` its mean router probability) are
computed per sequence and averaged over sequences, the model computes the same function
however the batch is split over devices, which is what lets the sharded run match the
unsharded one to float rounding.

With ``MoEConfig.expert_axis`` set, the MoE layer runs inside ``js.value_and_grad`` on a
mesh with that axis: each device holds ``E / M`` experts and sends each expert's slots to
its device with ``jax.lax.all_to_all`` (and back). Without it, all experts are local and
the same code runs on one device: the unsharded reference.

Example:
  >>> import jax
  >>> from flax import nnx
  >>> from jshard.demo.moe import MoEConfig, Mixtral, lm_loss
  >>> model = Mixtral(MoEConfig(vocab=16, dim=8, heads=2, layers=1, experts=4, hidden=12), nnx.Rngs(0))
  >>> tokens = jax.numpy.zeros((2, 9), jax.numpy.int32)
  >>> float(lm_loss(model, tokens)) > 0
  True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Shape of the model; ``expert_axis`` names the mesh axis the experts are split over (None: all local).

    ``exchange`` says how slots reach their experts over ``expert_axis``: ``"all_to_all"``
    inside the step's ``shard_map`` (jshard's step, the default), or ``"gspmd"``: sharding
    constraints on the slots, for a program GSPMD partitions (``benchmarks/moe_dispatch.py``
    compares the two).

    Example:
      >>> MoEConfig(experts=8).capacity(seq_len=64)
      32
    """

    vocab: int = 64
    dim: int = 32
    heads: int = 4
    layers: int = 2
    experts: int = 4
    hidden: int = 48
    top_k: int = 2
    capacity_factor: float = 2.0
    aux_weight: float = 0.01
    expert_axis: str | None = None
    exchange: str = "all_to_all"

    def __post_init__(self) -> None:
        if self.exchange not in ("all_to_all", "gspmd"):
            raise ValueError(f"`exchange` must be 'all_to_all' or 'gspmd', got {self.exchange!r}.")
        if self.dim % self.heads:
            raise ValueError(f"`dim` {self.dim} is not a multiple of `heads` {self.heads}; pick heads dividing dim.")
        if not 0 < self.top_k <= self.experts:
            raise ValueError(f"`top_k` {self.top_k} must be in [1, experts={self.experts}].")
        if self.capacity_factor <= 0:
            raise ValueError(f"`capacity_factor` must be positive, got {self.capacity_factor}.")

    def capacity(self, seq_len: int) -> int:
        """Slots per expert per sequence."""
        return math.ceil(self.capacity_factor * seq_len * self.top_k / self.experts)


class Attention(nnx.Module):
    """Causal multi-head self-attention."""

    def __init__(self, cfg: MoEConfig, rngs: nnx.Rngs):
        self.heads = cfg.heads
        self.qkv = nnx.Linear(cfg.dim, 3 * cfg.dim, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(cfg.dim, cfg.dim, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(causal_attention(self.qkv(x), self.heads))


def causal_attention(qkv: jax.Array, heads: int) -> jax.Array:
    """Causal softmax attention of ``qkv`` ``(B, S, 3 * d)`` (queries, keys, values) over ``heads``; ``(B, S, d)``.

    Example:
      >>> causal_attention(jnp.ones((1, 3, 6)), heads=2).shape
      (1, 3, 2)
    """
    b, s, three_d = qkv.shape
    d = three_d // 3
    q, k, v = jnp.split(qkv.reshape(b, s, 3 * heads, d // heads), 3, axis=2)
    scores = jnp.einsum("bqhc,bkhc->bhqk", q, k) / math.sqrt(d // heads)
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, jnp.finfo(scores.dtype).min)
    return jnp.einsum("bhqk,bkhc->bqhc", jax.nn.softmax(scores, axis=-1), v).reshape(b, s, d)


class Experts(nnx.Module):
    """``E`` SwiGLU MLPs with stacked weights ``(E, d, f)`` / ``(E, f, d)``, run on their slots.

    Called with tokens ``(B, S, d)`` and ``dispatch`` ``(B, S, E, C)``, returns the slots'
    outputs ``(B, E, C, d)`` (:func:`expert_slots`). With ``expert_axis`` set, each device holds
    ``E / M`` experts and the slots travel over that axis. Slots are filled in the weights'
    dtype, so under mixed precision they travel in bf16.
    """

    def __init__(self, cfg: MoEConfig, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        e, d, f = cfg.experts, cfg.dim, cfg.hidden
        self.axis, self.exchange = cfg.expert_axis, cfg.exchange
        self.w_gate = nnx.Param(init(rngs.params(), (e, d, f)))
        self.w_up = nnx.Param(init(rngs.params(), (e, d, f)))
        self.w_down = nnx.Param(init(rngs.params(), (e, f, d)))

    def __call__(self, x: jax.Array, dispatch: jax.Array) -> jax.Array:
        w = self.w_gate[...], self.w_up[...], self.w_down[...]
        return expert_slots(x, dispatch, w[1].dtype, lambda t: swiglu_experts(t, *w), self.axis, self.exchange)


def swiglu_experts(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """``E`` SwiGLU MLPs at once: ``x`` ``(E, tokens, d)``, weights ``(E, d, f)``, ``(E, d, f)``, ``(E, f, d)``.

    Example:
      >>> w = jnp.ones((2, 3, 4))
      >>> swiglu_experts(jnp.ones((2, 5, 3)), w, w, w.transpose(0, 2, 1)).shape
      (2, 5, 3)
    """
    gate = jax.nn.silu(jnp.einsum("etd,edf->etf", x, w_gate))
    up = jnp.einsum("etd,edf->etf", x, w_up)
    return jnp.einsum("etf,efd->etd", gate * up, w_down)


class MoE(nnx.Module):
    """Top-k routed experts with per-sequence capacity; returns ``(output, load_balancing_loss)``."""

    def __init__(self, cfg: MoEConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.router = nnx.Linear(cfg.dim, cfg.experts, use_bias=False, rngs=rngs)
        self.experts = Experts(cfg, rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return mix_experts(x, self.router(x), self.experts, self.cfg)


def mix_experts(x: jax.Array, logits: jax.Array, experts: Callable[[jax.Array, jax.Array], jax.Array],
                cfg: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """The MoE layer's rule, for the NNX model and the plain-JAX one: route, dispatch, run, combine.

    ``x`` ``(B, S, d)`` and its router ``logits`` ``(B, S, E)``; ``experts(x, dispatch)`` returns
    the outputs ``(B, E, C, d)`` of the slots ``dispatch`` ``(B, S, E, C)`` fills
    (:func:`expert_slots` runs them where they live). Returns the output ``(B, S, d)`` and the
    batch's mean load-balancing loss.

    Example:
      >>> cfg = MoEConfig(dim=4, heads=1, experts=2, top_k=1)
      >>> double = lambda x, dispatch: 2 * jnp.einsum("bsec,bsd->becd", dispatch, x)
      >>> y, aux = mix_experts(jnp.ones((1, 3, 4)), jnp.zeros((1, 3, 2)), double, cfg)
      >>> y.shape, float(aux)
      ((1, 3, 4), 1.0)
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # (B, S, E)
    gates, idx = jax.lax.top_k(probs, cfg.top_k)  # (B, S, k)
    gates = gates / gates.sum(-1, keepdims=True)
    chosen = jax.nn.one_hot(idx, cfg.experts, dtype=jnp.float32)  # (B, S, k, E)
    dispatch, combine = dispatch_slots(chosen, gates, cfg.capacity(x.shape[1]))  # (B, S, E, C) each
    ye = experts(x, dispatch)  # (B, E, C, d)
    y = jnp.einsum("bsec,becd->bsd", combine.astype(ye.dtype), ye)
    share = chosen.sum(2).mean(1) / cfg.top_k  # f_e per sequence, (B, E)
    aux = cfg.experts * jnp.sum(share * probs.mean(1), axis=-1)  # (B,)
    return y, aux.mean()


def expert_slots(x: jax.Array, dispatch: jax.Array, dtype: jnp.dtype, experts: Callable[[jax.Array], jax.Array],
                 axis: str | None, exchange: str = "all_to_all") -> jax.Array:
    """Fill the slots ``(B, E, C, d)`` with tokens ``x`` per ``dispatch``, in ``dtype``, and run
    them through ``experts`` (``(E', T, d)`` to the same) where the experts live.

    Over ``axis`` (size ``M``) each device holds ``E' = E / M`` experts: an ``all_to_all`` sends
    every device's slots for them to it, and another sends the outputs back. With ``axis=None``
    all ``E`` are local. ``exchange="gspmd"``: no ``all_to_all``; the slots are constrained to
    be split over ``axis`` by expert, and GSPMD moves them (under ``jax.set_mesh``).

    Example:
      >>> to_expert_2 = jax.nn.one_hot(jnp.full((1, 1), 2), 4)[..., None]  # one token, (B, S, E, C=1)
      >>> by_index = lambda t: t * jnp.arange(4.0)[:, None, None]  # expert e multiplies by e
      >>> expert_slots(jnp.ones((1, 1, 3)), to_expert_2, jnp.float32, by_index, None)[0, :, 0, 0]
      Array([0., 0., 2., 0.], dtype=float32)
    """
    xe = jnp.einsum("bsec,bsd->becd", dispatch.astype(dtype), x.astype(dtype))
    manual = axis is not None and exchange == "all_to_all"
    if manual:  # (M * B, E / M, C, d): every device's slots for my experts
        xe = jax.lax.all_to_all(xe, axis, 1, 0, tiled=True)
    elif axis:
        xe = jax.lax.with_sharding_constraint(xe, P(P.UNCONSTRAINED, axis))
    b, e, c, d = xe.shape
    ye = experts(xe.transpose(1, 0, 2, 3).reshape(e, b * c, d))
    ye = ye.reshape(e, b, c, d).transpose(1, 0, 2, 3)
    if manual:  # back to (B, E, C, d) on the devices the tokens came from
        ye = jax.lax.all_to_all(ye, axis, 0, 1, tiled=True)
    elif axis:
        ye = jax.lax.with_sharding_constraint(ye, P(P.UNCONSTRAINED, axis))
    return ye


def dispatch_slots(chosen: jax.Array, gates: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
    """Capacity slots per sequence: first choices before second ones, then token order; overflow is dropped.

    ``chosen``: ``(B, S, k, E)`` one-hot choices, ``gates``: ``(B, S, k)``. Returns ``dispatch``
    (1 where a token fills a slot) and ``combine`` (its gate there), each ``(B, S, E, C)``.

    Example:
      >>> chosen = jax.nn.one_hot(jnp.zeros((1, 3, 1), jnp.int32), 2)  # 3 tokens, all to expert 0
      >>> dispatch, _ = dispatch_slots(chosen, jnp.ones((1, 3, 1)), capacity=2)
      >>> dispatch.sum(axis=(2, 3)).tolist()  # the third token is dropped
      [[1.0, 1.0, 0.0]]
    """
    b, s, k, e = chosen.shape
    by_rank = chosen.transpose(0, 2, 1, 3).reshape(b, k * s, e).astype(jnp.int32)
    position = (jnp.cumsum(by_rank, axis=1) - 1).reshape(b, k, s, e).transpose(0, 2, 1, 3)
    kept = jnp.where(position < capacity, chosen, 0.0)
    slot = jax.nn.one_hot(jnp.where(kept > 0, position, capacity), capacity, dtype=chosen.dtype)  # (B, S, k, E, C)
    dispatch = jnp.einsum("bske,bskec->bsec", kept, slot)
    combine = jnp.einsum("bsk,bske,bskec->bsec", gates, kept, slot)
    return dispatch, combine


class Block(nnx.Module):
    def __init__(self, cfg: MoEConfig, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(cfg.dim, rngs=rngs)
        self.attn = Attention(cfg, rngs)
        self.moe_norm = nnx.RMSNorm(cfg.dim, rngs=rngs)
        self.moe = MoE(cfg, rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = x + self.attn(self.attn_norm(x))
        y, aux = self.moe(self.moe_norm(x))
        return x + y, aux


class Mixtral(nnx.Module):
    """Embedding, ``layers`` blocks, norm, output head; returns ``(logits, mean load-balancing loss)``."""

    def __init__(self, cfg: MoEConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.dim, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.norm = nnx.RMSNorm(cfg.dim, rngs=rngs)
        self.head = nnx.Linear(cfg.dim, cfg.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        x, aux = self.embed(tokens), []
        for block in self.blocks:
            x, block_aux = block(x)
            aux.append(block_aux)
        return self.head(self.norm(x)), jnp.mean(jnp.stack(aux))


def lm_loss(model: Mixtral, tokens: jax.Array) -> jax.Array:
    """Next-token cross-entropy over ``tokens[:, :-1] -> tokens[:, 1:]`` plus ``aux_weight`` x load-balancing loss.

    Example:
      >>> model = Mixtral(MoEConfig(vocab=16, dim=8, heads=2, layers=1), nnx.Rngs(0))
      >>> lm_loss(model, jnp.ones((2, 5), jnp.int32)).shape
      ()
    """
    return lm_objective(*model(tokens[:, :-1]), tokens, model.cfg)


def lm_objective(logits: jax.Array, aux: jax.Array, tokens: jax.Array, cfg: MoEConfig) -> jax.Array:
    """Mean cross-entropy of ``logits`` (for ``tokens[:, :-1]``) against ``tokens[:, 1:]``, plus ``aux_weight * aux``.

    Example:
      >>> tokens = jnp.zeros((1, 3), jnp.int32)  # uniform logits over 4 words: log 4
      >>> round(float(lm_objective(jnp.zeros((1, 2, 4)), jnp.ones(()), tokens, MoEConfig(aux_weight=0.0))), 4)
      1.3863
    """
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()
    return ce + cfg.aux_weight * aux
