"""Train a Flax NNX character-level transformer with FSDP2-style per-block units.

    python examples/nnx_train.py [--steps 100] [--layers 4] [--unrolled] [--mixed-precision]

The model is plain Flax NNX; sharding it is three lines (``jnnx.fully_shard`` on the
blocks, then on the root) and the training loop is the usual ``nnx.Optimizer`` +
``nnx.jit`` one, with ``jnnx.value_and_grad`` in place of ``nnx.value_and_grad``. The
blocks are stacked (``nnx.vmap``) and run with ``nnx.scan``, so each layer is gathered
at its own iteration; ``--unrolled`` uses an ``nnx.List`` of blocks instead. Runs on
whatever devices JAX has (8 simulated CPU devices when there is no accelerator).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from importlib import resources

import jax

jax.config.update("jax_num_cpu_devices", 8)  # only the CPU backend reads it: 8 simulated devices when alone

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jshard as js  # noqa: E402
from jshard.flax import nnx as jnnx  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 128
    seq: int = 64
    dim: int = 128
    heads: int = 4
    layers: int = 4
    scan: bool = True


class Block(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(cfg.dim, rngs=rngs), nnx.LayerNorm(cfg.dim, rngs=rngs)
        self.qkv, self.out = nnx.Linear(cfg.dim, 3 * cfg.dim, rngs=rngs), nnx.Linear(cfg.dim, cfg.dim, rngs=rngs)
        self.up, self.down = nnx.Linear(cfg.dim, 4 * cfg.dim, rngs=rngs), nnx.Linear(4 * cfg.dim, cfg.dim, rngs=rngs)
        self.heads = cfg.heads

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = (y.reshape(b, t, self.heads, -1) for y in jnp.split(self.qkv(self.ln1(x)), 3, axis=-1))
        causal = jnp.tril(jnp.ones((t, t), bool))
        s = jnp.where(causal, jnp.einsum("bqhd,bkhd->bhqk", q, k) / (d // self.heads) ** 0.5, -1e9)
        x = x + self.out(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v).reshape(b, t, d))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class CharLM(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.dim, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.seq, cfg.dim)))
        if cfg.scan:
            make = nnx.split_rngs(splits=cfg.layers)(nnx.vmap(lambda r: Block(cfg, r), in_axes=(0,), out_axes=0))
            self.blocks = make(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.ln_f = nnx.LayerNorm(cfg.dim, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        if self.cfg.scan:
            x = nnx.scan(lambda h, block: block(h), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.blocks)
        else:
            for block in self.blocks:
                x = block(x)
        return self.embed.attend(self.ln_f(x))  # tied head


def shard(model: CharLM, policy: js.FullyShardPolicy) -> CharLM:
    """FSDP2's pattern: the blocks first (one unit for the stack, or one per block), then the root."""
    if model.cfg.scan:
        jnnx.fully_shard(model.blocks, policy=dataclasses.replace(policy, scan_axis=0))
    else:
        for block in model.blocks:
            jnnx.fully_shard(block, policy=policy)
    return jnnx.fully_shard(model, policy=policy)


def loss_fn(model: CharLM, batch) -> jax.Array:
    logits = model(batch[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def text_ids() -> tuple[np.ndarray, list[str]]:
    text = resources.files("jshard").joinpath("data", "sonnets.txt").read_text()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return np.array([index[c] for c in text], np.int32), chars


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--unrolled", action="store_true", help="an nnx.List of blocks instead of nnx.scan")
    parser.add_argument("--mixed-precision", action="store_true", help="bf16 gathers and compute, fp32 reduce")
    args = parser.parse_args()

    ids, chars = text_ids()
    cfg = Config(vocab=len(chars), seq=65, layers=args.layers, scan=not args.unrolled)
    mp = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32) if args.mixed_precision else None
    policy = js.FullyShardPolicy(mp_policy=mp or js.MixedPrecisionPolicy())
    print(f"{len(jax.devices())} devices ({jax.devices()[0].platform}); {cfg.layers} layers, width {cfg.dim}")

    model = shard(CharLM(cfg, nnx.Rngs(0)), policy)
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)  # its state is sharded like the params

    @nnx.jit
    def train_step(model, optimizer, batch):
        loss, grads = jnnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(0)
    start = time.time()
    for step in range(1, args.steps + 1):
        offsets = rng.integers(0, len(ids) - cfg.seq, args.batch)
        loss = train_step(model, optimizer, jnp.asarray(np.stack([ids[o : o + cfg.seq] for o in offsets])))
        if step == 1 or step % 20 == 0 or step == args.steps:
            print(f"step {step:4d}  loss {float(loss):.3f}  ({time.time() - start:.1f}s)")

    jnnx.unshard(model)  # full parameters for generation outside the step
    next_char = nnx.jit(lambda m, x, key: jax.random.categorical(key, m(x)[0, -1].astype(jnp.float32) / 0.8))
    window, key = list(ids[: cfg.seq - 1]), jax.random.key(0)
    for _ in range(120):
        key, sub = jax.random.split(key)
        window.append(int(next_char(model, jnp.asarray([window[-(cfg.seq - 1) :]]), sub)))
    print("sample:", "".join(chars[i] for i in window[cfg.seq - 1 :]))


if __name__ == "__main__":
    main()
