"""FullyShardPolicy(unit_collectives=True): one all-gather and one reduce-scatter per unit."""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_zero_padding
from model import batches, init_params, shard, train_reference, train_sharded

import jshard as js
from jshard._report.hlo import hlo_collectives, lowered_collectives
from jshard._report.memory import Memory

STEPS = 5
UNIT = js.FullyShardPolicy(unit_collectives=True)


@pytest.fixture(scope="module")
def reference():
    return train_reference(init_params(), batches(STEPS))


def _check(reference, losses, sharded, grads, _state, tol=1e-5):
    ref_losses, ref_params = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=tol, atol=tol)
    for got, want in zip(jax.tree.leaves(js.unshard(sharded)), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)
    assert_zero_padding(sharded)
    assert_zero_padding(grads)


@pytest.mark.parametrize(
    ("replicate", "policy", "kwargs"),
    [
        (1, dataclasses.replace(UNIT, reshard_after_forward=True), {}),
        (2, dataclasses.replace(UNIT, reshard_after_forward=False), {}),
        (1, UNIT, {"microbatches": 2}),
        (2, dataclasses.replace(UNIT, offload_policy=js.CPUOffloadPolicy()), {"requires_all_reduce": False}),
        (1, dataclasses.replace(UNIT, shard_placement_fn=lambda path, x: x.ndim - 1 if x.ndim else None), {}),
    ],
    ids=["raf", "no-raf-hsdp", "microbatches", "offload-hsdp-all-reduce-once", "last-dim-placement"],
)
def test_training_matches_one_device(reference, replicate, policy, kwargs):
    """The test model (unrolled blocks, a js.scan stack, a root with (16, 17), (7, 15), (1,)
    and 0-d leaves) trained 5 SGD-momentum steps on 8 devices."""
    sharded = shard(init_params(), js.make_mesh(replicate=replicate), policy)
    offloaded = isinstance(policy.offload_policy, js.CPUOffloadPolicy)
    tx = js.offload_optimizer(optax.sgd(0.1, momentum=0.9)) if offloaded else None
    _check(reference, *train_sharded(sharded, batches(STEPS), tx, **kwargs))


def test_the_flat_buffer_follows_the_torus_in_phases(reference, monkeypatch):
    """On a v5p slice the unit's one reduce-scatter, and on v5p-128 and up its one all-gather,
    run one torus dimension at a time ([Note: torus phases]); forced here on CPU devices
    (last-dim placement too), they train the same."""
    import jshard._sharding.mesh as mesh_module

    monkeypatch.setattr(mesh_module, "gather_phases", lambda mesh, shard_axes: (2, 4))
    monkeypatch.setattr(mesh_module, "scatter_phases", lambda mesh, shard_axes: (4, 2))
    for policy in (UNIT, dataclasses.replace(UNIT, shard_placement_fn=lambda path, x: x.ndim - 1 if x.ndim else None)):
        sharded = shard(init_params(), js.make_mesh(), policy)
        assert sharded.meta.axes.gather_phases == (2, 4)
        _check(reference, *train_sharded(sharded, batches(STEPS)))


def _mixed_unit_step(policy, raf=False):
    """One unit of leaves with different shapes, placement dims and dtypes."""
    params = {"w": jnp.ones((7, 15)) * 0.1, "v": jnp.ones((16, 17)) * 0.2, "b": jnp.zeros((15,)),
              "h": jnp.ones((15, 16), jnp.bfloat16) * 0.1}
    dims = {"v": 1}
    policy = dataclasses.replace(policy, reshard_after_forward=raf,
                                 shard_placement_fn=lambda path, x: dims.get(path[-1].key))
    sharded = js.fully_shard(params, js.make_mesh(), policy)

    def loss(p, x):
        p = js.unshard(p)
        h = jnp.tanh(x @ p["w"] + p["b"]) @ p["h"].astype(x.dtype)
        return jnp.mean((h @ p["v"]).astype(jnp.float32) ** 2)

    return jax.jit(js.value_and_grad(loss, unshard_params=False)).lower(sharded, jnp.ones((16, 7)))


def _compiled_kinds(lowered):
    """Counts of the compiled program's gathers and reduce-scatters (XLA:CPU runs bf16 ones in
    f32, so their dtypes are read from the lowered program)."""
    kinds = (c.kind for c in hlo_collectives(lowered.compile().as_text()))
    return collections.Counter(k for k in kinds if k in ("all-gather", "reduce-scatter"))


def _lowered_kinds(lowered):
    return collections.Counter(k for k in lowered_collectives(lowered.as_text()) if k[0] != "all-reduce")


