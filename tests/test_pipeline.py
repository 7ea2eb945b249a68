"""Pipeline stages over FSDP: a stack of L layers run as S stages over ``stage`` (GPipe), each
stage's layers FSDP-sharded over ``fsdp``, against the unsharded model ([Note: pipeline schedule])."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jshard as js
from jshard.optim import shard_optimizer

D_IN, D, D_OUT, BATCH, STEPS = 5, 6, 3, 16, 10


def _mesh(stages: int) -> Mesh:
    return Mesh(np.asarray(jax.devices()).reshape(stages, 8 // stages), ("stage", "fsdp"))


def _params(layers: int) -> dict:
    rng = np.random.default_rng(0)
    f32 = lambda scale, *shape: (rng.normal(size=shape) * scale).astype(np.float32)  # noqa: E731
    return {"w_in": f32(0.5, D_IN, D), "w_out": f32(0.5, D, D_OUT),
            "stack": {"w": f32(0.4, layers, D, D), "b": f32(0.1, layers, D)}}


def _batch() -> dict:
    rng = np.random.default_rng(1)
    return {"x": rng.normal(size=(BATCH, D_IN)).astype(np.float32),
            "y": rng.normal(size=(BATCH, D_OUT)).astype(np.float32)}


def _layer(h: jax.Array, layer: dict) -> jax.Array:
    return h + jnp.tanh(h @ layer["w"] + layer["b"])


def _loss(p: dict, batch: dict, run_stack) -> jax.Array:
    h = run_stack(jnp.tanh(batch["x"] @ p["w_in"]), p["stack"])
    return jnp.mean((h @ p["w_out"] - batch["y"]) ** 2)


def _scan_stack(h, stack):
    return jax.lax.scan(lambda h, layer: (_layer(h, layer), None), h, stack)[0]


def _adamw():
    return optax.adamw(3e-2, weight_decay=0.1)


def _update(tx, grads, state, params):
    with jax.numpy_dtype_promotion("standard"):  # Optax's Adam raises a Python float to its int32 count
        updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


@functools.cache
def _reference(layers: int) -> tuple[list[float], dict]:
    """The unsharded model on one device: losses and parameters after ``STEPS`` AdamW steps."""
    tx, params, batch = _adamw(), _params(layers), _batch()

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(_loss)(params, batch, _scan_stack)
        return loss, *_update(tx, grads, state, params)

    state, losses = tx.init(params), []
    for _ in range(STEPS):
        loss, params, state = step(params, state)
        losses.append(float(loss))
    return losses, params


def _sharded(params: dict, mesh: Mesh):
    on_fsdp = js.FullyShardPolicy(scan_axis=0, dp_mesh_dims=js.DataParallelMeshDims(shard="fsdp"))
    stack = js.fully_shard(js.stage_layers(params["stack"], mesh), mesh, on_fsdp)
    dense = js.FullyShardPolicy(dp_mesh_dims=js.DataParallelMeshDims(shard=("stage", "fsdp")))
    return js.fully_shard({"w_in": params["w_in"], "w_out": params["w_out"], "stack": stack}, mesh, dense)


def _train_step(layers: int, policy: js.PipelinePolicy, tx):
    def loss_fn(p, batch):
        stack = lambda h, s: js.pipeline(_layer, h, s, layers=layers, policy=policy)  # noqa: E731
        return _loss(js.unshard(p), batch, stack)

    @jax.jit
    def step(sharded, state, batch):
        loss, grads = js.value_and_grad(loss_fn, unshard_params=False)(sharded, batch)
        return loss, *_update(tx, grads, state, sharded)

    return step


@pytest.mark.parametrize("stages,layers,microbatches,gather", [
    (2, 5, 2, "per_microbatch"), (2, 5, 4, "once"), (4, 7, 4, "once"), (4, 7, 8, "per_microbatch"),
])
def test_pipeline_parity_with_unsharded_reference(stages, layers, microbatches, gather):
    """10 AdamW steps, fp32, on (stage 2 x fsdp 4) and (stage 4 x fsdp 2), L not divisible by S,
    M = S and M = 2S, both gather policies: losses and parameters within 1e-5 of one device."""
    mesh, params, batch = _mesh(stages), _params(layers), _batch()
    ref_losses, ref = _reference(layers)
    tx = shard_optimizer(_adamw())
    sharded = _sharded(params, mesh)
    state = tx.init(sharded)
    step = _train_step(layers, js.PipelinePolicy(microbatches=microbatches, gather=gather), tx)
    losses = []
    for _ in range(STEPS):
        loss, sharded, state = step(sharded, state, batch)
        losses.append(float(loss))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    full = js.unshard(sharded)
    padding = jax.tree.map(lambda w: w[layers:], full["stack"])
    full["stack"] = jax.tree.map(lambda w: w[:layers], full["stack"])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), full, ref)
    assert all(not np.any(w) for w in jax.tree.leaves(padding))  # the identity layers stay zero
    assert sharded["stack"]["w"].sharding.spec == jax.sharding.PartitionSpec("stage", "fsdp")
