"""Units on different data-parallel axes of one mesh: dense units sharded over every device,
expert units over ``data`` only with their weights split over ``expert``, tokens dispatched with
``all_to_all`` in the loss ([Note: step axes])."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jshard as js
from jshard._report.hlo import hlo_collectives
from jshard.checkpoint import CheckpointManager
from jshard.optim import shard_optimizer
from jshard.state_dict import full_state_dict

E, D_IN, D, F, D_OUT, TOKENS = 4, 5, 6, 10, 3, 16


def _mesh(data: int) -> Mesh:
    return Mesh(np.asarray(jax.devices()).reshape(data, 8 // data), ("data", "expert"))


def _params() -> dict:
    rng = np.random.default_rng(0)
    f32 = lambda scale, *shape: (rng.normal(size=shape) * scale).astype(np.float32)  # noqa: E731
    return {
        "w_in": f32(0.5, D_IN, D),
        "router": f32(1.0, D, E),
        "w_out": f32(0.5, D, D_OUT),
        "experts": {  # w1, w2 split over `expert` on dim 0; `scale` stored whole on every expert device
            "w1": f32(0.3, E, D, F),
            "w2": f32(0.3, E, F, D),
            "scale": 1.0 + f32(0.1, D),
        },
    }


def _batch() -> dict:
    rng = np.random.default_rng(1)
    return {"x": rng.normal(size=(TOKENS, D_IN)).astype(np.float32),
            "y": rng.normal(size=(TOKENS, D_OUT)).astype(np.float32)}


def _sharded(params: dict, mesh: Mesh, unit_collectives: bool = False):
    experts = params["experts"]
    split = {name: jax.device_put(experts[name], NamedSharding(mesh, P("expert"))) for name in ("w1", "w2")}
    on_data = js.FullyShardPolicy(dp_mesh_dims=js.DataParallelMeshDims(shard="data"), unit_collectives=unit_collectives)
    unit = js.fully_shard({**split, "scale": experts["scale"]}, mesh, on_data)
    dense = js.FullyShardPolicy(dp_mesh_dims=js.DataParallelMeshDims(shard=("data", "expert")))
    return js.fully_shard({**{k: v for k, v in params.items() if k != "experts"}, "experts": unit}, mesh, dense)


def _loss(p: dict, batch: dict, expert_axis: str | None = None) -> jax.Array:
    """A top-2 MoE layer between two dense layers. With ``expert_axis``, each device holds
    E / M experts and exchanges tokens with ``all_to_all``; without, all experts are local."""
    h = jnp.tanh(batch["x"] @ p["w_in"])
    gates, idx = jax.lax.top_k(jax.nn.softmax(h @ p["router"]), 2)
    combine = jnp.einsum("tk,tke->te", gates, jax.nn.one_hot(idx, E))
    dispatch = jnp.einsum("tke->te", jax.nn.one_hot(idx, E))
    xe = jnp.einsum("te,td->etd", dispatch, h * p["experts"]["scale"])  # (E, T, D)
    if expert_axis:
        xe = jax.lax.all_to_all(xe, expert_axis, 0, 1, tiled=True)  # (E / M, M * T, D): my experts' tokens
    out = jax.nn.relu(jnp.einsum("etd,edf->etf", xe, p["experts"]["w1"]))
    out = jnp.einsum("etf,efd->etd", out, p["experts"]["w2"])
    if expert_axis:
        out = jax.lax.all_to_all(out, expert_axis, 1, 0, tiled=True)  # back to (E, T, D)
    pred = (h + jnp.einsum("te,etd->td", combine, out)) @ p["w_out"]
    return jnp.mean((pred - batch["y"]) ** 2)


@functools.cache
def _reference(steps: int) -> tuple[list[float], dict]:
    """The unsharded model on one device, no collectives: losses and parameters after ``steps``."""
    tx, params, batch = optax.sgd(0.1, momentum=0.9), _params(), _batch()

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(_loss)(params, batch)
        updates, state = tx.update(grads, state, params)
        return loss, optax.apply_updates(params, updates), state

    state, losses = tx.init(params), []
    for _ in range(steps):
        loss, params, state = step(params, state)
        losses.append(float(loss))
    return losses, params


@pytest.mark.parametrize("data", [2, 4])
def test_moe_parity_with_unsharded_reference(data):
    """SGD with momentum, 3 steps, on (data 2 x expert 4) and (data 4 x expert 2)."""
    mesh, params, batch = _mesh(data), _params(), _batch()
    ref_losses, ref = _reference(3)
    tx = shard_optimizer(optax.sgd(0.1, momentum=0.9))
    sharded = _sharded(params, mesh)
    state = tx.init(sharded)

    @jax.jit
    def step(sharded, state, batch):
        loss, grads = js.value_and_grad(lambda p, b: _loss(p, b, "expert"))(sharded, batch)
        updates, state = tx.update(grads, state, sharded)
        return loss, optax.apply_updates(sharded, updates), state

    losses = []
    for _ in range(3):
        loss, sharded, state = step(sharded, state, batch)
        losses.append(float(loss))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), js.unshard(sharded), ref)
    assert sharded["experts"]["w1"].sharding.spec == P("expert", "data")


def test_moe_step_reduces_each_unit_over_its_own_axes():
    """Expert gradients are reduce-scattered over groups of `data` (2), dense ones over all 8;
    `scale`, stored whole on every expert device, is all-reduced over `expert` (4) after its
    reduce-scatter over `data`; the tokens travel by all-to-all."""
    mesh = _mesh(2)
    sharded, batch = _sharded(_params(), mesh), _batch()
    grad_fn = js.value_and_grad(lambda p, b: _loss(p, b, "expert"))
    hlo = jax.jit(grad_fn).lower(sharded, batch).compile().as_text()
    found = hlo_collectives(hlo)
    sizes = {kind: sorted({len(c.replica_groups.split("},{")[0].split(",")) for c in found if c.kind == kind})
             for kind in ("reduce-scatter", "all-to-all", "all-reduce")}
    scatters = [c for c in found if c.kind == "reduce-scatter"]
    by_size = {n: sum(len(c.replica_groups.split("},{")[0].split(",")) == n for c in scatters) for n in (2, 8)}
    assert by_size == {2: 3, 8: 3}, [(c.shapes, c.replica_groups) for c in scatters]
    assert sizes["all-to-all"] == [4]
    assert 4 in sizes["all-reduce"]


def test_unit_buffer_keeps_leaves_reduced_over_different_axes_apart():
    """With ``unit_collectives``, `scale` (all-reduced over `expert` too) shares no buffer with
    `w1` and `w2` (reduced over `data` only)."""
    params, batch = _params(), _batch()
    want = jax.jit(jax.grad(_loss))(params, batch)
    sharded = _sharded(params, _mesh(2), unit_collectives=True)
    _, grads = jax.jit(js.value_and_grad(lambda p, b: _loss(p, b, "expert")))(sharded, batch)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), js.unshard(grads), want)


TRANSFORMATIONS = {  # each reads parameters or gradients across leaves, or keeps state unlike them
    "clip_by_global_norm": lambda: optax.clip_by_global_norm(0.05),  # one norm over every unit
    "lamb": lambda: optax.lamb(0.1),  # a trust ratio per leaf: norms of whole expert leaves
    "adafactor": lambda: optax.adafactor(0.1, min_dim_size_to_factor=4),  # factored moments, not parameter-shaped
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMATIONS))
def test_optax_transformations_are_exact_across_units_on_different_axes(name):
    """``js.shard_optimizer`` over expert units (over ``data``, split over ``expert``) beside dense
    ones (over both): three updates equal the unsharded ones."""
    mesh, params, batch = _mesh(2), _params(), _batch()
    grads = jax.jit(jax.grad(_loss))(params, batch)
    tx, sharded_tx = TRANSFORMATIONS[name](), shard_optimizer(TRANSFORMATIONS[name]())
    sharded, sharded_grads = _sharded(params, mesh), _sharded(grads, mesh)
    with jax.numpy_dtype_promotion("standard"):  # as Optax runs (lamb adds a Python float to a step count)
        state, sharded_state = tx.init(params), sharded_tx.init(sharded)
        update, sharded_update = jax.jit(tx.update), jax.jit(sharded_tx.update)
        for _ in range(3):
            updates, state = update(grads, state, params)
            params = optax.apply_updates(params, updates)
            sharded_updates, sharded_state = sharded_update(sharded_grads, sharded_state, sharded)
            sharded = optax.apply_updates(sharded, sharded_updates)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), js.unshard(sharded), params)


def test_units_on_two_meshes_are_refused_with_how_to_build_one():
    params = _params()
    dense = js.fully_shard({"w_in": params["w_in"]}, js.make_mesh())
    other = js.fully_shard({"w_out": params["w_out"]}, _mesh(2),
                           js.FullyShardPolicy(dp_mesh_dims=js.DataParallelMeshDims(shard="data")))
    root = js.fully_shard({"a": dense, "b": other}, js.make_mesh())
    with pytest.raises(ValueError, match=r"Units of one step must share a mesh, got units on different meshes: mesh "
                                         r"\{'data': 2, 'expert': 4\}.* beside mesh \{'fsdp': 8\}.*"
                                         r"jax.make_mesh\(\(2, 4\), \('data', 'expert'\)\)"):
        js.value_and_grad(lambda p, b: 0.0)(root, _batch())


def test_batch_must_divide_over_the_union_of_the_units_axes():
    sharded = _sharded(_params(), _mesh(2))
    batch = jax.tree.map(lambda x: x[:12], _batch())
    with pytest.raises(ValueError, match=r"Batch leaf \['x'\] of shape \(12, 5\): dim 0 is split over the "
                                         r"data-parallel mesh axes \('data', 'expert'\) \(size 8\)"):
        js.value_and_grad(lambda p, b: _loss(p, b, "expert"))(sharded, batch)


def test_expert_dim_the_expert_axis_does_not_divide_is_refused():
    mesh = _mesh(2)
    w = jax.ShapeDtypeStruct((6, D, F), jnp.float32, sharding=NamedSharding(mesh, P("expert")))
    on_data = js.FullyShardPolicy(dp_mesh_dims=js.DataParallelMeshDims(shard="data"))
    with pytest.raises(ValueError, match=r"\['w1'\].*\(6, 6, 10\).*dim 0 \(size 6\) arrives split over model axes "
                                         r"\('expert',\) \(size 4\), which does not divide it"):
        js.fully_shard({"w1": w}, mesh, on_data)


@pytest.mark.parametrize("target", ["data 4 x expert 2", "one device"])
def test_checkpoint_round_trip_onto_another_expert_degree(tmp_path, target):
    """Saved on (data 2 x expert 4), restored exactly on (data 4 x expert 2) and on one device
    (data 1 x expert 1), momentum included."""
    tx = shard_optimizer(optax.sgd(0.1, momentum=0.9))
    saved_params = _sharded(_params(), _mesh(2))
    grads = jax.tree.map(lambda x: x * 0.5, saved_params)
    _, state = tx.update(grads, tx.init(saved_params), saved_params)
    for trace, param in zip(jax.tree.leaves(state[0].trace), jax.tree.leaves(saved_params), strict=True):
        assert trace.sharding == param.sharding  # each state leaf on its own unit's axes
    saved = {"params": saved_params, "opt_state": state}
    with CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, saved)
    mesh = _mesh(4) if target != "one device" else Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "expert"))
    like_params = _sharded(jax.tree.map(jnp.zeros_like, _params()), mesh)
    like = {"params": like_params, "opt_state": tx.init(like_params)}
    with CheckpointManager(tmp_path) as ckpt:
        restored = ckpt.restore(like)
    assert restored["params"]["experts"]["w1"].sharding == like_params["experts"]["w1"].sharding
    got, want = full_state_dict(restored), full_state_dict(saved)
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_leaf_split_over_a_step_axis_on_its_fsdp_dim_is_refused():
    mesh = _mesh(2)
    bias = jax.device_put(np.zeros(8, np.float32), NamedSharding(mesh, P("expert")))  # FSDP can only split dim 0 too
    on_data = js.FullyShardPolicy(dp_mesh_dims=js.DataParallelMeshDims(shard="data"))
    root = js.fully_shard({"bias": js.fully_shard(bias, mesh, on_data), "w": np.ones((8, 3), np.float32)}, mesh,
                          js.FullyShardPolicy(dp_mesh_dims=js.DataParallelMeshDims(shard=("data", "expert"))))
    with pytest.raises(ValueError, match=r"Leaf \['bias'\] of shape \(8,\) is split over mesh axes \('expert',\) "
                                         r"\(size 4\) on its FSDP placement dim 0.*`shard_placement_fn`"):
        js.value_and_grad(lambda p, b: 0.0)(root, _batch())
