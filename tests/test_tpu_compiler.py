"""The TPU compiler as an instrument: plans, meshes and HLO readings on XLA:TPU without a TPU.

libtpu compiles for TPU topologies this machine does not have (deviceless ahead-of-time
compilation); ``jax.devices()`` stays CPU. The test extra installs it (``jax[tpu]`` at the
installed jax's version), so these run in the default suite.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import recipe_and_jshard_flops
from jax.experimental import topologies
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jshard as js
from jshard._sharding.mesh import slice_of
from jshard.report import CompileTarget, plan, step_collectives


def _tpu(topology: str, slices: int = 1) -> list:
    kwargs = {"num_slices": slices} if slices > 1 else {}
    return list(topologies.get_topology_desc(topology_name=topology, platform="tpu", **kwargs).devices)


@pytest.mark.parametrize("name, topology, devices", [
    ("tpu:v5p-256", "v5p:4x4x8", 128), ("tpu:v5p-8", "v5p:2x2x1", 4), ("v6e-8", "v6e:2x4", 8),
    ("tpu:v5e-16", "v5e:4x4", 16), ("tpu:v5litepod-4", "v5e:2x2", 4), ("tpu:v5p:2x2x2", "v5p:2x2x2", 8),
])
def test_tpu_targets_follow_cloud_tpu_names(name, topology, devices):
    target = CompileTarget.parse(name)
    assert (target.platform, target.topology, target.devices) == ("tpu", topology, devices)
    assert CompileTarget.parse(name, slices=2).devices == 2 * devices


def test_bad_targets_say_what_exists():
    with pytest.raises(ValueError, match=r"No v5p slice has 7 TensorCores; sizes known here: v5p-8, v5p-16"):
        CompileTarget.parse("tpu:v5p-7")
    with pytest.raises(ValueError, match=r"Unknown TPU target 'v9x-8'.*generation of"):
        CompileTarget.parse("tpu:v9x-8")
    with pytest.raises(ValueError, match=r"cpu:N with N simulated devices, got 'cpu:0'"):
        CompileTarget.parse("cpu:0")
    with pytest.raises(ValueError, match=r"has 4 devices, not devices=8"):
        plan(_mlp_builder, devices=8, target="tpu:v5p-8")


def _mlp_builder(mesh):
    """Two stacked GELU layers and a root head, abstract (nothing allocated)."""
    sds = jax.ShapeDtypeStruct
    blocks = js.fully_shard({"w": sds((2, 256, 512), jnp.float32), "v": sds((2, 512, 256), jnp.float32)}, mesh,
                            js.FullyShardPolicy(scan_axis=0))
    params = js.fully_shard({"blocks": blocks, "head": sds((256, 128), jnp.float32)}, mesh)

    def loss_fn(p, x):
        h, _ = js.scan(lambda h, layer: (h + jax.nn.gelu(h @ layer["w"]) @ layer["v"], None), x, p["blocks"])
        return jnp.mean((h @ js.unshard(p)["head"]) ** 2)

    step = jax.jit(js.value_and_grad(loss_fn, unshard_params=False), donate_argnums=0)
    return step, (params, sds((8 * mesh.size, 256), jnp.float32))


def test_plan_compiles_on_the_tpu_compiler_with_loop_counts_and_flops():
    p = plan(_mlp_builder, target="tpu:v5e-8")
    assert p.platform == "tpu" and p.report.analytic.devices == 8
    layer_flops = 2 * 8 * 256 * 512 * 2  # per device: two matmuls of one layer, forward
    # Forward, then backward's two matmuls per layer (no recompute by default), plus the head.
    head_flops = 2 * 8 * 256 * 128
    assert p.flops == 2 * (3 * layer_flops) + 3 * head_flops
    gathers = [c for c in p.report.collectives if c.kind == "all-gather" and c.in_loop]
    assert gathers and all(c.trip_count == 2 for c in gathers)  # read from the loop condition on TPU


def test_xla_tpu_keeps_reduce_scatter_on_2d_tori_and_decomposes_it_on_3d():
    """The platform fact behind docs/benchmarks.md's "Gradient reductions on TPU"."""

    def kinds(topology):
        mesh = jax.sharding.Mesh(np.array(_tpu(topology)), ("fsdp",))
        scatter = jax.shard_map(lambda g: jax.lax.psum_scatter(g, "fsdp", scatter_dimension=0, tiled=True),
                                mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"))
        arg = jax.ShapeDtypeStruct((8 * 1024, 512), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
        compiled = jax.jit(scatter).lower(arg).compile()
        return sorted({c.kind for c in step_collectives(compiled.as_text())}), compiled.memory_analysis()

    (v6e, v6e_memory), (v5p, v5p_memory) = kinds("v6e:2x4"), kinds("v5p:2x2x2")
    assert v6e == ["reduce-scatter"]
    assert v5p == ["all-reduce"]  # the whole gradient, then this device's slice
    assert v5p_memory.temp_size_in_bytes >= 1024 * 512 * 4 > v6e_memory.temp_size_in_bytes


def test_make_mesh_puts_replicate_across_slices():
    devices = _tpu("v5p:2x2x2", slices=2)
    mesh = js.make_mesh(replicate=2, devices=devices)
    assert dict(mesh.shape) == {"replicate": 2, "fsdp": 8}
    assert [{slice_of(d) for d in row} for row in mesh.devices] == [{0}, {1}]  # each FSDP group in one slice
    four = js.make_mesh(replicate=4, devices=devices)
    assert [{slice_of(d) for d in row} for row in four.devices] == [{0}, {0}, {1}, {1}]
    flat = js.make_mesh(devices=devices)
    assert [slice_of(d) for d in flat.devices] == [0] * 8 + [1] * 8
    with pytest.raises(ValueError, match=r"span 2 slices: `replicate` must be a multiple of 2.*got replicate=3"):
        js.make_mesh(replicate=3, devices=devices[:12])


def test_recompute_once_on_the_tpu_compiler():
    """``remat_policy=nothing_saveable`` recomputes each layer once, as ``jax.checkpoint(layer)``."""
    mesh = jax.sharding.Mesh(np.array(_tpu("v5e:2x4")), ("fsdp",))
    flops = recipe_and_jshard_flops(mesh, jax.checkpoint_policies.nothing_saveable)
    assert flops["jshard"] == flops["recipe"] > 0

