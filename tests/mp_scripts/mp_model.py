"""The small model the multi-process tests train, in 2 processes x 4 devices or 1 x 8.

Units: two unrolled blocks with odd shapes (padding), a stack of layers under
``js.scan`` and a root holding them with its own leaves, sharded bottom-up.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jshard as js

LAYERS, WIDTH, BATCH = 3, 13, 16


def init_params(width: int = WIDTH, seed: int = 0) -> dict:
    """Host (NumPy) parameters, identical on every process."""
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return (rng.normal(size=shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1)).astype(np.float32)

    return {
        "embed": {"w": normal(6, width)},
        "block0": {"w": normal(width, width), "b": normal(width) * 0.1},
        "block1": {"w": normal(width, 9)},
        "stack": {"w": normal(LAYERS, 9, 9)},
        "head": {"w": normal(9, 5)},
        "scale": np.float32(1.5),
    }


def shard(params: dict, mesh, policy: js.FullyShardPolicy | None = None) -> js.FSDPUnit:
    """Bottom-up: each block, the stack (``scan_axis=0``), then the root."""
    policy = policy or js.FullyShardPolicy()
    tree = dict(params)
    for name in ("block0", "block1"):
        tree[name] = js.fully_shard(params[name], mesh, policy)
    tree["stack"] = js.fully_shard(params["stack"], mesh, js.FullyShardPolicy(scan_axis=0))
    return js.fully_shard(tree, mesh, policy)


def batches(steps: int, seed: int = 1) -> list[dict]:
    """Global batches (every process generates all of them and takes its rows)."""
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(BATCH, 6)).astype(np.float32),
             "y": rng.normal(size=(BATCH, 5)).astype(np.float32)} for _ in range(steps)]


def local_rows(batch: dict, process: int, processes: int) -> dict:
    """This process's share of a global batch: contiguous rows, in process order."""
    n = BATCH // processes
    return {k: v[process * n:(process + 1) * n] for k, v in batch.items()}


def loss_fn(params, batch):
    root = js.unshard(params)
    h = jnp.tanh(batch["x"] @ root["embed"]["w"])
    b0 = js.unshard(root["block0"])
    h = jnp.tanh(h @ b0["w"] + b0["b"])
    h = jnp.tanh(h @ js.unshard(root["block1"])["w"])
    h, _ = js.scan(lambda c, layer: (jnp.tanh(c @ layer["w"]), None), h, root["stack"])
    out = root["scale"] * (h @ root["head"]["w"])
    return jnp.mean((out - batch["y"]) ** 2)


OPTIMIZER = optax.sgd(0.1, momentum=0.9)


@jax.jit
def train_step(sharded, opt_state, batch):
    loss, grads = js.value_and_grad(loss_fn, unshard_params=False)(sharded, batch)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, sharded)
    return optax.apply_updates(sharded, updates), opt_state, loss


def train(sharded, batches_on_mesh):
    """SGD with momentum over the given global batches; returns (params, opt_state, losses)."""
    opt_state = OPTIMIZER.init(sharded)
    losses = []
    for batch in batches_on_mesh:
        sharded, opt_state, loss = train_step(sharded, opt_state, batch)
        losses.append(float(loss))
    return sharded, opt_state, losses
