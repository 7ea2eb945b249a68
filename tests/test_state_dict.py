"""Full state dicts (unpadded NumPy on the host) and sharded ones (the stored arrays) of params and optimizer states."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jshard as js
from jshard.optim import shard_optimizer
from jshard.state_dict import full_state_dict, load_full_state_dict, load_sharded_state_dict, sharded_state_dict


def _params():
    rng = np.random.default_rng(0)
    f32 = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    return {"block": {"w": f32(7, 15), "b": f32(10, 3)}, "head": f32(16, 17), "scale": np.float32(2.0),
            "ids": np.arange(5, dtype=np.int32)}


def _shard(params, mesh, policy=None):
    block = js.fully_shard(params["block"], mesh, policy)
    return js.fully_shard({**params, "block": block}, mesh, policy)


def _assert_tree_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert isinstance(g, np.ndarray) and g.dtype == np.asarray(w).dtype
        np.testing.assert_array_equal(g, np.asarray(w))


def _assert_same_stored(got, want):
    """Same structure (unit metas included), shapes, shardings and values, padding included."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert jax.typeof(g) == jax.typeof(w) and g.sharding.is_equivalent_to(w.sharding, g.ndim)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


POLICIES = {
    "fsdp8": (lambda: js.make_mesh(), None),
    "hsdp2x4": (lambda: js.make_mesh(replicate=2), None),
    "offload": (lambda: js.make_mesh(), js.FullyShardPolicy(offload_policy=js.CPUOffloadPolicy())),
    "last_dim": (lambda: js.make_mesh(), js.FullyShardPolicy(shard_placement_fn=lambda p, x: -1 if x.ndim else None)),
}


@pytest.mark.parametrize("name", POLICIES)
def test_full_state_dict_is_the_unpadded_tree_on_host(name):
    mesh, policy = POLICIES[name]
    sharded = _shard(_params(), mesh(), policy)
    full = full_state_dict(sharded)
    _assert_tree_equal(full, _params())
    _assert_same_stored(load_full_state_dict(full, sharded), sharded)


def test_full_state_dict_loads_onto_any_mesh():
    full = full_state_dict(_shard(_params(), js.make_mesh()))
    for mesh in (js.make_mesh(devices=jax.devices()[:4]), js.make_mesh(replicate=2)):
        like = _shard(jax.tree.map(np.zeros_like, _params()), mesh)
        loaded = load_full_state_dict(full, like)
        _assert_same_stored(loaded, _shard(_params(), mesh))
        assert loaded["block"]["b"].shape == (12, 3)  # 10 rows padded for 4 shards (16 on the 8-device mesh)


def test_loading_copies_only_each_devices_rows(monkeypatch):
    """No device receives a whole leaf: the host hands each device its own rows."""
    like = _shard(jax.tree.map(np.zeros_like, _params()), js.make_mesh())
    requested = []
    original = jax.make_array_from_callback

    def spy(shape, sharding, callback):
        return original(shape, sharding, lambda index: requested.append((shape, index)) or callback(index))

    monkeypatch.setattr(jax, "make_array_from_callback", spy)
    load_full_state_dict(_params(), like)
    rows = {(shape, idx[0].start, idx[0].stop) for shape, idx in requested if shape == (16, 17)}
    assert rows == {((16, 17), 2 * i, 2 * (i + 1)) for i in range(8)}


def test_process0_only(monkeypatch):
    sharded = _shard(_params(), js.make_mesh())
    _assert_tree_equal(full_state_dict(sharded, process0_only=True), _params())
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    assert full_state_dict(sharded, process0_only=True) is None
    _assert_tree_equal(full_state_dict(sharded), _params())


def _train(tx, params, steps=3):
    @jax.jit
    def step(params, state, scale):
        updates, state = tx.update(jax.tree.map(lambda x: x * scale, params), state, params)
        return optax.apply_updates(params, updates), state

    params = jax.tree.map(jnp.asarray, params)
    state = tx.init(params)
    for i in range(steps):
        params, state = step(params, state, jnp.float32(0.5 + i))
    return params, state


def _optimizer():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adafactor(0.05, min_dim_size_to_factor=3))


