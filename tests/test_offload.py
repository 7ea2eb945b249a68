"""CPU offload end to end: exact parity, host-resident state, device bytes that fall."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from model import batches, init_params, shard, train_sharded

import jshard as js
from jshard._report.hlo import entry_bytes_by_memory_space

OFFLOAD = js.FullyShardPolicy(offload_policy=js.CPUOffloadPolicy())


@pytest.mark.parametrize("compute", ["host", "device"])
def test_offloaded_training_equals_device_training_exactly(compute):
    tx = optax.sgd(0.1, momentum=0.9)
    base_losses, base_params, *_ = train_sharded(shard(init_params(), js.make_mesh()), batches(4), tx)
    losses, params, grads, state = train_sharded(shard(init_params(), js.make_mesh(), OFFLOAD), batches(4),
                                                 js.offload_optimizer(tx, compute))
    assert losses == base_losses
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(base_params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for tree in (params, state, grads):
        kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree) if leaf.ndim}
        assert kinds == {"pinned_host"}, kinds
        assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree) if not leaf.ndim} == {"device"}


def test_hsdp_all_reduce_once_per_step_keeps_offloaded_gradients_on_host():
    """``requires_all_reduce=False`` reduces over replicas at the end of the step, on device,
    and hands the gradients back in host memory (they once stayed on device, and the
    optimizer's host state could not be added to them)."""
    tx = js.offload_optimizer(optax.sgd(0.1, momentum=0.9))
    mesh = js.make_mesh(replicate=2)
    base, *_ = train_sharded(shard(init_params(), mesh, OFFLOAD), batches(2), tx)
    losses, _, grads, _ = train_sharded(shard(init_params(), mesh, OFFLOAD), batches(2), tx, requires_all_reduce=False)
    np.testing.assert_allclose(losses, base, rtol=1e-6)
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(grads) if leaf.ndim} == {"pinned_host"}


def test_device_memory_falls_by_the_offloaded_bytes():
    layers, width = 8, 256
    params = {"w": jax.ShapeDtypeStruct((layers, width, width), jnp.float32)}
    x = jax.ShapeDtypeStruct((64, width), jnp.float32)

    def stack_loss(p, x):
        h, _ = js.scan(lambda h, layer: (jnp.tanh(h @ layer["w"]), None), x, p)
        return jnp.mean(h**2)

    def compiled(offload):
        policy = js.FullyShardPolicy(scan_axis=0, offload_policy=offload)
        sharded = js.fully_shard(params, policy=policy)
        return jax.jit(js.value_and_grad(stack_loss, unshard_params=False)).lower(sharded, x).compile()

    on_device = entry_bytes_by_memory_space(compiled(js.OffloadPolicy()).as_text())
    offloaded_program = compiled(js.CPUOffloadPolicy())
    offloaded = entry_bytes_by_memory_space(offloaded_program.as_text())
    shard_bytes = layers * width * width * 4 // 8
    assert offloaded["host"] == {"arguments": shard_bytes, "outputs": shard_bytes}  # params in, grads out
    assert on_device["device"]["arguments"] - offloaded["device"]["arguments"] == shard_bytes
    assert on_device["device"]["outputs"] - offloaded["device"]["outputs"] == shard_bytes


def _primitives(jaxpr, inside_scan=False):
    """(primitive name, params, inside a scan body) of every equation, recursively."""
    for eqn in jaxpr.eqns:
        yield eqn.primitive.name, eqn.params, inside_scan
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _primitives(sub, inside_scan or eqn.primitive.name == "scan")


def test_stacked_shards_move_to_device_inside_the_scan_body():
    # XLA:CPU lowers memory moves to nothing (host and device memory are the same RAM);
    # on GPU/TPU each becomes a MoveToDevice / MoveToHost at this place in the program.
    params = {"w": jnp.ones((4, 16, 16)) * 0.1}
    policy = js.FullyShardPolicy(scan_axis=0, reshard_after_forward=True, offload_policy=js.CPUOffloadPolicy())
    sharded = js.fully_shard(params, policy=policy)

    def stack_loss(p, x):
        h, _ = js.scan(lambda h, layer: (jnp.tanh(h @ layer["w"]), None), x, p)
        return jnp.mean(h**2)

    jaxpr = jax.make_jaxpr(js.value_and_grad(stack_loss, unshard_params=False))(sharded, jnp.ones((32, 16)))
    moves = [(str(params["devices"]), inside) for name, params, inside in _primitives(jaxpr.jaxpr)
             if name == "device_put"]
    to_device = [inside for where, inside in moves if "Device" in where]
    to_host = [inside for where, inside in moves if "Host" in where]
    assert to_device and all(to_device), moves  # forward and the backward re-gather, per layer
    assert to_host and all(to_host), moves  # each layer's reduced gradient, in its backward iteration
