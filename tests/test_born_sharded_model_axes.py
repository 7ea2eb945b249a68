"""Born sharded on a mesh with Explicit model axes: each device computes its 1/(N x TP) block, or an error.

A leaf placed over ``tp`` by ``jax.device_put`` right before ``fully_shard`` lets XLA propagate
the whole split back into the initialiser; one computed with ``tp`` in its own type
(``out_sharding=``, ``reshard``, an op on a split value) is computed 1/TP per device, so it is
refused ([Note: born sharded]).
"""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import jshard as js

SHAPE = (256, 1024)
MEMORY_MINIMISING = {"xla_cpu_enable_concurrency_optimized_scheduler": False}


def _mesh():
    return jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(AxisType.Explicit,) * 2)


def _per_device_bytes(build, key):
    memory = jax.jit(build).lower(key).compile(MEMORY_MINIMISING).memory_analysis()
    return memory.output_size_in_bytes + memory.temp_size_in_bytes


@pytest.mark.parametrize("how", ["device_put", "split_over_both"])
def test_a_leaf_split_over_tp_computes_only_each_devices_block(how):
    mesh = _mesh()
    tp, both = NamedSharding(mesh, PartitionSpec(None, "tp")), NamedSharding(mesh, PartitionSpec("fsdp", "tp"))
    make = {"device_put": lambda key: jax.device_put(jax.random.normal(key, SHAPE), tp),
            "split_over_both": lambda key: jax.random.normal(key, SHAPE, out_sharding=both)}[how]

    def build(key):
        return js.fully_shard({"w": make(key)}, mesh)

    key = jax.random.key(0)
    got, eager = jax.jit(build)(key), js.fully_shard({"w": jax.device_put(jax.random.normal(key, SHAPE), tp)}, mesh)
    assert tuple(got["w"].sharding.spec) == tuple(eager["w"].sharding.spec) == ("fsdp", "tp")
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(eager["w"]))
    block = SHAPE[0] * SHAPE[1] * 4 // 8
    # the block and threefry's words for it; computed 1/TP per device it is 4 words of half the leaf: 17 blocks
    assert _per_device_bytes(build, key) <= 5 * block


@pytest.mark.parametrize("how", ["out_sharding", "reshard", "op_after_device_put"])
def test_a_leaf_computed_split_over_tp_only_is_refused(how):
    mesh = _mesh()
    tp = NamedSharding(mesh, PartitionSpec(None, "tp"))
    make = {"out_sharding": lambda key: jax.random.normal(key, SHAPE, out_sharding=tp),
            "reshard": lambda key: jax.sharding.reshard(jax.random.normal(key, SHAPE), tp),
            "op_after_device_put": lambda key: jax.device_put(jax.random.normal(key, SHAPE), tp) * 0.02}[how]
    with pytest.raises(ValueError, match=r"Leaf \['w'\] of shape \(256, 1024\) was computed split over model axis "
                                         r"'tp' \(size 2\), not split over mesh axis 'fsdp' \(size 4\): its type "
                                         r"P\(None, 'tp'\).*computed 1/2 of it, not its 1/8 block.*jax.device_put"):
        jax.jit(lambda key: js.fully_shard({"w": make(key)}, mesh))(jax.random.key(0))


def test_a_leaf_computed_whole_on_the_mesh_is_refused():
    mesh = _mesh()
    whole = NamedSharding(mesh, PartitionSpec())
    with pytest.raises(ValueError, match=r"Leaf \['w'\] of shape \(256, 1024\) was computed whole, not split over "
                                         r"mesh axis 'fsdp' \(size 4\).*computed all of it, not its 1/4 block"):
        jax.jit(lambda key: js.fully_shard({"w": jax.random.normal(key, SHAPE, out_sharding=whole)}, mesh))(
            jax.random.key(0))


def test_an_argument_split_over_tp_is_only_placed():
    """A value the program did not compute has nothing to refuse: jit of fully_shard on a TP-split input."""
    mesh = _mesh()
    w = jax.device_put(np.ones(SHAPE, np.float32), NamedSharding(mesh, PartitionSpec(None, "tp")))
    assert tuple(jax.jit(lambda w: js.fully_shard({"w": w}, mesh))(w)["w"].sharding.spec) == ("fsdp", "tp")
