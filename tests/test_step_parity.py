"""10 steps of SGD with momentum, sharded vs an unsharded single-device reference."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType
from model import batches, init_params, shard, train_reference, train_sharded

import jshard as js

STEPS = 10


@pytest.fixture(scope="module")
def reference():
    return train_reference(init_params(), batches(STEPS))


def _check(reference, losses, sharded, grads, tol=1e-5):
    ref_losses, ref_params = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=tol, atol=tol)
    full = js.unshard(sharded)
    for (path, got), want in zip(jax.tree.flatten_with_path(full)[0], jax.tree.leaves(ref_params), strict=True):
        assert got.shape == want.shape, path
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol, err_msg=str(path))
    _check_padding_is_zero(sharded)
    _check_padding_is_zero(grads)


def _check_padding_is_zero(tree):
    def check(meta, layout, x):
        if layout is not None and layout.padding:
            rows = np.take(np.asarray(x), np.arange(layout.shape[layout.dim], layout.padded), axis=layout.dim)
            assert not rows.any(), layout

    from jshard._unit import map_unit_leaves

    map_unit_leaves(check, tree)


@pytest.mark.parametrize("replicate", [1, 2], ids=["fsdp", "hsdp"])
@pytest.mark.parametrize("raf", [True, False, None, 2], ids=lambda r: f"raf={r}")
def test_parity_grid(reference, raf, replicate):
    mesh = js.make_mesh(replicate=replicate)
    sharded = shard(init_params(), mesh, js.FullyShardPolicy(reshard_after_forward=raf))
    _check(reference, *train_sharded(sharded, batches(STEPS)))


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_parity_explicit_and_auto_meshes(reference, axis_type):
    mesh = jax.make_mesh((2, 4), ("replicate", "fsdp"), axis_types=(axis_type,) * 2)
    sharded = shard(init_params(), mesh)
    _check(reference, *train_sharded(sharded, batches(STEPS)))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"microbatches": 4},
        {"microbatches": 4, "requires_gradient_sync": False},
        {"microbatches": 2, "requires_all_reduce": False},
    ],
    ids=["sync-each-microbatch", "sync-once", "hsdp-all-reduce-once"],
)
def test_parity_with_gradient_accumulation(reference, kwargs):
    sharded = shard(init_params(), js.make_mesh(replicate=2))
    _check(reference, *train_sharded(sharded, batches(STEPS), **kwargs))


def test_parity_with_full_params_given_to_loss_fn(reference):
    import optax
    from model import loss_fn, optimizer

    sharded = shard(init_params(), js.make_mesh())
    tx = optimizer()
    state = tx.init(sharded)
    grad_fn = js.value_and_grad(loss_fn, unshard_params=True)

    @jax.jit
    def step(p, s, batch):
        loss, grads = grad_fn(p, batch)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss, grads

    losses = []
    for batch in batches(STEPS):
        sharded, state, loss, grads = step(sharded, state, batch)
        losses.append(float(loss))
    _check(reference, losses, sharded, grads)
