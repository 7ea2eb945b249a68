"""shard_optimizer: Optax on sharded parameters equals Optax on unsharded ones, step by step."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_zero_padding, max_diff
from jax.sharding import AxisType

import jshard as js
from jshard._sharding.unit import map_unit_leaves
from jshard.optim import shard_optimizer

SHAPES = {"a": (7, 15), "b": (16, 17), "c": (1,)}
STEPS = 10
TOLERANCE = 2e-6  # float32 parameters of magnitude ~1: a few ulps of gradient summation order

OPTIMIZERS = {
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adamw": lambda: optax.adamw(0.05, weight_decay=0.1),
    "lion": lambda: optax.lion(0.01, weight_decay=0.1),
    "adafactor": lambda: optax.adafactor(0.05, min_dim_size_to_factor=4),
    "lamb": lambda: optax.lamb(0.05),
    "clip_chain": lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adam(0.05)),
}
MESHES = {"fsdp8": lambda: js.make_mesh(), "hsdp2x4": lambda: js.make_mesh(replicate=2)}


def _optax_promotion():
    """Optax mixes Python floats with int32 step counts, which strict promotion (conftest) rejects."""
    return jax.numpy_dtype_promotion("standard")


def _params():
    rng = np.random.default_rng(0)
    a, b, c = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in SHAPES.values())
    return {"block": {"a": a}, "b": b, "c": c}


def _batch(step):
    rng = np.random.default_rng(100 + step)
    return {"x": jnp.asarray(rng.normal(size=(16, 7)), jnp.float32),
            "y": jnp.asarray(rng.normal(size=(16, 16)), jnp.float32)}


def _loss(p, batch):
    h = jnp.sin(batch["x"] @ p["block"]["a"])
    z = jnp.tanh(batch["y"] @ p["b"])
    return jnp.mean(h**2) + jnp.mean(z) * p["c"][0] + jnp.sum(p["c"] ** 2)


def _shard(mesh):
    params = _params()
    block = js.fully_shard(params["block"], mesh)
    return js.fully_shard({"block": block, "b": params["b"], "c": params["c"]}, mesh)


def _run(tx, sharded, steps=STEPS):
    """Yield (params, state) after each step of js.value_and_grad + tx under jit."""
    with _optax_promotion():
        state = tx.init(sharded)
    grad_fn = js.value_and_grad(_loss)

    @jax.jit
    def step(p, s, batch):
        _, grads = grad_fn(p, batch)
        with _optax_promotion():
            updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    for i in range(steps):
        sharded, state = step(sharded, state, _batch(i))
        yield sharded, state


@functools.cache
def _reference(name):
    """Unsharded parameters and states after each step of the same optimizer."""
    tx = OPTIMIZERS[name]()
    with _optax_promotion():
        params, state = _params(), tx.init(_params())

    @jax.jit
    def step(p, s, batch):
        grads = jax.grad(_loss)(p, batch)
        with _optax_promotion():
            updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    out = []
    for i in range(STEPS):
        params, state = step(params, state, _batch(i))
        out.append((params, state))
    return out


def _host(tree):
    """The leaves of ``tree`` on the host, padding sliced off (cheaper per step than js.unshard)."""

    def host(meta, layout, x):
        x = np.asarray(x)
        return x if layout is None or not layout.padding else np.take(x, range(layout.shape[layout.dim]), layout.dim)

    return jax.tree.leaves(map_unit_leaves(host, tree))


def _max_error(sharded, reference):
    """Largest absolute difference between the unpadded leaves of ``sharded`` and those of ``reference``
    (``inf`` where either is not finite)."""
    return max_diff(_host(sharded), jax.tree.leaves(reference))


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_matches_unsharded_reference_every_step(name, mesh_name):
    tx = shard_optimizer(OPTIMIZERS[name](), min_size_to_shard=8)
    for (params, state), (ref_params, ref_state) in zip(_run(tx, _shard(MESHES[mesh_name]())), _reference(name),
                                                        strict=True):
        assert _max_error(params, ref_params) < TOLERANCE
        assert _max_error(state, ref_state) < TOLERANCE  # the state too, at its own layouts
        assert_zero_padding(params, state)


def test_plain_adafactor_sees_the_padding():
    """Without the wrapper, Adafactor's means count padding rows (Auto axes, where it runs at all)."""
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    (params, _), = _run(OPTIMIZERS["adafactor"](), _shard(mesh), steps=1)
    assert _max_error(params, _reference("adafactor")[0][0]) > 1e-3
    (params, _), = _run(shard_optimizer(OPTIMIZERS["adafactor"]()), _shard(mesh), steps=1)
    assert _max_error(params, _reference("adafactor")[0][0]) < TOLERANCE


def _types(tree):
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, [jax.typeof(x) for x in leaves], [x.sharding for x in leaves]


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_state_types_same_after_init_update_and_jit(name):
    tx = shard_optimizer(OPTIMIZERS[name](), min_size_to_shard=8)
    params = _shard(js.make_mesh())
    grads = jax.tree.map(lambda x: x * 0.5, params)
    with _optax_promotion():
        state0 = tx.init(params)
        _, state1 = tx.update(grads, state0, params)
        state2 = jax.jit(tx.init)(params)
        updates, state3 = jax.jit(tx.update)(grads, state0, params)
    assert _types(state0) == _types(state1) == _types(state2) == _types(state3)
    assert _types(updates)[1] == _types(params)[1]


