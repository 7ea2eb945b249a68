"""fully_shard / unshard / reshard in the global view: layout, units, meshes, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_torch_layout
from jax.sharding import AxisType, PartitionSpec

import jshard as js


def _params():
    rng = np.random.default_rng(0)
    return {
        "layer1": {"w": jnp.asarray(rng.normal(size=(7, 15)), jnp.float32), "b": jnp.arange(15.0)},
        "layer2": {"w": jnp.asarray(rng.normal(size=(16, 17)), jnp.bfloat16)},
        "one": jnp.ones((1,)),
        "ids": jnp.arange(5, dtype=jnp.int32),
        "scale": jnp.asarray(2.0),
    }


def _assert_equal_trees(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_layout_is_torch_chunk_with_zero_padding():
    params, mesh = _params(), js.make_mesh()
    sharded = js.fully_shard(params, mesh)
    assert sharded["layer1"]["w"].shape == (8, 15)
    assert sharded["layer2"]["w"].shape == (16, 17)
    assert sharded["ids"].shape == (8,) and sharded["ids"].dtype == jnp.int32
    assert sharded["scale"].shape == () and sharded["scale"].sharding.spec == PartitionSpec()
    for path in (("layer1", "w"), ("layer1", "b"), ("layer2", "w"), ("one",), ("ids",)):
        stored, original = sharded, params
        for key in path:
            stored, original = stored[key], original[key]
        assert stored.sharding.spec == PartitionSpec("fsdp")
        assert_torch_layout(stored, original, mesh, ("fsdp",), 0)


def test_round_trip_is_exact_eager_and_jit():
    params = _params()
    sharded = js.fully_shard(params)
    _assert_equal_trees(js.unshard(sharded), params)
    _assert_equal_trees(jax.jit(js.unshard)(sharded), params)
    _assert_equal_trees(jax.jit(lambda p: js.unshard(js.fully_shard(p)))(params), params)
    resharded = js.reshard(js.unshard(sharded), sharded)
    assert jax.tree.structure(resharded) == jax.tree.structure(sharded)
    _assert_equal_trees(resharded, sharded)
    for x in jax.tree.leaves(js.unshard(sharded)):
        assert x.sharding.is_fully_replicated


def test_leaves_correspond_one_to_one_in_order():
    params = _params()
    sharded = js.fully_shard(params)
    assert len(jax.tree.leaves(sharded)) == len(jax.tree.leaves(params))
    keys = [jax.tree_util.keystr(k) for k, _ in jax.tree.flatten_with_path(sharded)[0]]
    assert keys == [jax.tree_util.keystr(k) for k, _ in jax.tree.flatten_with_path(params)[0]]  # the user's paths
    assert keys[0] == "['ids']"


def test_shard_placement_fn_picks_any_dim():
    params = {"w": jnp.arange(6 * 5 * 3.0).reshape(6, 5, 3)}
    mesh = js.make_mesh(devices=jax.devices()[:4])
    policy = js.FullyShardPolicy(shard_placement_fn=lambda path, leaf: -2)
    sharded = js.fully_shard(params, mesh, policy)
    assert sharded["w"].shape == (6, 8, 3)
    assert sharded["w"].sharding.spec == PartitionSpec(None, "fsdp")
    assert_torch_layout(sharded["w"], params["w"], mesh, ("fsdp",), 1)
    _assert_equal_trees(js.unshard(sharded), params)


def test_nested_units_are_kept_by_the_root():
    params = _params()
    block = js.fully_shard(params["layer1"], policy=js.FullyShardPolicy(reshard_after_forward=False))
    root = js.fully_shard({**params, "layer1": block})
    assert root["layer1"] is block
    assert root["layer1"]["w"] is block["w"]
    assert root.meta.layouts.count(None) == 1
    _assert_equal_trees(js.unshard(root), params)
    _assert_equal_trees(js.reshard(params, root), root)


def test_a_list_of_subtrees_is_one_unit():
    a, b = {"w": jnp.ones((3, 2))}, {"w": jnp.zeros((9,))}
    unit = js.fully_shard([a, b])
    assert isinstance(unit, js.FSDPUnit) and len(unit.meta.layouts) == 2
    assert unit[1]["w"].shape == (16,)
    _assert_equal_trees(js.unshard(unit), [a, b])


def test_hsdp_mesh_shards_over_fsdp_and_replicates_over_replicate():
    params, mesh = _params(), js.make_mesh(replicate=2)
    sharded = js.fully_shard(params, mesh)
    w = sharded["layer1"]["w"]
    assert w.shape == (8, 15) and w.sharding.spec == PartitionSpec("fsdp")
    assert_torch_layout(w, params["layer1"]["w"], mesh, ("fsdp",), 0)
    _assert_equal_trees(js.unshard(sharded), params)


def test_user_mesh_with_dp_mesh_dims_and_multiple_shard_axes():
    mesh = jax.make_mesh((2, 2, 2), ("pod", "data", "model"))
    dims = js.DataParallelMeshDims(shard=("data", "model"), replicate="pod")
    params = {"w": jnp.arange(9 * 2.0).reshape(9, 2)}
    sharded = js.fully_shard(params, mesh, js.FullyShardPolicy(dp_mesh_dims=dims))
    assert sharded["w"].shape == (12, 2)
    assert sharded["w"].sharding.spec == PartitionSpec(("data", "model"))
    assert_torch_layout(sharded["w"], params["w"], mesh, ("data", "model"), 0)
    _assert_equal_trees(js.unshard(sharded), params)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_explicit_and_auto_meshes(axis_type):
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(axis_type,))
    params = _params()
    sharded = js.fully_shard(params, mesh)
    _assert_equal_trees(js.unshard(sharded), params)
    _assert_equal_trees(jax.jit(js.unshard)(sharded), params)
    assert_torch_layout(sharded["layer1"]["w"], params["layer1"]["w"], mesh, ("fsdp",), 0)


def test_abstract_inputs_plan_without_allocating():
    abstract = {"w": jax.ShapeDtypeStruct((1000, 7), jnp.float32), "s": jax.ShapeDtypeStruct((), jnp.float32)}
    sharded = js.fully_shard(abstract)
    assert isinstance(sharded["w"], jax.ShapeDtypeStruct)
    assert sharded["w"].shape == (1000, 7) and sharded["w"].sharding.spec == PartitionSpec("fsdp")
    odd = js.fully_shard({"w": jax.ShapeDtypeStruct((1001, 7), jnp.bfloat16)})
    assert odd["w"].shape == (1008, 7) and odd["w"].dtype == jnp.bfloat16
    full = js.unshard(odd)
    assert full["w"].shape == (1001, 7) and isinstance(full["w"], jax.ShapeDtypeStruct)


@pytest.mark.parametrize("pin", [True, False])
def test_cpu_offload_puts_shards_in_host_memory(pin):
    policy = js.FullyShardPolicy(offload_policy=js.CPUOffloadPolicy(pin_memory=pin))
    params = _params()
    sharded = js.fully_shard(params, policy=policy)
    kind = "pinned_host" if pin else "unpinned_host"
    for leaf in jax.tree.leaves(sharded):
        assert leaf.sharding.memory_kind == (kind if leaf.ndim else "device")  # 0-d leaves stay on the device
    full = js.unshard(sharded)
    assert all(leaf.sharding.memory_kind == "device" for leaf in jax.tree.leaves(full))
    _assert_equal_trees(full, params)


def test_ignored_params_pass_through_untouched():
    params = _params()
    policy = js.FullyShardPolicy(ignored_params=lambda path, leaf: "layer2" in jax.tree_util.keystr(path))
    sharded = js.fully_shard(params, policy=policy)
    assert sharded["layer2"]["w"] is params["layer2"]["w"]
    assert sharded["layer1"]["w"].shape == (8, 15)
    _assert_equal_trees(js.unshard(sharded), params)


def test_errors_name_the_leaf_shape_axis_and_fix():
    mesh = js.make_mesh()
    with pytest.raises(ValueError, match=r"empty pytree"):
        js.fully_shard({})
    sub = {"w": jnp.ones(3)}
    with pytest.raises(ValueError, match=r"Sub-tree \[1\] is the same object as sub-tree \[0\]"):
        js.fully_shard([sub, sub])
    with pytest.raises(ValueError, match=r"Leaf \['name'\], sharded over mesh axis 'fsdp' \(size 8\): a str is not an"):
        js.fully_shard({"name": "relu", "w": jnp.ones(3)})
    with pytest.raises(
        ValueError,
        match=r"Leaf \['w'\] of shape \(3, 4\), sharded over mesh axis 'fsdp' \(size 8\): placement dim 2 is out "
        r"of range for a 2-d leaf; return a dim in \[-2, 2\)",
    ):
        js.fully_shard({"w": jnp.ones((3, 4))}, policy=js.FullyShardPolicy(shard_placement_fn=lambda p, x: 2))
    with pytest.raises(ValueError, match=r"has no axis 'data' named in `dp_mesh_dims`"):
        js.fully_shard(sub, mesh, js.FullyShardPolicy(dp_mesh_dims=js.DataParallelMeshDims(shard="data")))
    two_axes = jax.make_mesh((2, 4), ("a", "b"))
    with pytest.raises(ValueError, match=r"has no axis 'fsdp' and more than one axis: pass `dp_mesh_dims="):
        js.fully_shard(sub, two_axes)
    with pytest.raises(RuntimeError, match=r"already fully sharded as a whole"):
        js.fully_shard(js.fully_shard(sub))
    with pytest.raises(ValueError, match=r"`reshard_after_forward=3` must divide the shard size"):
        js.fully_shard(sub, mesh, js.FullyShardPolicy(reshard_after_forward=3))
    stacked_dim = r"Leaf \['w'\] of shape \(4, 3\), sharded .*: placement dim 0 is the stacked layer axis"
    with pytest.raises(ValueError, match=stacked_dim):
        policy = js.FullyShardPolicy(scan_axis=0, shard_placement_fn=lambda p, x: 0)
        js.fully_shard({"w": jnp.ones((4, 3))}, policy=policy)
    with pytest.raises(ValueError, match=r"Leaf \['s'\] of shape \(\), .*no stacked layer axis 0"):
        js.fully_shard({"s": jnp.ones(())}, policy=js.FullyShardPolicy(scan_axis=0))
    sharded = js.fully_shard(sub)
    with pytest.raises(ValueError, match=r"Leaf \['w'\]: reshard got shape \(4,\) .* made from shape \(3,\)"):
        js.reshard({"w": jnp.ones(4)}, sharded)


def test_bad_input_leaves_original_untouched():
    params = {"w": jnp.ones((3, 4)), "bad": "x"}
    with pytest.raises(ValueError, match=r"Leaf \['bad'\].*a str is not an array"):
        js.fully_shard(params)
    assert params["w"].shape == (3, 4) and params["bad"] == "x"


def test_default_placement_avoids_a_dim_that_would_be_mostly_padding():
    """docs/design.md's placement rule: dim 0 unless more than half of the devices would hold only padding there
    while another dim is at least N; then the largest such dim (the first of equal ones)."""
    params = {
        "conv": jnp.ones((3, 3, 16, 32)),  # Flax (H, W, in, out): not split on H (5/8 of it would be zeros)
        "pointwise": jnp.ones((1, 1, 16, 16)),  # equal dims: the first
        "odd": jnp.ones((7, 15)),  # FSDP2's own shape keeps dim 0
        "small": jnp.ones((3, 5)),  # no other dim reaches N: dim 0
    }
    sharded = js.fully_shard(params)
    dims = {k: v.sharding.spec.index("fsdp") for k, v in sharded.tree.items()}
    assert dims == {"conv": 3, "pointwise": 2, "odd": 0, "small": 0}
    assert sharded["conv"].shape == (3, 3, 16, 32) and sharded["odd"].shape == (8, 15)
    stack = js.fully_shard({"k": jnp.ones((4, 1, 1, 8, 24))}, policy=js.FullyShardPolicy(scan_axis=0))
    assert stack["k"].sharding.spec.index("fsdp") == 4  # the rule on the dims after the layer axis
    assert jax.tree.all(jax.tree.map(jnp.array_equal, js.unshard(sharded), params))


def test_placement_fn_is_asked_only_about_leaves_with_a_dim_to_split():
    asked = []

    def place(path, leaf):
        asked.append(jax.tree_util.keystr(path))
        return 0

    sharded = js.fully_shard({"s": jnp.float32(2.0), "w": jnp.ones((3, 4)), "e": jnp.ones((0, 4))},
                             policy=js.FullyShardPolicy(shard_placement_fn=place))
    assert asked == ["['w']"]
    assert sharded["s"].shape == () and sharded["e"].shape == (0, 4)


def test_a_leaf_with_a_zero_size_dim_stays_replicated_and_trains():
    params = {"w": jnp.linspace(-1.0, 1.0, 32).reshape(4, 8), "e": jnp.zeros((0, 5))}
    sharded = js.fully_shard(params)
    assert sharded["e"].sharding.spec == jax.P()

    def loss_fn(p, x):
        return jnp.mean(jnp.tanh(x @ p["w"])) + jnp.sum(p["e"])

    loss, grads = jax.jit(js.value_and_grad(loss_fn))(sharded, jnp.ones((16, 4)))
    ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params, jnp.ones((16, 4)))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(js.unshard(grads)["w"], ref_grads["w"], rtol=1e-5, atol=1e-7)
    assert grads["e"].shape == (0, 5)
