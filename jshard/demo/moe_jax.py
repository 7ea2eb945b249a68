"""The Mixtral-style model of :mod:`jshard.demo.moe` in plain JAX: pure functions over a parameter dict.

The dict has the layout ``nnx.split(Mixtral(cfg, ...))[1].to_pure_dict()`` has, so one set of
parameters runs in either model and :func:`jshard.demo.moe_train.shard_mixtral` shards both.
The MoE rules (routing, capacity, dispatch, the exchange over ``expert_axis``, the SwiGLU
experts, attention, the objective) are :mod:`jshard.demo.moe`'s functions, called here on
dict entries; what this module adds is what Flax's layers did: embedding lookup, dense
projections, RMS norm, and an initializer.

Example:
  >>> import jax
  >>> from jshard.demo.moe import MoEConfig
  >>> cfg = MoEConfig(vocab=16, dim=8, heads=2, layers=1, experts=4, hidden=12)
  >>> params = init_params(cfg, jax.random.key(0))
  >>> params["blocks"][0]["moe"]["experts"]["w_gate"].shape
  (4, 8, 12)
  >>> float(lm_loss(params, jax.numpy.zeros((2, 9), jax.numpy.int32), cfg)) > 0
  True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jshard.demo.moe import MoEConfig, causal_attention, expert_slots, lm_objective, mix_experts, swiglu_experts

RMS_EPSILON = 1e-6  # nnx.RMSNorm's default


def init_params(cfg: MoEConfig, key: jax.Array) -> dict:
    """Parameters as a dict: normal embedding, kernels normal / sqrt(fan-in) (each expert its own), unit norm scales."""
    keys = iter(jax.random.split(key, 2 + 6 * cfg.layers))
    d, f, e = cfg.dim, cfg.hidden, cfg.experts

    def lecun(shape: tuple[int, ...], fan_in: int) -> jax.Array:
        return jax.random.normal(next(keys), shape) / jnp.sqrt(fan_in)

    def layer() -> dict:
        return {
            "attn_norm": {"scale": jnp.ones(d)},
            "attn": {"qkv": {"kernel": lecun((d, 3 * d), d)}, "out": {"kernel": lecun((d, d), d)}},
            "moe_norm": {"scale": jnp.ones(d)},
            "moe": {"router": {"kernel": lecun((d, e), d)},
                    "experts": {"w_gate": lecun((e, d, f), d), "w_up": lecun((e, d, f), d),
                                "w_down": lecun((e, f, d), f)}},
        }

    return {"embed": {"embedding": jax.random.normal(next(keys), (cfg.vocab, d))},
            "blocks": {i: layer() for i in range(cfg.layers)},
            "norm": {"scale": jnp.ones(d)},
            "head": {"kernel": lecun((d, cfg.vocab), d)}}


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``x / rms(x) * scale`` over the last dim, as ``nnx.RMSNorm`` computes it."""
    return x * (jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + RMS_EPSILON) * scale)


def block(p: dict, x: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """Attention then the MoE layer, each on a normed input with a residual; returns ``(x, load-balancing loss)``."""
    h = rms_norm(x, p["attn_norm"]["scale"])
    x = x + causal_attention(h @ p["attn"]["qkv"]["kernel"], cfg.heads) @ p["attn"]["out"]["kernel"]
    h = rms_norm(x, p["moe_norm"]["scale"])
    w = p["moe"]["experts"]

    def experts(x: jax.Array, dispatch: jax.Array) -> jax.Array:
        return expert_slots(x, dispatch, w["w_up"].dtype, lambda t: swiglu_experts(t, **w), cfg.expert_axis,
                            cfg.exchange)

    y, aux = mix_experts(h, h @ p["moe"]["router"]["kernel"], experts, cfg)
    return x + y, aux


def forward(params: dict, tokens: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """Logits ``(B, S, vocab)`` and the mean load-balancing loss over the blocks."""
    x, aux = jnp.take(params["embed"]["embedding"], tokens, axis=0), []
    for i in range(cfg.layers):
        x, block_aux = block(params["blocks"][i], x, cfg)
        aux.append(block_aux)
    return rms_norm(x, params["norm"]["scale"]) @ params["head"]["kernel"], jnp.mean(jnp.stack(aux))


def lm_loss(params: dict, tokens: jax.Array, cfg: MoEConfig) -> jax.Array:
    """The objective of :func:`jshard.demo.moe.lm_loss`, for the dict model."""
    return lm_objective(*forward(params, tokens[:, :-1], cfg), tokens, cfg)