def test_optimizer_state_round_trips_and_equals_unsharded_optax():
    with jax.numpy_dtype_promotion("standard"):  # Optax mixes Python floats with int32 counts
        params = {"block": _params()["block"], "head": _params()["head"]}
        ref_params, ref_state = _train(_optimizer(), params)
        sharded, state = _train(shard_optimizer(_optimizer(), min_size_to_shard=8), _shard(params, js.make_mesh()))
        full = full_state_dict(state)
        assert jax.tree.structure(full) == jax.tree.structure(ref_state)  # the plain Optax state's structure
        for got, want in zip(jax.tree.leaves(full), jax.tree.leaves(ref_state), strict=True):
            np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
        like = shard_optimizer(_optimizer(), min_size_to_shard=8).init(_shard(params, js.make_mesh(replicate=2)))
        loaded = load_full_state_dict(full, like)
        _assert_tree_equal(full_state_dict(loaded), full)
        assert jax.tree.structure(loaded) == jax.tree.structure(like)


def test_plain_optax_factored_state_is_refused_with_the_fix():
    mesh = js.make_mesh()
    sharded = _shard({"block": _params()["block"]}, mesh)
    with jax.numpy_dtype_promotion("standard"), jax.set_mesh(mesh):  # plain Optax needs the mesh context here
        state = optax.adafactor(0.1, min_dim_size_to_factor=3).init(sharded)
    with pytest.raises(ValueError, match=r"Leaf \[0\]\.v_row\['block'\]\['b'\]: the stored array has shape \(3,\).*"
                                         r"shard_optimizer"):
        full_state_dict(state)


def test_sharded_state_dict_moves_nothing():
    sharded = _shard(_params(), js.make_mesh())
    sd = sharded_state_dict(sharded)
    assert jax.tree.structure(sd) == jax.tree.structure(_params())
    for got, stored in zip(jax.tree.leaves(sd), jax.tree.leaves(sharded), strict=True):
        assert got is stored
    loaded = load_sharded_state_dict(sd, sharded)
    assert jax.tree.structure(loaded) == jax.tree.structure(sharded)
    for got, stored in zip(jax.tree.leaves(loaded), jax.tree.leaves(sharded), strict=True):
        assert got is stored or not isinstance(stored, jax.Array)
    # A copy made elsewhere loads without moving either: the loaded shards are the copy's own buffers.
    copy = jax.tree.map(lambda x: x + 0 if isinstance(x, jax.Array) else x, sd)
    loaded = load_sharded_state_dict(copy, sharded)
    pointers = lambda x: [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]  # noqa: E731
    assert pointers(loaded["head"]) == pointers(copy["head"])


def test_errors_name_the_leaf_and_the_fix():
    sharded = _shard(_params(), js.make_mesh())
    wrong = _params()
    wrong["block"]["b"] = np.zeros((9, 3), np.float32)
    with pytest.raises(ValueError, match=r"Leaf \['block'\]\['b'\]: the full state dict has shape \(9, 3\).*"
                                         r"expects shape \(10, 3\)"):
        load_full_state_dict(wrong, sharded)
    wrong["block"]["b"] = np.zeros((10, 3), np.float64)
    with pytest.raises(ValueError, match=r"dtype float64.*dtype float32.*astype"):
        load_full_state_dict(wrong, sharded)
    with pytest.raises(ValueError, match=r"does not have the structure of `like`"):
        load_full_state_dict({"block": _params()["block"]}, sharded)
    other = _shard(_params(), js.make_mesh(devices=jax.devices()[:4]))
    with pytest.raises(ValueError, match=r"Leaf \['block'\]\['b'\]: the sharded state dict holds shape \(16, 3\).*"
                                         r"load_full_state_dict or jshard.checkpoint"):
        load_sharded_state_dict(sharded_state_dict(sharded), other)


def test_a_python_scalar_in_the_state_round_trips():
    """docs/checkpoint.md's state holds a Python int step; loading used to fail on its missing dtype."""
    like = {"params": js.fully_shard({"w": jnp.arange(10.0).reshape(5, 2)}), "step": 3}
    loaded = load_full_state_dict(full_state_dict(like), like)
    assert loaded["step"] == 3 and type(loaded["step"]) is int
    np.testing.assert_array_equal(js.unshard(loaded["params"])["w"], np.arange(10.0).reshape(5, 2))
