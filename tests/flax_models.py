"""What the NNX and Linen adapter tests share: the transformer's config, its data, its attention math.

Each test file writes the transformer's modules the way its API's docs write them; the
numbers they compute are the same.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

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
    embed_dtype: object = None  # nnx.Embed fixes its compute dtype at construction (NNX only)


def causal_attention(qkv: jax.Array, heads: int) -> jax.Array:
    """Causal multi-head self-attention of a fused ``(b, t, 3d)`` projection, heads merged back: ``(b, t, d)``."""
    b, t, d3 = qkv.shape
    d = d3 // 3
    q, k, v = (y.reshape(b, t, heads, d // heads) for y in jnp.split(qkv, 3, axis=-1))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / (d // heads) ** 0.5
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v).reshape(b, t, d)


def batches(cfg: Config):
    """``STEPS`` batches of random next-token data (the same for every test)."""
    key = jax.random.key(1)
    for _ in range(STEPS):
        k1, k2, key = jax.random.split(key, 3)
        yield {
            "x": jax.random.randint(k1, (BATCH, cfg.seq), 0, cfg.vocab),
            "y": jax.random.randint(k2, (BATCH, cfg.seq), 0, cfg.vocab),
        }

