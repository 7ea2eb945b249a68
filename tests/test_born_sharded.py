"""Born sharded: ``js.fully_shard`` traced inside ``jax.jit`` gives the eager layout and values,
each device computing only its own rows ([Note: born sharded])."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from jax_behaviour import ZEROS_DROP_THE_SPLIT, zeros_follow_explicit_types

import jshard as js

LAYERS, WIDTH, HIDDEN = 3, 20, 36  # odd sizes: every leaf is padded on 8 devices
MEMORY_MINIMISING = {"xla_cpu_enable_concurrency_optimized_scheduler": False}


def init(key, width=WIDTH, hidden=HIDDEN):
    k1, k2, k3 = jax.random.split(key, 3)
    blocks = {"up": jax.random.normal(k1, (LAYERS, width, hidden)),
              "down": jax.random.normal(k2, (LAYERS, hidden, width)), "bias": jnp.zeros((LAYERS, hidden))}
    return {"blocks": blocks, "head": jax.random.normal(k3, (width, 10)), "scale": jnp.ones(())}


def shard(params, mesh, policy=None):
    """Blocks stacked along axis 0 first, then the root (FSDP2's order)."""
    policy = policy or js.FullyShardPolicy()
    params = dict(params, blocks=js.fully_shard(params["blocks"], mesh, dataclasses.replace(policy, scan_axis=0)))
    return js.fully_shard(params, mesh, policy)


def sharded_init(mesh, policy=None, **sizes):
    return lambda key: shard(init(key, **sizes), mesh, policy)


_init_on_one_device = jax.jit(init)


def auto_mesh():
    return jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))


MESHES = {
    "explicit": lambda: js.make_mesh(),
    "auto": auto_mesh,
    "hsdp": lambda: js.make_mesh(replicate=2),
    "four_devices": lambda: js.make_mesh(devices=jax.devices()[:4]),
}


@pytest.mark.parametrize("mesh_name, offload", [("explicit", False), ("explicit", True), ("auto", False),
                                                ("auto", True), ("hsdp", False), ("four_devices", False)])
def test_jit_init_has_the_eager_layout_and_values(mesh_name, offload):
    mesh = MESHES[mesh_name]()
    policy = js.FullyShardPolicy(offload_policy=js.CPUOffloadPolicy() if offload else js.OffloadPolicy())
    key = jax.random.key(3)
    traced = jax.jit(sharded_init(mesh, policy))(key)
    eager = shard(_init_on_one_device(key), mesh, policy)  # concrete arrays drawn unsharded, then fully_shard
    assert traced.meta == eager.meta and traced["blocks"].meta == eager["blocks"].meta
    for (path, x), y in zip(jax.tree.leaves_with_path(traced), jax.tree.leaves(eager), strict=True):
        where = jax.tree_util.keystr(path)
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (where, x.sharding, y.sharding)
        assert x.sharding.memory_kind == y.sharding.memory_kind, where
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=where)


def test_the_split_is_in_the_traced_type():
    """On an Explicit mesh what the same program derives from the leaves (Optax's zeros) is split too."""
    if not zeros_follow_explicit_types():
        pytest.xfail(ZEROS_DROP_THE_SPLIT)
    mesh = js.make_mesh()

    def build(key):
        params = sharded_init(mesh)(key)
        assert jax.typeof(params["head"]).sharding.spec[0] == "fsdp"
        return params, jax.tree.map(jnp.zeros_like, params)

    params, zeros = jax.jit(build)(jax.random.key(0))
    for x, z in zip(jax.tree.leaves(params), jax.tree.leaves(zeros), strict=True):
        assert z.sharding.is_equivalent_to(x.sharding, x.ndim)


def _shard_bytes(tree, n):
    return [int(np.prod(x.shape)) * x.dtype.itemsize // (n if x.ndim else 1) for x in jax.tree.leaves(tree)]


def test_the_init_program_holds_its_share_and_one_leafs_transients():
    mesh = js.make_mesh()
    build = sharded_init(mesh, width=256, hidden=1024)
    key = jax.random.key(0)
    stored = jax.eval_shape(build, key)
    share, largest = sum(_shard_bytes(stored, 8)), max(_shard_bytes(stored, 8))
    full = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(lambda k: init(k, 256, 1024), key)))
    lowered = jax.jit(build).lower(key)
    memory = lowered.compile(MEMORY_MINIMISING).memory_analysis()
    small = 16 * 1024  # the output tuple's pointers, keys, loop counters
    assert memory.output_size_in_bytes <= share + small
    # one leaf's threefry transients: two 32-bit counter words in, two out, each of the leaf's shard's size
    assert memory.output_size_in_bytes + memory.temp_size_in_bytes <= share + small + 4 * largest < full / 2
    # XLA:CPU's default scheduler draws several leaves at once, still a fraction of the model per device
    default = lowered.compile().memory_analysis()
    print(f"init per device: share {share}, largest leaf shard {largest}, model {full}; memory-minimising "
          f"output {memory.output_size_in_bytes} temp {memory.temp_size_in_bytes}; default output "
          f"{default.output_size_in_bytes} temp {default.temp_size_in_bytes}")
    assert default.output_size_in_bytes + default.temp_size_in_bytes <= 2 * share + small + 4 * largest


def test_a_leaf_traced_whole_under_an_explicit_mesh_context_is_refused():
    mesh = js.make_mesh()
    with jax.set_mesh(mesh), pytest.raises(
            ValueError, match=r"Leaf \['bias'\] of shape \(3, 36\) was computed whole on every device: .* mesh "
                              r"axis 'fsdp' \(size 8\).* outside `with jax.set_mesh"):
        jax.jit(sharded_init(mesh))(jax.random.key(0))


def test_a_leaf_traced_inside_shard_map_is_refused():
    mesh = js.make_mesh()

    def per_device(w):
        return js.fully_shard({"w": w}, mesh)["w"]

    fn = jax.shard_map(per_device, mesh=mesh, in_specs=PartitionSpec("fsdp"), out_specs=PartitionSpec("fsdp"))
    w = jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, PartitionSpec("fsdp")))
    with pytest.raises(ValueError, match=r"Leaf \['w'\] of shape \(2, 4\) is traced inside shard_map, manual over "
                                         r"mesh axis 'fsdp' \(size 8\).*outside shard_map"):
        jax.jit(fn)(w)


def test_a_leaf_traced_on_a_mesh_with_auto_model_axes_is_refused():
    """Its tensor-parallel split is not in its type, so the eager layout could not be kept."""
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(AxisType.Explicit, AxisType.Auto))
    with pytest.raises(ValueError, match=r"Leaf \['bias'\] of shape \(3, 36\) is traced on a mesh whose model axis "
                                         r"'tp' \(size 2\) is Auto.*Make the model axes Explicit"):
        jax.jit(lambda key: js.fully_shard(init(key)["blocks"], mesh))(jax.random.key(0))
