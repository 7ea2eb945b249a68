"""A small model with every kind of unit, and an unsharded single-device reference trainer.

Units: two unrolled blocks with odd shapes ((17, 15), (15,), (15, 7)), a stack of three
(7, 7) layers under ``js.scan`` and a root with (16, 17), (7, 15), (1,) and a 0-d leaf.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jshard as js

LAYERS = 3


def init_params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1), jnp.float32)

    return {
        "embed": {"w": normal(16, 17)},
        "block0": {"w": normal(17, 15), "b": normal(15) * 0.1},
        "block1": {"w": normal(15, 7)},
        "stack": {"w": normal(LAYERS, 7, 7), "b": normal(LAYERS, 7) * 0.1},
        "head": {"w": normal(7, 15)},
        "scale": jnp.asarray(1.5, jnp.float32),
        "one": jnp.asarray([0.25], jnp.float32),
    }


def batches(steps: int, size: int = 32, seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {"x": jnp.asarray(rng.normal(size=(size, 16)), jnp.float32),
         "y": jnp.asarray(rng.normal(size=(size, 15)), jnp.float32)}
        for _ in range(steps)
    ]


def _unshard(x):
    return js.unshard(x) if isinstance(x, js.FSDPUnit) else x


def _scan(body, init, xs):
    return js.scan(body, init, xs) if isinstance(xs, js.FSDPUnit) else jax.lax.scan(body, init, xs)


def loss_fn(params, batch):
    """Mean squared error; gathers each unit right before use (works on plain trees too)."""
    root = _unshard(params)
    dtype = batch["x"].dtype
    h = jnp.tanh(batch["x"] @ root["embed"]["w"])
    block0 = _unshard(root["block0"])
    h = jnp.tanh(h @ block0["w"] + block0["b"])
    h = jnp.tanh(h @ _unshard(root["block1"])["w"])
    h, _ = _scan(lambda c, layer: (jnp.tanh(c @ layer["w"] + layer["b"]), None), h, root["stack"])
    out = (h @ root["head"]["w"]) * root["scale"] + root["one"]
    return jnp.mean((out.astype(jnp.float32) - batch["y"].astype(jnp.float32)) ** 2).astype(dtype)


def shard(params: dict, mesh, policy: js.FullyShardPolicy | None = None) -> js.FSDPUnit:
    """Blocks and the stack as their own units, then the root (FSDP2's bottom-up order)."""
    policy = policy or js.FullyShardPolicy()
    stack_policy = dataclasses.replace(policy, scan_axis=0)
    units = {
        "block0": js.fully_shard(params["block0"], mesh, policy),
        "block1": js.fully_shard(params["block1"], mesh, policy),
        "stack": js.fully_shard(params["stack"], mesh, stack_policy),
    }
    return js.fully_shard({**params, **units}, mesh, policy)


def optimizer():
    return optax.sgd(0.1, momentum=0.9)


def train_reference(params: dict, data: list[dict]) -> tuple[list[float], dict]:
    """Unsharded training on one device: the gradient of the global-batch mean loss."""
    tx = optimizer()
    device = jax.devices()[0]
    params = jax.device_put(params, device)
    state = tx.init(params)

    @jax.jit
    def step(p, s, batch):
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    losses = []
    for batch in data:
        params, state, loss = step(params, state, jax.device_put(batch, device))
        losses.append(float(loss))
    return losses, params


def train_sharded(sharded, data: list[dict], tx=None, unshard_params: bool = False, **grad_kwargs):
    """The same training with jshard's step; returns (losses, params, last grads, opt state)."""
    tx = tx or optimizer()
    state = tx.init(sharded)
    grad_fn = js.value_and_grad(loss_fn, unshard_params=unshard_params, **grad_kwargs)

    @jax.jit
    def step(p, s, batch):
        loss, grads = grad_fn(p, batch)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss, grads

    losses = []
    for batch in data:
        sharded, state, loss, grads = step(sharded, state, batch)
        losses.append(float(loss))
    return losses, sharded, grads, state
