"""The Mixtral-style model's optimizer state across its units on two sets of axes: global-norm
clipping inside js.shard_optimizer equals the unsharded update, and a checkpoint saved on
(data 2 x expert 4) restores exactly on (data 4 x expert 2) and on one device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

import jshard as js
from jshard.checkpoint import CheckpointManager
from jshard.demo.moe import MoEConfig, lm_loss
from jshard.demo.moe_train import expert_mesh, init_params, shard_mixtral
from jshard.state_dict import full_state_dict

# d=10, f=17: neither data 2 nor data 4 divides them, so expert and dense leaves carry padding.
CFG = MoEConfig(vocab=32, dim=10, heads=2, layers=2, experts=4, hidden=17, capacity_factor=1.0, aux_weight=0.1)
CLIP = 0.05


@functools.cache
def _grads() -> dict:
    """The one-device model's gradients at its initial parameters, on one batch."""
    graphdef, params = init_params(CFG)
    tokens = np.random.default_rng(0).integers(0, CFG.vocab, size=(16, 9)).astype(np.int32)
    return jax.jit(jax.grad(lambda p, t: lm_loss(nnx.merge(graphdef, p), t)))(params, tokens)


def _clip_then_adamw() -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(1e-2, weight_decay=0.1))


@pytest.mark.parametrize("data", [2, 4])
def test_global_norm_clipping_over_expert_and_dense_units_is_exact(data):
    """optax.clip_by_global_norm then AdamW, in js.shard_optimizer: the norm spans expert leaves
    split over (expert, data) and dense ones over all 8 devices, padding included, and the
    updates equal the one-device chain's."""
    grads, params = _grads(), init_params(CFG)[1]
    assert float(optax.tree.norm(grads)) > 10 * CLIP  # the clip binds
    tx = _clip_then_adamw()
    mesh = expert_mesh(CFG.experts, expert_degree=8 // data)
    sharded_tx = js.shard_optimizer(tx)
    sharded_params = shard_mixtral(params, mesh)
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes Python floats with its int32 count
        want, _ = jax.jit(tx.update)(grads, tx.init(params), params)
        got, _ = jax.jit(sharded_tx.update)(shard_mixtral(grads, mesh), sharded_tx.init(sharded_params), sharded_params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8), js.unshard(got), want)


@pytest.mark.parametrize("target", ["data 4 x expert 2", "one device"])
def test_checkpoint_saved_on_expert_4_restores_exactly_on_another_expert_degree(tmp_path, target):
    """Parameters and AdamW moments of the whole model, saved on (data 2 x expert 4)."""
    tx = js.shard_optimizer(_clip_then_adamw())
    saved_on = expert_mesh(CFG.experts, expert_degree=4)
    params = shard_mixtral(init_params(CFG)[1], saved_on)
    with jax.numpy_dtype_promotion("standard"):
        _, state = tx.update(shard_mixtral(_grads(), saved_on), tx.init(params), params)
    saved = {"params": params, "opt_state": state}
    with CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, saved)
    mesh = expert_mesh(CFG.experts, expert_degree=2) if target != "one device" else \
        Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "expert"))
    like_params = shard_mixtral(jax.tree.map(jnp.zeros_like, init_params(CFG)[1]), mesh)
    like = {"params": like_params, "opt_state": tx.init(like_params)}
    with CheckpointManager(tmp_path) as ckpt:
        restored = ckpt.restore(like)
    w_up = restored["params"]["blocks"][1]["moe"]["experts"]["w_up"]
    assert w_up.sharding == like_params["blocks"][1]["moe"]["experts"]["w_up"].sharding
    assert len(w_up.sharding.device_set) == mesh.size
    got, want = full_state_dict(restored), full_state_dict(saved)
    assert float(np.max(np.abs(want["opt_state"][1][0].mu["head"]["kernel"]))) > 0  # moments, not zeros
    jax.tree.map(np.testing.assert_array_equal, got, want)