def test_state_mirrors_parameter_sharding():
    tx = shard_optimizer(OPTIMIZERS["adamw"]())
    params = _shard(js.make_mesh(replicate=2))
    with _optax_promotion():
        mu = tx.init(params)[0].mu
    assert jax.tree.structure(mu) == jax.tree.structure(params)  # same unit metas: tree_map(params, mu) works
    for p, m in zip(jax.tree.leaves(params), jax.tree.leaves(mu), strict=True):
        assert jax.typeof(m) == jax.typeof(p) and m.sharding.is_equivalent_to(p.sharding, p.ndim)


def _factored(min_size_to_shard):
    tx = shard_optimizer(optax.adafactor(0.1, min_dim_size_to_factor=4), min_size_to_shard=min_size_to_shard)
    with _optax_promotion():
        state = tx.init(_shard(js.make_mesh()))
    return {k: getattr(state[0], k) for k in ("v_row", "v_col", "v")}


def test_factored_state_placement():
    """(16, 17) factors into v_row (16,) and v_col (17,); (7, 15) into (7,) and (15,); (1,) placeholders."""
    spec = lambda x: (x.shape, tuple(x.sharding.spec))  # noqa: E731
    small = _factored(min_size_to_shard=8)
    assert spec(small["v_row"]["b"]) == ((16,), ("fsdp",))
    assert spec(small["v_col"]["b"]) == ((24,), ("fsdp",))  # 17 padded to a multiple of 8
    assert spec(small["v_col"]["block"]["a"]) == ((16,), ("fsdp",))
    assert spec(small["v_row"]["block"]["a"]) == ((7,), (None,))  # 7 < 8 elements: replicated
    assert spec(small["v"]["b"]) == ((1,), (None,))
    assert spec(small["v"]["c"]) == ((8,), ("fsdp",))  # c is (1,): not factored, mirrors its parameter
    default = _factored(min_size_to_shard=1024)
    factored = [default[k]["b"] for k in ("v_row", "v_col")] + [default[k]["block"]["a"] for k in ("v_row", "v_col")]
    assert [spec(x) for x in factored] == [((16,), (None,)), ((17,), (None,)), ((7,), (None,)), ((15,), (None,))]
    assert spec(default["v_row"]["c"]) == ((8,), ("fsdp",))  # c's (1,) placeholder has c's shape: laid out like c
    assert js.unshard(small)["v_col"]["b"].shape == (17,)


def test_offloaded_state_stays_in_host_memory():
    policy = js.FullyShardPolicy(offload_policy=js.CPUOffloadPolicy())
    params = js.fully_shard({"w": jnp.ones((7, 3))}, policy=policy)
    tx = shard_optimizer(optax.adafactor(0.1, min_dim_size_to_factor=2), min_size_to_shard=4)
    with _optax_promotion():
        state = tx.init(params)
        updates, state = tx.update(params, state, params)
        ref_updates, _ = optax.adafactor(0.1, min_dim_size_to_factor=2).update(
            {"w": jnp.ones((7, 3))}, optax.adafactor(0.1).init({"w": jnp.ones((7, 3))}), {"w": jnp.ones((7, 3))})
    kinds = jax.tree.leaves(map_unit_leaves(
        lambda m, layout, x: (layout is not None and layout.sharded, x.sharding.memory_kind), state))
    assert set(zip(kinds[::2], kinds[1::2], strict=True)) == {(True, "pinned_host"), (False, "device")}
    assert updates["w"].sharding.memory_kind == "pinned_host"
    assert _max_error(updates, ref_updates) < TOLERANCE


def test_extra_args_reach_the_transformation():
    def init(params):
        return optax.EmptyState()

    def update(updates, state, params=None, *, scale, fn):
        return jax.tree.map(lambda g: fn(g) * scale, updates), state

    tx = shard_optimizer(optax.GradientTransformationExtraArgs(init, update))
    params = _shard(js.make_mesh())
    updates, _ = tx.update(params, tx.init(params), params, scale=jnp.float32(2.0), fn=jnp.negative)
    assert _max_error(updates, jax.tree.map(lambda x: -2 * x, _params())) == 0


def test_errors_name_the_leaf_and_the_fix():
    tx = shard_optimizer(optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"without any FSDPUnit.*use the Optax transformation directly"):
        tx.init({"w": jnp.ones((3,))})
    with pytest.raises(ValueError, match=r"Leaf \['b'\] of shape \(2,\) in `params` belongs to no unit.*fully_shard"):
        tx.init({"a": js.fully_shard({"w": jnp.ones((3,))}), "b": jnp.ones((2,))})
    with pytest.raises(ValueError, match=r"different meshes.*same mesh"):
        hsdp = js.fully_shard({"w": jnp.ones((3,))}, js.make_mesh(replicate=2))
        tx.init([js.fully_shard({"w": jnp.ones((3,))}), hsdp])
    with pytest.raises(ValueError, match="`min_size_to_shard` must be a positive int"):
        shard_optimizer(optax.sgd(0.1), min_size_to_shard=0)