def test_one_gather_and_one_reduce_scatter_per_unit_in_param_and_reduce_dtypes():
    mp = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
    lowered = _mixed_unit_step(dataclasses.replace(UNIT, mp_policy=mp))
    assert _lowered_kinds(lowered) == {("all-gather", "bfloat16"): 1, ("reduce-scatter", "float32"): 1}
    assert _compiled_kinds(lowered) == {"all-gather": 1, "reduce-scatter": 1}
    per_leaf = _mixed_unit_step(js.FullyShardPolicy(mp_policy=mp))
    assert _compiled_kinds(per_leaf) == {"all-gather": 4, "reduce-scatter": 4}


def test_leaves_of_different_dtypes_share_a_collective_per_dtype():
    """Without a MixedPrecisionPolicy a bfloat16 leaf is gathered and reduced in bfloat16,
    so it cannot share float32's buffer: one collective of each kind per dtype."""
    lowered = _mixed_unit_step(UNIT)
    assert _lowered_kinds(lowered) == {("all-gather", "float32"): 1, ("reduce-scatter", "float32"): 1,
                                       ("all-gather", "bfloat16"): 1, ("reduce-scatter", "bfloat16"): 1}
    assert _compiled_kinds(lowered) == {"all-gather": 2, "reduce-scatter": 2}


def test_stacked_layers_gather_once_per_iteration():
    params = {"w": jnp.ones((4, 16, 16)) * 0.1, "b": jnp.zeros((4, 16)), "s": jnp.ones((4, 16))}
    sharded = js.fully_shard(params, js.make_mesh(), dataclasses.replace(UNIT, scan_axis=0, reshard_after_forward=True))

    def loss(p, x):
        h, _ = js.scan(lambda h, layer: (jnp.tanh(h @ layer["w"] + layer["b"]) * layer["s"], None), x, p)
        return jnp.mean(h**2)

    compiled = jax.jit(js.value_and_grad(loss, unshard_params=False)).lower(sharded, jnp.ones((32, 16))).compile()
    in_loops = collections.Counter(c.kind for c in hlo_collectives(compiled.as_text()) if c.in_loop)
    assert in_loops == {"all-gather": 2, "reduce-scatter": 1}  # forward, re-gather in backward; one reduction


def test_a_stacked_vector_alone_in_its_buffer_is_kept_as_per_leaf():
    """A bias stored in bfloat16 beside a float32 matrix has a buffer of its own (one leaf: gathered
    on its own). It stays gathered to backward as per leaf ([Note: loop residuals]): gathered once in
    forward, not again by the whole-loss checkpoint's recompute loop and the backward loop."""
    params = {"w": jnp.ones((4, 16, 16)) * 0.1, "b": jnp.zeros((4, 16), jnp.bfloat16)}

    def loss(p, x):
        h, _ = js.scan(lambda h, layer: (jnp.tanh(h @ layer["w"] + layer["b"].astype(jnp.float32)), None), x, p)
        return jnp.mean(h**2)

    def gathers(unit_collectives):
        policy = js.FullyShardPolicy(scan_axis=0, reshard_after_forward=True, unit_collectives=unit_collectives)
        sharded = js.fully_shard(params, js.make_mesh(), policy)
        compiled = jax.jit(js.value_and_grad(loss, unshard_params=False)).lower(sharded, jnp.ones((32, 16))).compile()
        return collections.Counter(c.shapes for c in hlo_collectives(compiled.as_text()) if c.kind == "all-gather")

    assert gathers(True) == gathers(False) == {((16,),): 1, ((16, 16),): 2}


def test_the_flat_buffer_costs_at_most_one_gathered_layer_and_one_layer_of_gradient():
    """The documented cost: temporaries grow by at most one gathered layer (copy-out) plus one
    layer of gradient (copy-in); measured on 8 layers of (256, 256) + (256,)."""
    layers, width = 8, 256
    params = {"w": jnp.ones((layers, width, width)) * 0.01, "b": jnp.zeros((layers, width))}

    def loss(p, x):
        h, _ = js.scan(lambda h, layer: (jnp.tanh(h @ layer["w"] + layer["b"]), None), x, p)
        return jnp.mean(h**2)

    def temp(unit_collectives):
        policy = js.FullyShardPolicy(scan_axis=0, reshard_after_forward=True, unit_collectives=unit_collectives)
        sharded = js.fully_shard(params, js.make_mesh(), policy)
        step = jax.jit(js.value_and_grad(loss, unshard_params=False))
        return Memory.from_compiled(step.lower(sharded, jnp.ones((64, width))).compile()).temp

    layer_bytes = (width * width + width) * 4
    extra = temp(True) - temp(False)
    assert 0 <= extra <= 2 * layer_bytes


def test_the_flag_is_checked():
    with pytest.raises(ValueError, match=r"`unit_collectives` must be a bool, got 'yes'"):
        js.FullyShardPolicy(unit_collectives="yes")
