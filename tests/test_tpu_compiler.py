"""The TPU compiler as an instrument: plans, meshes and HLO readings on XLA:TPU without a TPU.

libtpu compiles for TPU topologies this machine does not have (deviceless ahead-of-time
compilation); ``jax.devices()`` stays CPU. The test extra installs it (``jax[tpu]`` at the
installed jax's version), so these run in the default suite.
"""

import dataclasses
import functools
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import head_loss, head_params, recipe_and_jshard_flops
from jax.experimental import topologies
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax_behaviour import other_libtpu

import jshard as js
from benchmarks.memory_sweep import ASYNC_COLLECTIVE_FLAGS
from jshard._plan.buffers import compile_reading_assignment
from jshard._sharding.mesh import tensor_parallel_mesh
from jshard._sharding.platform_defaults import FSDP2_LAYOUT  # named by the tests of its reductions on TPU
from jshard._sharding.scatter_padding import scatter_sizes
from jshard._sharding.torus import gather_phases, scatter_phases, slice_of
from jshard.report import CompileTarget, Memory, PlanConfig, plan, scaling, step_collectives, step_report

ROOT = pathlib.Path(__file__).resolve().parent.parent


ASYNC_GATHER_REFUSED = ("it refuses MaxText's all-gather continuation fusion on v5p (FAILED_PRECONDITION: "
                        "not supported or recommended on platforms other than TPU v5e)")


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


def test_a_v4_target_has_a_device_per_chip_and_plans():
    """Cloud TPU's v4-16 is 8 chips of two TensorCores, which JAX runs as one device each
    (megacore): the target's devices are its chips and a plan compiles on them. libtpu's topology
    lists the cores unless asked for megacore, and jax's mesh utilities refuse those."""
    target = CompileTarget.parse("tpu:v4-16")
    assert (target.topology, target.devices, len(target.tpu_devices())) == ("v4:2x2x2", 8, 8)
    p = plan("jshard.demo.plan:build_tiny", target="tpu:v4-16")
    assert p.platform == "tpu" and p.report.analytic.devices == 8


def test_bad_targets_say_what_exists():
    with pytest.raises(ValueError, match=r"No v5p slice has 7 TensorCores; sizes known here: v5p-8, v5p-16"):
        CompileTarget.parse("tpu:v5p-7")
    with pytest.raises(ValueError, match=r"Unknown TPU target 'v9x-8'.*generation of"):
        CompileTarget.parse("tpu:v9x-8")
    with pytest.raises(ValueError, match=r"cpu:N with N simulated devices, got 'cpu:0'"):
        CompileTarget.parse("cpu:0")
    with pytest.raises(ValueError, match=r"has 4 devices, not devices=8"):
        plan(_mlp_builder, devices=8, target="tpu:v5p-8")


def _mlp_builder(mesh, config=None):
    """Two stacked GELU layers and a root head, abstract (nothing allocated); reads every field of ``config``
    but offload."""
    config, sds = config or PlanConfig(), jax.ShapeDtypeStruct
    mp = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16) if config.mixed_precision else js.MixedPrecisionPolicy()
    policy = js.FullyShardPolicy(reshard_after_forward=config.reshard_after_forward, mp_policy=mp,
                                 replicate_below=config.replicate_below, weight_gradients=config.weight_gradients)
    blocks = js.fully_shard({"w": sds((2, 256, 512), jnp.float32), "v": sds((2, 512, 256), jnp.float32)}, mesh,
                            dataclasses.replace(policy, scan_axis=0))
    params = js.fully_shard({"blocks": blocks, "head": sds((256, 128), jnp.float32)}, mesh, policy)

    def loss_fn(p, x):
        h, _ = js.scan(lambda h, layer: (h + jax.nn.gelu(h @ layer["w"]) @ layer["v"], None), x, p["blocks"])
        return jnp.mean((h @ js.unshard(p)["head"]) ** 2)

    step = jax.jit(js.value_and_grad(loss_fn, unshard_params=False, remat_policy=config.remat_policy()),
                   donate_argnums=0)
    return step, (params, sds((8 * config.batch_per_device * mesh.size, 256), jnp.float32))


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


def test_v5p_decomposes_a_reduce_scatter_over_a_whole_slice_only():
    """[Note: torus phases]: XLA:TPU makes one reduce-scatter over every chip of a v5p slice an
    all-reduce; over part of a slice (HSDP's groups, a "tp" mesh's FSDP groups) it stays native,
    even spanning all three torus dimensions (two groups of 32 chips of a 4x4x4)."""
    from jshard._sharding.compiler_probe import compiled_scatter

    mesh = js.make_mesh(devices=_tpu("v5p:4x4x4"))
    halves = (tuple(range(32)), tuple(range(32, 64)))
    assert min(len({d.coords[k] for d in mesh.devices.flat[:32]}) for k in range(3)) > 1  # spans x, y and z
    assert compiled_scatter(mesh, ("fsdp",), None, (64 * 128, 512), "float32", 0)[0] == "all-reduce"
    assert compiled_scatter(mesh, ("fsdp",), halves, (32 * 128, 512), "float32", 0) == ("reduce-scatter", None)


# jax 0.11+'s order of a v5p 2x2x2 slice's chips in a 1-D mesh: a ring, each chip a neighbour of the next.
RING_2X2X2 = [(0, 0, 0), (1, 0, 0), (1, 1, 0), (0, 1, 0), (0, 1, 1), (1, 1, 1), (1, 0, 1), (0, 0, 1)]


def _ring_mesh(shape, names, devices=None, **kwargs):
    """``jax.make_mesh`` as jax 0.11+ lays a v5p 2x2x2 out (``RING_2X2X2``), simulated on jax 0.10."""
    by_coords = {tuple(d.coords): d for d in _tpu("v5p:2x2x2")}
    return jax.sharding.Mesh(np.array([by_coords[c] for c in RING_2X2X2]).reshape(shape), names, **kwargs)


@pytest.mark.parametrize("replicate", [1, 2])
def test_make_mesh_keeps_torus_phases_where_jax_lays_a_v5p_slice_out_as_a_ring(monkeypatch, replicate):
    """jax 0.11+ lays the chips of a v5p 2x2x2 out as a ring (``RING_2X2X2``; 0.10 row-major). Over the
    ring no torus dimension is a group of consecutive or strided chips, so gradients could not be
    reduced in torus phases and XLA:TPU would all-reduce each whole (jax 0.12.0.1, libtpu 0.0.50.1:
    twelve 2048-wide core units held 114.6 MiB of HBM temporaries at once, 27.0 in phases).
    ``js.make_mesh`` reorders each FSDP group row-major; jax's ring is simulated here on jax 0.10."""
    ring = _ring_mesh((8,), ("fsdp",)).devices
    monkeypatch.setattr(jax, "make_mesh", _ring_mesh)
    assert scatter_phases(_ring_mesh((8,), ("fsdp",)), ("fsdp",)) == ()
    mesh = js.make_mesh(replicate=replicate, devices=_tpu("v5p:2x2x2"))
    assert scatter_phases(mesh, ("fsdp",)) == ((2, 2, 2) if replicate == 1 else (2, 2))
    ids = np.vectorize(lambda d: d.id)
    assert sorted(ids(mesh.devices).flat) == sorted(ids(ring).flat)  # the same chips, each FSDP group reordered
    assert [sorted(row) for row in ids(mesh.devices).reshape(replicate, -1).tolist()] == \
        [sorted(row) for row in ids(ring).reshape(replicate, -1).tolist()]
    with pytest.warns(UserWarning, match=r"8 devices of mesh axis 'fsdp' are not laid out row-major.*js.make_mesh"):
        jax.eval_shape(lambda: js.fully_shard({"w": jnp.zeros((16, 16))}, _ring_mesh((8,), ("fsdp",))))
    jax.eval_shape(lambda: js.fully_shard({"w": jnp.zeros((16, 16))}, mesh))  # row-major: no warning
    # Groups of part of a slice keep one native reduce-scatter in any order (the 1b demo model, HSDP
    # R=2 on jax 0.12's ring: reduce-scatters 3085.5 MiB/step, 1.01 of the phased step's): no warning.
    jax.eval_shape(lambda: js.fully_shard({"w": jnp.zeros((16, 16))}, _ring_mesh((2, 4), ("replicate", "fsdp"))))


def _neighbours(group) -> bool:
    """Whether consecutive devices of ``group`` differ in one torus coordinate, by one."""
    steps = [np.abs(np.subtract(a.coords, b.coords)) for a, b in zip(group[:-1], group[1:], strict=True)]
    return all(step.sum() == 1 for step in steps)


def test_tensor_parallel_meshes_keep_tp_groups_on_neighbours_and_fsdp_groups_in_torus_phases(monkeypatch):
    """The planner's and the demo's ``("fsdp", "tp")`` meshes (``plan_mesh``): each ``"tp"`` group runs
    along one torus dimension inside a slice, the FSDP groups keep their torus phases. ``jax.make_mesh``
    refused a ``"tp"`` axis of 2 over a v5p 4x4x4 (and ``js.make_mesh(replicate=2)`` there), and from
    jax 0.11 on lays a v5p 2x2x2 out as a ring, the FSDP groups of ``("fsdp", "tp")`` with no phases
    (harmless there: one reduce-scatter over part of a slice stays native, but the phases hold a
    little less: [Note: torus phases])."""
    from jshard._plan.planner import plan_mesh

    cube = _tpu("v5p:4x4x4")
    for replicate in (1, 2):
        mesh = plan_mesh(64, replicate, 2, pool=cube)
        assert dict(mesh.shape) == ({"fsdp": 32, "tp": 2} if replicate == 1 else {"replicate": 2, "fsdp": 16, "tp": 2})
        assert all(_neighbours(list(group)) for group in mesh.devices.reshape(-1, 2))
        assert set(mesh.axis_types) == {jax.sharding.AxisType.Auto}
    assert scatter_phases(plan_mesh(64, 2, 2, pool=cube), ("fsdp",)) == (4, 4)
    assert np.prod(scatter_phases(js.make_mesh(replicate=2, devices=cube), ("fsdp",))) == 32
    assert scatter_phases(plan_mesh(64, 1, 4, pool=cube), ("fsdp",)) == (4, 4)
    # "tp" takes a torus dimension of its size, not a split of the fastest one (2x2x4's z, 4x4x8's z).
    assert scatter_phases(plan_mesh(16, 1, 2, pool=_tpu("v5p:2x2x4")), ("fsdp",)) == (2, 4)
    assert scatter_phases(plan_mesh(128, 1, 4, pool=_tpu("v5p:4x4x8")), ("fsdp",)) == (4, 8)

    two_slices = _tpu("v5p:2x2x2", slices=2)
    mesh = plan_mesh(16, 2, 2, pool=two_slices)
    assert all(len({slice_of(d) for d in row.flat}) == 1 for row in mesh.devices)
    assert scatter_phases(mesh, ("fsdp",)) == (2, 2)
    with pytest.raises(ValueError, match=r"`tensor_parallel=16` does not divide the devices of each slice.*'fsdp': 16"):
        tensor_parallel_mesh(16, devices=two_slices)
    with pytest.raises(ValueError, match=r"`tensor_parallel=3` does not divide mesh axis 'fsdp' of size 8"):
        tensor_parallel_mesh(3, devices=_tpu("v5p:2x2x2"))

    monkeypatch.setattr(jax, "make_mesh", _ring_mesh)
    mesh = plan_mesh(8, 1, 2, pool=_tpu("v5p:2x2x2"))
    assert scatter_phases(mesh, ("fsdp",)) == (2, 2)
    assert all(_neighbours(list(group)) for group in mesh.devices)


def test_v5p_reduces_gradients_in_torus_phases():
    """[Note: torus phases]: on a 2x2x2 v5p slice the gradients are reduce-scattered along x, y, z
    (native reduce-scatters, groups of 2), never all-reduced whole; v6e keeps one reduce-scatter."""
    assert scatter_phases(js.make_mesh(devices=_tpu("v5p:2x2x2")), ("fsdp",)) == (2, 2, 2)
    assert scatter_phases(tensor_parallel_mesh(2, devices=_tpu("v5p:2x2x2")), ("fsdp",)) == (2, 2)
    assert scatter_phases(jax.make_mesh((8,), ("fsdp",), devices=_tpu("v6e:2x4")), ("fsdp",)) == ()
    p = plan(_mlp_builder, target="tpu:v5p:2x2x2", config=PlanConfig(**FSDP2_LAYOUT))
    scatters = [c for c in p.report.collectives if c.kind == "reduce-scatter"]
    # [Note: two phases]: the stacked layers one phase per dimension, the head (unrolled) two.
    assert {c.group_size for c in scatters if c.in_loop} == {2}
    assert sorted(c.group_size for c in scatters if not c.in_loop) == [2, 4]
    assert all(c.bytes <= 64 for c in p.report.collectives if c.kind == "all-reduce")  # the loss's scalar alone
    # Bytes on the wire: a ring reduce-scatter's (N-1)/N of the gradients, not an all-reduce's twice that.
    grads = 2 * 2 * 256 * 512 * 4 + 256 * 128 * 4
    assert p.report.collective_bytes["reduce-scatter"] == pytest.approx(grads * 7 / 8)


def _wide_builder(mesh, config=None, unit_collectives=False):
    """A 4096-wide layer of two matrices (64 MiB gradients each) and a head, abstract."""
    sds = jax.ShapeDtypeStruct
    policy = js.FullyShardPolicy(unit_collectives=unit_collectives, **FSDP2_LAYOUT)
    layer = js.fully_shard({"w": sds((4096, 4096), jnp.float32), "v": sds((4096, 4096), jnp.float32)}, mesh, policy)
    params = js.fully_shard({"layer": layer, "head": sds((4096, 128), jnp.float32)}, mesh,
                            js.FullyShardPolicy(**FSDP2_LAYOUT))

    def loss_fn(p, x):
        layer = js.unshard(p["layer"])
        x = jnp.tanh(x @ layer["w"]) @ layer["v"]
        return jnp.mean((x @ js.unshard(p)["head"]) ** 2)

    step = jax.jit(js.value_and_grad(loss_fn, unshard_params=False), donate_argnums=0)
    return step, (params, sds((64, 4096), jnp.float32))


# The flat buffer's case compiles for 85-120 s on XLA:TPU: slow. The default run keeps what it
# combines: the per-leaf case here (the same scatter_sizes and padded reduce_scatter) and the
# tiles' parity on CPU (tests/test_unit_collectives.py).
@pytest.mark.parametrize("unit_collectives", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_large_gradients_are_padded_to_the_size_xla_tpu_reduce_scatters_natively(unit_collectives):
    """[Note: scatter padding]: XLA:TPU makes a large reduce-scatter an all-reduce of a padded
    gradient (float32 [8192, 4096] over 8 v6e chips: [8512, 4096]) unless it has that size;
    jshard pads each chunk to the size the compiler names, so a v5p step with such gradients
    sends reduce-scatters at the ring bytes and no all-reduce (measured before: 199.5 MiB of
    all-reduce, 17.75 of reduce-scatter; peak 147.53 MiB, now 147.91). A unit's flat buffer
    (``unit_collectives``) is scattered as 1024-wide tiles for the same reason."""
    mesh = jax.make_mesh((8,), ("fsdp",), devices=_tpu("v6e:2x4"))
    assert scatter_sizes(mesh, ("fsdp",), (), (8192, 4096), np.dtype("float32"), 0) == (8512,)
    assert scatter_sizes(mesh, ("fsdp",), (), (4096, 4096), np.dtype("float32"), 0) == (4096,)  # 8 MiB shards
    p = plan(functools.partial(_wide_builder, unit_collectives=unit_collectives), target="tpu:v5p:2x2x2")
    sent = p.report.collective_bytes
    grads = 2 * 4096 * 4096 * 4 + 4096 * 128 * 4
    assert sent["all-reduce"] <= 64  # the loss's scalar alone
    assert grads * 7 / 8 <= sent["reduce-scatter"] <= 1.05 * grads * 7 / 8


def test_two_phases_fall_back_to_one_per_dimension_only_where_they_pad_wider(monkeypatch):
    """``phases_and_sizes`` ([Note: two phases]): an unrolled unit's two phases give way to one per
    torus dimension where XLA:TPU would pad their first wider; a leaf left unphased (``()``, the
    in-place all-reduce ``phases_pay_off`` chose) stays so whatever its padding."""
    import jshard._sharding.scatter_padding as scatter_padding

    first = {(4, 2): 4480, (2, 2, 2): 4256, (): 4500}
    monkeypatch.setattr(scatter_padding, "scatter_sizes", lambda mesh, axes, phases, *a: (first[phases],))
    monkeypatch.setattr(scatter_padding, "compiled_scatter", lambda *a: ("reduce-scatter", None))
    mesh, f32 = object(), np.dtype("float32")
    assert scatter_padding.phases_and_sizes(mesh, ("fsdp",), (4, 2), (2, 2, 2), (4096, 4096), f32, 0) == \
        ((2, 2, 2), (4256,))
    assert scatter_padding.phases_and_sizes(mesh, ("fsdp",), (), (2, 2, 2), (4096, 4096), f32, 0) == ((), (4500,))
    first[(4, 2)] = 4256
    assert scatter_padding.phases_and_sizes(mesh, ("fsdp",), (4, 2), (2, 2, 2), (4096, 4096), f32, 0) == \
        ((4, 2), (4256,))


def test_two_phases_give_way_where_xla_tpu_all_reduces_their_first_at_any_size():
    """``phases_and_sizes``: the Llama-3-8B output matrix's float32 ``[4096, 128256]`` gradient (2
    GiB) on a v5p 4x4x8 (``tpu:v5p-256``). Over the two phases' first groups, 16 chips, XLA:TPU
    all-reduces it at its own size and padded or not; one torus dimension at a time (groups of 4
    first) it stays a reduce-scatter, so that is how it is reduced (the 8B plan: 1878.8 MiB a step
    more reduce-scatter and 3757.5 less all-reduce than with two phases). Its MLP's ``[4096,
    14336]`` gradient (224 MiB) keeps the two phases."""
    from jshard._sharding.scatter_padding import phases_and_sizes
    from jshard._sharding.torus import scatter_phases, unit_phases

    mesh = jax.sharding.Mesh(js.make_mesh(devices=CompileTarget.parse("tpu:v5p-256").tpu_devices()).devices,
                             ("fsdp",))
    per_dimension = scatter_phases(mesh, ("fsdp",))
    two, f32 = unit_phases(per_dimension, in_loop=False), np.dtype("float32")
    assert (two, per_dimension) == ((16, 8), (4, 4, 8))
    assert phases_and_sizes(mesh, ("fsdp",), two, per_dimension, (4096, 128256), f32, 0)[0] == per_dimension
    assert phases_and_sizes(mesh, ("fsdp",), two, per_dimension, (4096, 14336), f32, 0)[0] == two


def _small_unit_builder(mesh, config=None):
    """Two layers of a matrix and a bias each, one unit per layer, one collective per unit: each
    device's flat buffer holds 64 * 96 / 8 + 96 / 8 = 780 elements, not a multiple of 128."""
    sds = jax.ShapeDtypeStruct
    policy = js.FullyShardPolicy(unit_collectives=True, **FSDP2_LAYOUT)
    layers = [js.fully_shard({"w": sds((64, 96), jnp.float32), "b": sds((96,), jnp.float32)}, mesh, policy)
              for _ in range(2)]
    params = js.fully_shard({"layers": layers, "head": sds((96, 64), jnp.float32)}, mesh,
                            js.FullyShardPolicy(**FSDP2_LAYOUT))

    def loss_fn(p, x):
        for layer in p["layers"]:
            layer = js.unshard(layer)
            x = jnp.tanh(x @ layer["w"] + layer["b"])[:, :64]
        return jnp.mean(x ** 2)

    step = jax.jit(js.value_and_grad(loss_fn, unshard_params=False), donate_argnums=0)
    return step, (params, sds((64, 64), jnp.float32))


def test_a_units_flat_buffer_is_gathered_in_whole_tiles_on_tpu():
    """[Note: unit collectives]: XLA:TPU compiles the gather of a flat buffer whose shard is not a
    multiple of 128 elements as an all-reduce of the zero-filled gathered buffer (twice the
    bytes); padded to whole 1024-element tiles, each unit's buffer is one all-gather at the ring
    bytes (measured before: no all-gather and 202055 bytes of all-reduce, now 114695)."""
    p = plan(_small_unit_builder, target="tpu:v5p:2x2x2")
    sent = p.report.collective_bytes
    buffer = 1024 * 4  # 780 elements a device, padded to one tile of float32
    assert 2 * buffer * 7 <= sent["all-gather"] <= 4 * buffer * 7  # forward; backward re-gathers
    # The gradients' buffers (8 tiles each) are all that is all-reduced besides the loss: at this
    # size XLA:TPU all-reduces a reduce-scatter over the 3-D torus ([Note: torus phases]).
    assert sent["all-reduce"] <= 2 * 8 * buffer * 2 * 7 / 8 + 64


def test_v5e_and_v6e_reduce_in_phases_where_one_reduce_scatter_would_be_an_all_reduce():
    """[Note: torus phases]: on 4x4 and 8x8 v5e/v6e slices XLA:TPU makes one reduce-scatter over
    every chip an all-reduce (a 2x4 slice keeps it); there jshard reduces in two phases of 4
    (measured on v5e-16 with this model: 3.98 MiB of all-reduce before, 1.99 of reduce-scatter
    after, peak unchanged)."""
    assert scatter_phases(jax.make_mesh((16,), ("fsdp",), devices=_tpu("v5e:4x4")), ("fsdp",)) == (4, 4)
    assert scatter_phases(jax.make_mesh((8,), ("fsdp",), devices=_tpu("v6e:2x4")), ("fsdp",)) == ()
    p = plan(_mlp_builder, target="tpu:v5e-16", config=PlanConfig(**FSDP2_LAYOUT))
    assert {c.group_size for c in p.report.collectives if c.kind == "reduce-scatter"} == {4}
    assert all(c.bytes <= 64 for c in p.report.collectives if c.kind == "all-reduce")  # the loss's scalar alone
    grads = 2 * 2 * 256 * 512 * 4 + 256 * 128 * 4
    assert p.report.collective_bytes["reduce-scatter"] == pytest.approx(grads * 15 / 16)


@other_libtpu("jshard's in-place all-reduce peaks at 3.05 MiB against the recipe's 2.36 (1.29x)")
def test_a_stacked_layer_of_one_large_leaf_keeps_the_in_place_all_reduce_on_v5p(monkeypatch):
    """[Note: torus phases]: a tanh layer (weight and bias) under js.scan is all-reduced in place;
    its phases would hold the gradient and a half-size result (measured 3.00 against 2.50 MiB,
    the recipe 2.48)."""
    import jshard._step.unit_gather as unit_gather
    from benchmarks import memory_sweep

    mesh = memory_sweep.target_mesh(CompileTarget.parse("tpu:v5p:2x2x2"))
    model = memory_sweep.Model("tanh", True, 4, 512, 64, remat=False)
    recipe = memory_sweep.measure(model, mesh, ("recipe", "jshard"))["peak_bytes"]
    monkeypatch.setattr(unit_gather, "phases_pay_off", lambda sizes, in_loop: True)
    phased = memory_sweep.measure(model, mesh, ("jshard",))["peak_bytes"]["jshard"]
    assert recipe["jshard"] < phased
    assert recipe["jshard"] <= 1.01 * recipe["recipe"]


@other_libtpu("jshard peaks at 3.38 MiB, above the plain recipe's 2.83 (0.58 of the constrained recipe's 5.82)")
def test_the_plain_recipe_moves_activations_instead_of_weights_at_few_tokens_on_v5p():
    """docs/benchmarks.md "Where jshard stays above the recipe": the sweep's four unrolled 512-wide
    tanh layers, 8 rows per device, activations kept. GSPMD does not do FSDP in the plain recipe's
    backward: it gathers the batch's activations (all-gathers, all-to-alls of cotangents) and
    computes each device's rows of a weight gradient there, so only the last layer's gradient is
    all-reduced (beside the loss's scalars); the others' never exist whole. The constrained recipe,
    activations pinned to batch sharding, all-reduces all four; jshard reduce-scatters all four
    and holds less than the constrained recipe (2.23 MiB in HBM against 5.08: [Note: TPU temporaries]),
    3% more than the plain recipe's 2.16 (read from ``memory_analysis()``'s temporaries it was 2.71
    against 2.83 and 5.67)."""
    from benchmarks import memory_sweep

    mesh = memory_sweep.target_mesh(CompileTarget.parse("tpu:v5p:2x2x2"))
    model = memory_sweep.Model("tanh", False, 4, 512, 64, remat=False)
    result = memory_sweep.measure(model, mesh, replicate_below=4096)
    sent, peak = result["collective_bytes"], result["peak_bytes"]
    ring = 512 * 512 * 4 * 2 * 7 / 8  # one layer's f32 gradient all-reduced over 8 devices
    assert sent["recipe"]["all-to-all"] > 0 and sent["recipe"]["reduce-scatter"] == 0
    assert ring <= sent["recipe"]["all-reduce"] < 1.1 * ring
    assert sent["constrained"]["all-to-all"] == 0 and 4 * ring <= sent["constrained"]["all-reduce"] < 4.1 * ring
    assert sent["jshard"]["all-to-all"] == 0 and sent["jshard"]["reduce-scatter"] == 4 * ring / 2
    assert peak["jshard"] < 0.5 * peak["constrained"] and peak["jshard"] < 1.05 * peak["recipe"]


def test_a_routed_matmuls_partial_sums_are_reduce_scattered_natively_on_v5p():
    """[Note: weight gradient route]: a matrix sharded on its inputs has its matmul's partial sums
    reduce-scattered to their rows, and in backward ``dx``'s for one sharded on its outputs. Two
    unrolled 4096-wide layers, 128 rows per device (1024 rows of ``[1024, 4096]`` float32 partial
    sums): the unit's first reduction phase, over groups of 4, is one XLA:TPU would pad to 1152
    rows and all-reduce unless asked at its native size, so they go through the gradients' rule
    ([Note: scatter padding]). Measured unpadded: 36 MiB of all-reduce a step beside 4 of
    reduce-scatter, temporaries 22.28 MiB; now the ring's 28 MiB of reduce-scatter, 20.19."""
    mesh = js.make_mesh(devices=_tpu("v5p:2x2x2"))
    policy = js.FullyShardPolicy(weight_gradients="from_activations")
    layers = {f"l{i}": {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)} for i in range(2)}
    root = js.fully_shard({k: js.fully_shard(v, mesh, policy) for k, v in layers.items()}, mesh, policy)

    def loss(root, x):
        h, params = x, js.unshard(root)
        for name in ("l0", "l1"):
            h = jnp.tanh(h @ js.unshard(params[name])["w"])
        return jnp.mean(h**2)

    x = jax.ShapeDtypeStruct((1024, 4096), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    collectives = step_collectives(jax.jit(js.value_and_grad(loss, unshard_params=False)).lower(root, x)
                                   .compile().as_text())
    sent = {kind: sum(c.bytes for c in collectives if c.kind == kind) for kind in ("reduce-scatter", "all-reduce")}
    partial_sums = 1024 * 4096 * 4 * 7 / 8  # one [1024, 4096] float32 reduce-scattered over 8, ring bytes
    assert sent == {"reduce-scatter": 2 * partial_sums, "all-reduce": pytest.approx(0, abs=64)}


def _flax_stack_training_step(front: str, model, mesh) -> tuple:
    """The sweep's stacked tanh model (``tanh(h @ w + b)`` per layer, bf16, recomputed, vectors
    whole) written as Flax's docs write stacked layers (``nnx.vmap`` + ``nnx.scan``, or
    ``nn.scan``), as a training step applying its gradients by SGD (the sweep's ``--apply-sgd``):
    the jitted step and its abstract arguments."""
    from flax import linen as nn
    from flax import nnx

    from benchmarks import memory_sweep
    from jshard.flax import linen as jlinen
    from jshard.flax import nnx as jnnx

    width = model.width
    policy = js.FullyShardPolicy(mp_policy=js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16), replicate_below=4096,
                                 weight_gradients="reduced")
    remat = jax.checkpoint_policies.nothing_saveable
    loss = lambda h: jnp.mean(h.astype(jnp.float32) ** 2)  # noqa: E731
    batch = jax.ShapeDtypeStruct((model.batch, width), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))

    def sgd(params, grads):
        return jax.tree.map(lambda p, g: p - memory_sweep.LEARNING_RATE * g, params, grads)

    if front == "nnx.scan":
        class Layer(nnx.Module):
            def __init__(self, rngs):
                self.w, self.b = nnx.Param(jnp.zeros((width, width))), nnx.Param(jnp.zeros((width,)))

            def __call__(self, h):
                return jnp.tanh(h @ self.w + self.b)

        class Stack(nnx.Module):
            def __init__(self, rngs):
                self.blocks = nnx.split_rngs(splits=model.layers)(nnx.vmap(Layer, in_axes=0, out_axes=0))(rngs)

            def __call__(self, x):
                run = nnx.scan(lambda h, layer: layer(h), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
                return run(x.astype(jnp.bfloat16), self.blocks)

        net = nnx.eval_shape(lambda: Stack(nnx.Rngs(0)))
        jnnx.fully_shard(net.blocks, mesh, dataclasses.replace(policy, scan_axis=0))
        jnnx.fully_shard(net, mesh, policy)
        graphdef, params = nnx.split(net)
        grad_fn = jnnx.value_and_grad(lambda m, x: loss(m(x)), remat_policy=remat)

        def step(params, x):
            value, grads = grad_fn(nnx.merge(graphdef, params), x)
            return value, sgd(params, grads)

        return jax.jit(step, donate_argnums=0), (params, batch)

    class LinenLayer(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return jnp.tanh(nn.Dense(width, dtype=jnp.bfloat16)(h)), None

    class LinenStack(nn.Module):
        @nn.compact
        def __call__(self, x):
            stack = nn.scan(jlinen.fully_shard(LinenLayer, mesh=mesh, policy=policy), variable_axes={"params": 0},
                            split_rngs={"params": True}, length=model.layers)
            return stack(name="blocks")(x.astype(jnp.bfloat16), None)[0]

    net = jlinen.fully_shard(LinenStack, mesh=mesh, policy=policy)()
    one = jnp.zeros((1, width))
    params = jlinen.shard_params(net, jax.eval_shape(lambda: net.init(jax.random.key(0), one)["params"]), one)
    grad_fn = jlinen.value_and_grad(lambda p, x: loss(net.apply({"params": p}, x)), remat_policy=remat)

    def step(params, x):
        value, grads = grad_fn(params, x)
        return value, sgd(params, grads)

    return jax.jit(step, donate_argnums=0), (params, batch)


@pytest.mark.parametrize("front", ["js.scan", "nnx.scan", "nn.scan"])
def test_a_stack_cast_before_its_loop_brings_a_bf16_training_step_under_the_recipe_on_v5p(monkeypatch, front):
    """[Note: stacks cast before the loop], in a training step (gradients applied by SGD, the
    sweep's ``--apply-sgd``): four stacked 512-wide tanh layers recomputed in bfloat16 on v5p
    2x2x2. With the stack cast in each iteration jshard's float32 gradient stack lives beside the
    parameters until the update, 2.64 MiB in HBM against the plain recipe's 2.40; cast before the
    loop, as the recipe casts its parameters, 2.39, with the same matmul FLOPs (read from
    ``memory_analysis()``'s temporaries: 3.48, 3.04 and 2.98; [Note: TPU temporaries]). The same
    layers under ``nnx.scan`` and ``nn.scan`` compile to the same figures (they stayed at the
    higher one while only ``js.scan`` cast its stacks)."""
    import jshard._step.unit_gather as unit_gather
    from benchmarks import memory_sweep

    mesh = memory_sweep.target_mesh(CompileTarget.parse("tpu:v5p:2x2x2"))
    model = memory_sweep.Model("tanh", True, 4, 512, 64, remat=True, bf16=True)
    recipe = memory_sweep.measure(model, mesh, ("recipe",), apply_sgd=True)

    def jshard_figures():
        if front == "js.scan":
            out = memory_sweep.measure(model, mesh, ("jshard",), replicate_below=4096, apply_sgd=True)
            return out["peak_bytes"]["jshard"], out["flops"]["jshard"]
        step, args = _flax_stack_training_step(front, model, mesh)
        compiled, assignment = compile_reading_assignment(step.lower(*args))
        return Memory.from_compiled(compiled, assignment).peak, memory_sweep.matmul_flops(compiled.as_text())

    cast_before = jshard_figures()
    monkeypatch.setattr(unit_gather, "_compiler_holds_cast_stacks", lambda axes: False)
    cast_in = jshard_figures()
    assert cast_before[0] <= recipe["peak_bytes"]["recipe"] < cast_in[0]
    assert cast_before[1] == cast_in[1] == recipe["flops"]["recipe"]


def test_unrolled_units_keep_no_copy_of_their_shards_from_forward_to_backward_on_v6e(tmp_path):
    """[Note: unrolled units]: a segment's shards enter its checkpoint as they are, beside the
    forward token, so what backward keeps of them is the parameter itself. When the shards were
    made to depend on the token before the checkpoint, the residual was that float32 copy
    (shard + token's zero), one per unit: in a training step of eight unrolled 1536 -> 4608 GELU
    blocks, recomputed, on v6e 2x4, eight shard-shaped float32 buffers (four layers' worth, 3.38
    MiB each) were live at the fullest point and the peak was 86.94 MiB (the plain recipe
    68.19); now none is, and the peak is 70.56."""
    from benchmarks import heap_at_peak, memory_sweep

    mesh = memory_sweep.target_mesh(CompileTarget.parse("tpu:v6e:2x4"))
    model = memory_sweep.Model("gelu", False, 8, 1536, 512, remat=True)
    step = memory_sweep.variant_step(model, mesh, "jshard", apply_sgd=True, replicate_below=4096)
    compiled = heap_at_peak.compile_with_dump(*step, tmp_path)
    heap, _ = heap_at_peak.read_dump(tmp_path)
    assert not [v.shape for v in heap.live if v.shape in ("f32[192,4608]", "f32[576,1536]")]
    assert Memory.from_compiled(compiled).peak < 72 * 2**20


def test_vectors_kept_whole_lower_an_unrolled_transformers_peak_on_v5p():
    """``replicate_below`` (docs/benchmarks.md "Small leaves kept whole"): the sweep's transformer,
    4 unrolled 128-wide blocks, batch 16, activations kept: with every leaf sharded jshard's peak
    in HBM is 0.98x the recipe's (8.03 against 8.23 MiB, the constrained recipe's the same), with
    its norm scales and biases whole 0.78x (6.45); FLOPs unchanged. (Read from
    ``memory_analysis()``'s temporaries, [Note: TPU temporaries], the first was 1.09x: 14.05
    against 12.89, and 10.84 whole.)"""
    from benchmarks import memory_sweep

    mesh = memory_sweep.target_mesh(CompileTarget.parse("tpu:v5p:2x2x2"))
    model = memory_sweep.Model("transformer", False, 4, 128, 16, remat=False)
    sharded = memory_sweep.measure(model, mesh, ("recipe", "jshard"))
    whole = memory_sweep.measure(model, mesh, ("jshard",), replicate_below=4096)
    recipe = sharded["peak_bytes"]["recipe"]
    assert whole["peak_bytes"]["jshard"] < min(0.85 * recipe, sharded["peak_bytes"]["jshard"] - 2**20)
    assert whole["flops"]["jshard"] == sharded["flops"]["jshard"]


def test_backward_prefetch_off_frees_the_prefetched_layer_on_v5p():
    """``backward_prefetch=False`` ([Note: unrolled units]): the sweep's four unrolled 512-wide tanh
    layers, bf16, recomputed, vectors whole, without the async flags. With the prefetch backward
    holds a re-gathered layer beside the next layer's backward: 2.77 MiB (the recipe 3.53);
    without it 2.74, at the same FLOPs (libtpu 0.0.50.1: 2.98 and 2.79, the recipe 3.66; with one
    reduction phase per torus dimension 3.01 and 2.74 on 0.0.42.1)."""
    from benchmarks import memory_sweep

    mesh = memory_sweep.target_mesh(CompileTarget.parse("tpu:v5p:2x2x2"))
    model = memory_sweep.Model("tanh", False, 4, 512, 64, remat=True, bf16=True)
    on = memory_sweep.measure(model, mesh, ("recipe", "jshard"), replicate_below=4096)
    off = memory_sweep.measure(model, mesh, ("jshard",), replicate_below=4096, backward_prefetch=False)
    assert on["peak_bytes"]["recipe"] > on["peak_bytes"]["jshard"] > off["peak_bytes"]["jshard"]
    assert off["flops"]["jshard"] == on["flops"]["jshard"]


@other_libtpu('the plain residuals saved 0.28 MiB there (9.45 against 9.73, read from memory_analysis()), not 0.25')
def test_an_unrolled_transformer_stores_residuals_as_plain_differentiation_on_v5p(monkeypatch):
    """[Note: residual rounding]: under jshard's own policy the step drops the no-op rounding
    ``jax.checkpoint`` puts on residuals, so XLA:TPU may store a float32 activation read only by
    default-precision matmuls as bfloat16 (the sweep's transformer, 2 unrolled 128-wide blocks,
    batch 16, kept: 4.69 MiB in HBM against 5.15 with the rounding; 4 blocks 8.03 against 9.04;
    read from ``memory_analysis()``'s temporaries, 9.02 against 9.68 and 15.89 against 17.18;
    stacked, 4 blocks moved by 0.04)."""
    import jshard._step.value_and_grad as value_and_grad
    from benchmarks import memory_sweep

    mesh = memory_sweep.target_mesh(CompileTarget.parse("tpu:v5p:2x2x2"))
    model = memory_sweep.Model("transformer", False, 2, 128, 16, remat=False)
    plain = memory_sweep.measure(model, mesh, ("jshard",))["peak_bytes"]["jshard"]
    monkeypatch.setattr(value_and_grad, "without_residual_rounding", lambda f: f)
    rounded = memory_sweep.measure(model, mesh, ("jshard",))["peak_bytes"]["jshard"]
    assert plain < rounded - 2**18


def test_stacked_layers_recompute_elementwise_arithmetic_on_v5p(monkeypatch):
    """[Note: loop residuals] on XLA:TPU: the sweep's four stacked 512 -> 1536 GELU blocks, 64 rows,
    activations kept, fp32. jshard's peak is 9.84 MiB against the recipe's 12.41; with the
    elementwise arithmetic saved (the loop stacks each GELU intermediate over the layers) it is
    12.96."""
    import jshard._step.remat as remat
    from benchmarks import memory_sweep

    mesh = memory_sweep.target_mesh(CompileTarget.parse("tpu:v5p:2x2x2"))
    model = memory_sweep.Model("gelu", True, 4, 512, 64, remat=False)
    peaks = memory_sweep.measure(model, mesh, ("recipe", "jshard"))["peak_bytes"]
    monkeypatch.setattr(remat, "_ELEMENTWISE", frozenset())
    saved = memory_sweep.measure(model, mesh, ("jshard",))["peak_bytes"]["jshard"]
    assert peaks["jshard"] <= peaks["recipe"] < saved, (peaks, saved)


def test_the_memory_bound_holds_for_unrolled_units_on_v5p():
    """An extra unrolled unit adds its activations, not a fraction of a gathered layer, on XLA:TPU
    as on CPU, and no residual is pinned by an ``optimization_barrier`` ([Note: unrolled units]).

    The bound is read from XLA's live peak (``peak_memory_in_bytes``, less the arguments), not
    from ``temp_size_in_bytes``, the size of the temporaries' allocation, whose packing varies
    with the program: 25.9 MiB at 4 layers and 51.9 at 8 while the live peak less the arguments
    was 24.5 and 24.8. With the backward re-gathers merged into the forward gathers it grew by
    29.9 MiB (30.2 -> 60.1) from 4 to 8 layers of 24 MiB gathered each. It is read from 8 layers
    on: with two reduction phases ([Note: two phases]) the 4-layer program holds less than the
    rest (18.3 MiB; 24.2 at 6, then 25.7 from 8 to 16 layers, where one phase per torus
    dimension grew 0.14 MiB a layer, 24.8 -> 26.0)."""
    from benchmarks import memory_sweep

    mesh = memory_sweep.target_mesh(CompileTarget.parse("tpu:v5p:2x2x2"))
    live = {}
    for layers in (8, 16):
        step, args = memory_sweep.jshard_step(memory_sweep.Model("gelu", False, layers, 1024, 64, remat=False), mesh)
        lowered = step.lower(*args)
        assert "optimization_barrier" not in lowered.as_text()
        stats = lowered.compile().memory_analysis()
        live[layers] = stats.peak_memory_in_bytes - stats.argument_size_in_bytes
    gathered_layer = 2 * 1024 * 3072 * 4
    assert live[16] - live[8] < 0.1 * gathered_layer


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



def test_a_two_slice_plan_shows_the_traffic_between_slices():
    """HSDP over two v5p slices: FSDP inside each slice, the replica all-reduce of the gradients
    across the data-center network (XLA:TPU sends it to its megascale runtime)."""
    p = plan(_mlp_builder, target=CompileTarget.parse("tpu:v5p:2x2x1", slices=2), replicate=2)
    assert p.report.mesh == {"replicate": 2, "fsdp": 4}
    assert all(c.group_size <= 4 for c in p.report.collectives)  # nothing inside a slice crosses it
    grads = (2 * 2 * 256 * 512 * 4 + 256 * 128 * 4) / 4  # each device's gradient shards, fp32
    assert p.dcn_bytes >= grads  # every shard crosses the data-center network (plus the loss)
    assert "between slices (data-center network)" in str(p)
    # the report's all-reduce row compares within-slice all-reduces with the cross-slice figure: said
    assert p.report.collective_bytes["all-reduce"] < 0.1 * p.report.analytic.all_reduce
    assert "the analytic all-reduce across replicas" in str(p)


def test_the_tpu_planning_commands_of_docs_planning_run(capsys):
    """docs/planning.md's <!-- tpu-planning-commands -->, each on this file's small builder and a
    small topology of the same generation (the pip line is what the test extra installs)."""
    import pathlib
    import re
    import shlex

    from jshard.report import main

    text = (pathlib.Path(__file__).parents[1] / "docs" / "planning.md").read_text()
    block = re.search(r"<!-- tpu-planning-commands -->\s*```bash\n(.*?)```", text, re.S).group(1)
    small = {"tpu:v5p-256": "tpu:v5p-8", "tpu:v6e:16x16": "tpu:v6e:2x2"}
    commands = [line.split("#")[0].split() for line in block.splitlines() if "jshard.report" in line]
    assert len(commands) == 4
    for words in commands:
        argv = [small.get(w, w).replace("pkg.module:build", "test_tpu_compiler:_mlp_builder") for w in words[3:]]
        argv = ["4" if w == "8,16,32,64,128" else w for w in argv]  # scaling: the small target's one size
        if argv[0] == "frontier":
            argv += ["--batches", "1", "--remats", "default", "--reshard-after-forward", "true",
                     "--mixed-precision", "true"]
        main(argv)
        out = capsys.readouterr().out
        assert "compiled for tpu" in out or "frontier" in out, shlex.join(argv)
        if argv[0] == "frontier":  # both options, each a setting: four configurations at batch 1
            assert "4 configurations compiled, 4 fit" in out, out
            assert "leaves under 4096 whole, weight gradients from activations" in out
        if "--slices" in argv:
            assert "between slices (data-center network)" in out


def test_scaling_on_a_tpu_target_plans_a_slice_of_its_generation_per_size():
    """`scaling --target tpu:...`: each size is a slice of the target's generation up to its size."""
    s = scaling(_mlp_builder, (4, 8, 16), target=CompileTarget.parse("tpu:v5e-8"))
    assert s.devices == [4, 8] and [p.platform for p in s.plans] == ["tpu", "tpu"]
    assert s.plans[0].report.memory.argument > s.plans[1].report.memory.argument
    assert CompileTarget.parse("tpu:v5p-256").resized(16).topology == "v5p:2x2x4"
    with pytest.raises(ValueError, match=r"No v6e slice has 12 chips"):
        CompileTarget.parse("tpu:v6e-16").resized(12)


def test_v5p_gathers_in_torus_phases_where_one_all_gather_would_be_an_all_reduce():
    """[Note: torus phases]: XLA:TPU keeps one all-gather over 8 or 32 v5p chips, or over half of
    an 8x8x8 (HSDP's group), native but makes one over every chip of a 4x4x4 slice an all-reduce
    of a zero-filled full buffer; gathered one torus dimension at a time it stays three native
    all-gathers, in less memory. Over part of a slice the step keeps one all-gather (measured
    16.0 MiB of temporaries against 18.5 in phases)."""

    def gather(topology, phases=None, replicate=1):
        mesh = js.make_mesh(devices=_tpu(topology), replicate=replicate)
        phases = gather_phases(mesh, ("fsdp",)) if phases is None else phases
        f = jax.shard_map(lambda w: jnp.tanh(js.collectives.all_gather(w, ("fsdp",), 0, phases=phases)).sum(0)[None],
                          mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"))
        sharding = NamedSharding(mesh, P("fsdp"))
        arg = jax.ShapeDtypeStruct((mesh.shape["fsdp"] * 64, 1024), jnp.float32, sharding=sharding)
        compiled = jax.jit(f).lower(arg).compile()
        collectives = step_collectives(compiled.as_text())
        return phases, [(c.kind, c.group_size) for c in collectives], compiled.memory_analysis().temp_size_in_bytes

    assert gather("v5p:2x2x2")[:2] == ((), [("all-gather", 8)])
    assert gather("v5p:2x4x4")[:2] == ((), [("all-gather", 32)])
    _, kinds, one_native = gather("v5p:8x8x8", replicate=2)
    _, _, phased_native = gather("v5p:8x8x8", phases=(8, 8, 4), replicate=2)
    assert kinds == [("all-gather", 256)] and one_native < phased_native
    phases, kinds, phased = gather("v5p:4x4x4")
    assert (phases, kinds) == ((4, 4, 4), [("all-gather", 4)] * 3)
    _, one_kinds, one = gather("v5p:4x4x4", phases=())
    assert one_kinds == [("all-reduce", 64)]
    full = 64 * 64 * 1024 * 4  # 16 MiB: one 48.0 MiB of temporaries, in phases 22.0
    assert one >= 3 * full > 1.5 * full >= phased


def test_a_16x16_slice_all_reduces_small_all_gathers_and_keeps_larger_ones():
    """[Note: torus phases]: over every chip of a 16x16 v6e slice XLA:TPU sends an all-gather of
    64 KiB a chip (16 MiB gathered) as an all-reduce (twice the bytes: the Llama-3-8B plan's key
    and value kernels, `[16, 1024]` bf16 a chip) and keeps one of 96 KiB (24 MiB) native; the step
    gathers there in one collective (no phases), as on a 2x4."""

    mesh = js.make_mesh(devices=_tpu("v6e:16x16"))
    assert gather_phases(mesh, ("fsdp",)) == ()

    def kinds(rows):
        f = jax.shard_map(lambda w: js.collectives.all_gather(w, ("fsdp",), 0), mesh=mesh, in_specs=P("fsdp"),
                          out_specs=P(), check_vma=False)
        arg = jax.ShapeDtypeStruct((256 * rows, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
        return {(c.kind, c.group_size) for c in step_collectives(jax.jit(f).lower(arg).compile().as_text())}

    assert kinds(32) == {("all-reduce", 256)}  # 64 KiB a chip
    assert kinds(48) == {("all-gather", 256)}  # 96 KiB a chip


def test_a_step_on_a_4x4x4_v5p_slice_gathers_natively_at_the_ring_bytes():
    """On v5p-128 every parameter collective runs along one torus ring (groups of 4) or over a
    4x4 plane of it (an unrolled unit's first reduction phase: [Note: two phases]), none over
    the slice as an all-reduce: all-gathers carry (N-1)/N of the parameters per gather, in bf16
    (forward, and backward's re-gather of the stacked layers), gradient reductions too, and
    what is all-reduced (small leaves' phases, the loss) is a few percent of it."""
    p = plan(_mlp_builder, target="tpu:v5p:4x4x4", config=PlanConfig(**FSDP2_LAYOUT))
    blocks, head = 2 * 2 * 256 * 512 * 4, 256 * 128 * 4
    large = [c for c in p.report.collectives if c.bytes > 64]
    assert {c.group_size for c in large if c.kind == "all-gather" or c.in_loop} == {4}
    # the head's second phase, 16 rows over groups of 4, XLA:TPU all-reduces (a few KiB)
    assert [c.group_size for c in large if c.kind == "reduce-scatter" and not c.in_loop] == [16]
    ring = (blocks + head) * 63 / 64
    sent = p.report.collective_bytes
    # the float32 weights go on the wire in bfloat16 (their readers are default-precision matmuls)
    assert sent["all-gather"] == (2 * blocks + head) / 2 * 63 / 64
    assert ring <= sent["reduce-scatter"] + sent["all-reduce"] and sent["all-reduce"] < 0.06 * ring


@pytest.mark.parametrize("precision, wire", [(None, "bfloat16"), (jax.lax.Precision.HIGHEST, "float32")])
def test_xla_tpu_gathers_float32_weights_in_bfloat16_for_default_precision_matmuls(precision, wire):
    """A float32 layer whose only reader is a default-precision matmul (which rounds its inputs
    to bfloat16 on TPU) is gathered in bfloat16 by XLA:TPU (the convert moves before the
    all-gather), so it sends half the float32 figure; the report counts the bytes sent, not the
    dtype asked for (it keeps the asked dtype only where XLA:CPU widened a bf16 collective).
    At HIGHEST precision the matmul reads float32 and the gathers stay float32."""
    mesh = js.make_mesh(devices=_tpu("v5p:2x2x2"))
    stack = js.fully_shard({"w": jax.ShapeDtypeStruct((4, 512, 512), jnp.float32)}, mesh,
                           js.FullyShardPolicy(scan_axis=0))

    def loss_fn(p, x):
        h, _ = js.scan(lambda h, layer: (jnp.tanh(jnp.dot(h, layer["w"], precision=precision)), None), x, p)
        return jnp.mean(h ** 2)

    report = step_report(js.value_and_grad(loss_fn, unshard_params=False), stack,
                         jax.ShapeDtypeStruct((64, 512), jnp.float32))
    gathers = [c for c in report.collectives if c.kind == "all-gather"]
    assert gathers and {(c.dtype, c.compiled_dtype) for c in gathers} == {(wire, wire)}
    scale = 2 if wire == "bfloat16" else 1
    assert report.collective_bytes["all-gather"] * scale == report.analytic.all_gather


def _gather_schedules(flags: str, *pers: str) -> dict[str, list[dict]]:
    env = {**os.environ, "LIBTPU_INIT_ARGS": flags, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "tpu_gather_schedule.py"), "512", *pers], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@other_libtpu(ASYNC_GATHER_REFUSED)
def test_all_gathers_overlap_the_previous_layers_matmuls_under_the_async_collective_flags():
    """Unrolled GELU units on v5p 2x2x2 (docs/benchmarks.md "When the gathers run"): by default
    XLA:TPU runs every all-gather synchronously; under MaxText's async-collective flags most
    run asynchronously with the previous layer's matmuls scheduled in flight (measured: 8 of 13
    per-leaf gathers, 4 of 7 per-unit ones, 1-4 matmuls each; the first layer's has nothing to
    overlap and XLA overlaps one collective at a time). 13 and 7: the last unit's backward uses
    its forward gather ([Note: unrolled units]), the first unit's input needs no gradient."""
    plain = _gather_schedules("", "leaf")["leaf"]
    assert len(plain) == 13 and not any(g["asynchronous"] for g in plain)
    _assert_overlapped(_gather_schedules(ASYNC_COLLECTIVE_FLAGS, "leaf")["leaf"], 13)


@other_libtpu(ASYNC_GATHER_REFUSED)
def test_whole_leaves_do_not_hold_back_the_forward_gathers_under_the_async_collective_flags():
    """gather_leaf orders only gathered shards after the previous unit ([Note: unrolled units]):
    four unrolled 512-wide tanh layers, biases kept whole, activations kept. When the whole
    biases waited on the previous unit too, XLA:TPU ran every other forward gather synchronously
    (synchronous, overlapped, synchronous, overlapped); now every forward gather after the
    first overlaps the previous layer's matmul, as in the recipe."""
    schedule = _gather_schedules(ASYNC_COLLECTIVE_FLAGS, "whole")["whole"]
    assert len(schedule) == 6  # 4 forward, 2 re-gathers (the first and last units need none)
    assert [g["matmuls_overlapped"] > 0 for g in schedule[:4]] == [False, True, True, True]


# XLA:TPU's code generation takes ~5x longer on the flat buffers (docs/benchmarks.md): the slow run.
@pytest.mark.slow
def test_one_gather_per_unit_overlaps_too_under_the_async_collective_flags():
    _assert_overlapped(_gather_schedules(ASYNC_COLLECTIVE_FLAGS, "unit")["unit"], 7)


def _assert_overlapped(schedule: list[dict], gathers: int) -> None:
    overlapped = [g["matmuls_overlapped"] for g in schedule if g["asynchronous"]]
    assert len(schedule) == gathers and len(overlapped) > gathers / 2
    assert min(overlapped) >= 1


def test_float8_gathers_compile_to_uint8_all_gathers_of_half_the_bf16_bytes_on_v5p():
    """docs/benchmarks.md "Gather options on XLA:TPU": ``js.float8_all_gather`` stays one
    ``uint8`` all-gather per leaf on XLA:TPU, of half a bf16 gather's bytes plus one float32
    scale per row of the shard (two unrolled 256 -> 768 GELU units: 197632 and 199680 bytes
    per gathered leaf against 393216)."""
    from benchmarks import memory_sweep

    mesh = memory_sweep.target_mesh(CompileTarget.parse("tpu:v5p:2x2x2"))
    model = memory_sweep.Model("gelu", False, 2, 256, 64, remat=False, bf16=True)

    def gathers(**policy):
        step, args = memory_sweep.jshard_step(model, mesh, **policy)
        with jax.numpy_dtype_promotion("standard"):
            text = step.lower(*args).compile().as_text()
        return [c for c in step_collectives(text) if c.kind == "all-gather"]

    bf16, fp8 = gathers(), gathers(custom_all_gather=js.float8_all_gather)
    assert {c.compiled_dtype for c in bf16} == {"bfloat16"} and {c.compiled_dtype for c in fp8} == {"uint8"}
    assert {c.bytes for c in bf16} == {256 * 768 * 2}
    # One byte per element, then four per row of each shard (w1's shards have 32 rows, w2's 96).
    assert {c.bytes for c in fp8} == {256 * 768 + 8 * 32 * 4, 768 * 256 + 8 * 96 * 4}


def test_attention_matmuls_count_the_same_on_tpu_as_on_cpu():
    """[Note: convolution taps]: XLA:TPU writes the attention's per-head products as convolutions
    with padded windows; counted per window tap that lands on the input, the sweep's stacked
    4x128 transformer (recomputed, a training step) has the matmul FLOPs XLA:CPU's dots give,
    for the recipe and for jshard. Counting whole windows read the recipe's as 2.04 GFLOP
    against 0.83 (and jshard's as 1.29 against 0.82), so TPU FLOP ratios of attention models
    compared miscounts."""
    from benchmarks import memory_sweep

    model = memory_sweep.Model("transformer", True, 4, 128, 16, remat=True)
    flops = {}
    for target in ("tpu:v5p:2x2x2", "cpu:8"):
        mesh = memory_sweep.target_mesh(CompileTarget.parse(target))
        for variant in ("recipe", "jshard"):
            step, args = memory_sweep.variant_step(model, mesh, variant, apply_sgd=True)
            flops[target, variant] = memory_sweep.matmul_flops(step.lower(*args).compile().as_text())
    assert flops["tpu:v5p:2x2x2", "recipe"] == flops["cpu:8", "recipe"] == 826277888
    assert flops["tpu:v5p:2x2x2", "jshard"] == flops["cpu:8", "jshard"] == 817889280


@functools.cache
def _demo_llama_tiny_on_v5p(weight_gradients: str):
    """The demo's NNX Llama at the test size (bf16 parameters, every layer recomputed, one sequence
    a device) compiled for v5p 2x2x2 with ``FullyShardPolicy(weight_gradients=...)``."""
    from benchmarks.memory_sweep import target_mesh
    from jshard.demo import llama3

    mesh = target_mesh(CompileTarget.parse("tpu:v5p:2x2x2"))
    config = PlanConfig(batch_per_device=1, remat="full", mixed_precision=True, replicate_below=0,
                        weight_gradients=weight_gradients)
    step, args, _ = llama3.build_nnx_model(mesh, config, llama3.TINY)
    return step.lower(*args).compile()


def test_the_demo_llama_loss_leaves_xla_tpu_no_scatter_into_the_logits():
    """[Note: one-hot cross-entropy]: the demo's Llama loss takes one-hot labels, so its gradient
    is elementwise and XLA:TPU has no scatter into the float32 logit gradient to offload to the
    SparseCore (with integer labels it had one, ``f32[32,512]`` at the test size, and a second
    logits-sized buffer for it: the Llama-3-8B plan on v5p-256 peaked at 7.38 GiB against 4.95).
    The embedding's gradient stays a scatter, so the reading can see one."""
    import re

    from jshard.demo import llama3

    cfg = llama3.TINY
    text = _demo_llama_tiny_on_v5p("reduced").as_text()
    scatters = [line for line in text.splitlines() if re.search(r"= \S+ scatter\(|scatter_offload", line)]
    assert any(f"bf16[{cfg.vocab},{cfg.dim}]" in line for line in scatters)  # the embedding's gradient
    assert not [line for line in scatters if f"[{cfg.seq_len},{cfg.vocab}]" in line or "scatter_offload" in line]


def test_the_demo_llamas_embedding_is_looked_up_on_its_shard_on_v5p():
    """[Note: row lookup route]: with ``weight_gradients="from_activations"`` the demo Llama's
    embedding (512 rows, 32 tokens a device) is neither gathered nor reduced whole in the program
    XLA:TPU compiles: its all-gather and its gradient's scatter into the whole table are gone, four
    all-to-alls take their place (the shard's columns, the tokens' columns, ``dy``'s columns, the
    gradient's rows), and the temporaries fall (float32 reduction: 7725536 -> 7692832 bytes on libtpu
    0.0.42.1)."""
    import re

    from jshard.demo import llama3

    cfg = llama3.TINY
    compiled = {route: _demo_llama_tiny_on_v5p(route) for route in ("reduced", "from_activations")}
    table = f"[{cfg.vocab},{cfg.dim}]"
    for route, program in compiled.items():
        text, routed = program.as_text(), route == "from_activations"
        gathers = re.findall(r"= (\S+) all-gather(?:-start)?\(", text)
        assert any(table in g for g in gathers) != routed, route
        assert len(re.findall(r"= \S+ all-to-all\(", text)) == (4 if routed else 0)
        assert any(re.search(rf"= \S+{re.escape(table)}\S* scatter\(", line) for line in text.splitlines()) != routed
    temp = {route: Memory.from_compiled(program).temp for route, program in compiled.items()}
    assert temp["from_activations"] < temp["reduced"]


# Compiling the 8B programs for 128 chips takes 2 (NNX) and 4 (Hugging Face, 32 unrolled layers)
# minutes here: the slow run.
@pytest.mark.slow
@pytest.mark.parametrize("build, peak_mib, scattered_mib", [("build_nnx", 5064.3, 30367.8),
                                                            ("build_hf", 8179.1, 30361.8)])
def test_llama3_8b_plans_on_the_tpu_compiler_as_docs_planning_says(build, peak_mib, scattered_mib):
    """docs/planning.md's Llama-3-8B plans on XLA:TPU (v5p-256: 128 chips; bf16 parameters, float32
    reduction, every layer recomputed): arguments at the analytic figure, reduce-scatters within
    0.11% of it, as measured (the phases' padding more, the output matrix's last phase less:
    XLA:TPU makes that one an all-reduce, 221.3 MiB; the Hugging Face model's 32 unrolled layers,
    reduced in two phases, pad 6 MiB less than the NNX scan's), all-gathers at it or one decoder
    layer's gather short (the Hugging Face model's last layer's re-gather, merged with its forward
    gather) and the peak as measured. FSDP2's layout, named: v5p's own defaults route the gradients."""
    p = plan(f"jshard.demo.llama3:{build}", target="tpu:v5p-256",
             config=PlanConfig(mixed_precision=True, remat="full", **FSDP2_LAYOUT))
    a, mib = p.report.analytic, 2.0**20
    wire = p.report.collective_bytes
    assert p.platform == "tpu" and a.devices == 128 and a.params == 8_030_261_248
    assert p.report.memory.argument == pytest.approx(a.argument_bytes, rel=1e-3)
    assert wire["reduce-scatter"] == pytest.approx(a.reduce_scatter, rel=1.1e-3)
    assert wire["reduce-scatter"] / mib == pytest.approx(scattered_mib, abs=0.1)
    assert 0 <= a.all_gather - wire["all-gather"] <= 413 * mib
    assert wire["all-reduce"] / mib == pytest.approx(221.3, abs=0.1)
    assert p.report.memory.peak / mib == pytest.approx(peak_mib, abs=1.0)


def test_weight_gradients_in_blocks_never_hold_a_whole_gradient_on_v5p():
    """[Note: weight gradient blocks]: the sweep's eight unrolled 1536-wide tanh layers, activations
    kept, float32, training step (v5p 2x2x2): with ``weight_gradients="in_blocks"`` each layer's
    gradient is formed and reduce-scattered 4 blocks of columns at a time, and the step peaks below
    both the reduced route's and the recipe's (17.82 MiB against 27.74 and 23.87 on libtpu 0.0.42.1;
    19.31 against 28.49 and 21.18 on 0.0.50.1), reduce-scatter bytes and matmul FLOPs the same."""
    from benchmarks import memory_sweep

    mesh = memory_sweep.target_mesh(CompileTarget.parse("tpu:v5p:2x2x2"))
    model = memory_sweep.Model("tanh", False, 8, 1536, 512, remat=False)
    reduced = memory_sweep.measure(model, mesh, ("recipe", "jshard"), apply_sgd=True)
    blocked = memory_sweep.measure(model, mesh, ("jshard",), apply_sgd=True, weight_gradients="in_blocks")
    peak = {"recipe": reduced["peak_bytes"]["recipe"], "reduced": reduced["peak_bytes"]["jshard"],
            "in_blocks": blocked["peak_bytes"]["jshard"]}
    assert peak["in_blocks"] < min(peak["recipe"], 0.7 * peak["reduced"]), peak
    sent = (reduced["collective_bytes"]["jshard"], blocked["collective_bytes"]["jshard"])
    assert sent[1]["reduce-scatter"] == sent[0]["reduce-scatter"] and sent[1]["all-reduce"] == sent[0]["all-reduce"]
    assert blocked["flops"]["jshard"] == reduced["flops"]["jshard"]


@pytest.mark.parametrize("remat", [None, jax.checkpoint_policies.nothing_saveable], ids=["kept", "recomputed"])
def test_a_kept_heads_gradient_in_blocks_on_v5p(remat):
    """[Note: weight gradient blocks]: a unit of ``[1024, 1024]`` and the root's head ``[1024, 8192]``
    (float32, kept gathered, as a language model's output head) before a logsumexp, 64 rows a device,
    v5p 2x2x2. With ``weight_gradients="in_blocks"`` the head's 32 MiB gradient is formed and
    reduce-scattered 4 blocks at a time: the step peaks at 30.03 MiB against the reduced route's
    57.56 (43.63 against 57.59 with every unit recomputed, the gathered head kept by both), at the
    same bytes, gathers and matmul FLOPs (libtpu 0.0.42.1; 0.0.50.1: 28.44 against 57.59, 46.12
    against 57.63)."""
    from benchmarks import memory_sweep

    mesh = memory_sweep.target_mesh(CompileTarget.parse("tpu:v5p:2x2x2"))
    x = jax.ShapeDtypeStruct((8 * 64, 1024), jnp.float32)
    figures = {}
    for route in ("reduced", "in_blocks"):
        params = head_params(mesh, js.FullyShardPolicy(weight_gradients=route), 1024, 8192)
        step = jax.jit(js.value_and_grad(head_loss, unshard_params=False, remat_policy=remat))
        figures[route] = memory_sweep.compiled_figures(step, (params, x))
    reduced, blocked = figures["reduced"], figures["in_blocks"]
    assert blocked["peak_bytes"] < (0.6 if remat is None else 0.85) * reduced["peak_bytes"], figures
    for key in ("collective_bytes", "gathers", "flops"):
        assert blocked[key] == reduced[key], key


def test_a_heads_gradient_xla_tpu_would_all_reduce_is_reduced_in_aligned_blocks_on_v5e():
    """[Note: weight gradient blocks]: the Llama-3-8B output head's shape, ``[4096, 128256]`` float32,
    in the root (kept gathered) after a ``[4096, 4096]`` unit, 8 rows a device, v5e 8x8. XLA:TPU
    all-reduces the first torus phase of its whole gradient, and of its 4 or 2 equal blocks
    (``[4096, 32064]``, ``[4096, 64128]``), but scatters blocks 32768 and 29952 columns wide. So
    with ``weight_gradients="in_blocks"`` the gradient is reduce-scattered in those blocks and
    only the loss is all-reduced: peak 1099.5 MiB against the reduced route's 2319.9, which all-reduces
    3945.4 MiB a step (libtpu 0.0.42.1; equal blocks only: 2320.1, the reduced route's program)."""
    from benchmarks import memory_sweep

    mesh = memory_sweep.target_mesh(CompileTarget.parse("tpu:v5e:8x8"))
    x = jax.ShapeDtypeStruct((64 * 8, 4096), jnp.float32)
    figures = {}
    for route in ("reduced", "in_blocks"):
        params = head_params(mesh, js.FullyShardPolicy(weight_gradients=route, replicate_below=0), 4096, 128256)
        step = jax.jit(js.value_and_grad(head_loss, unshard_params=False))
        figures[route] = memory_sweep.compiled_figures(step, (params, x))
    reduced, blocked = (figures[route]["collective_bytes"] for route in ("reduced", "in_blocks"))
    gradient = 4096 * 128256 * 4
    assert reduced["all-reduce"] > 1.9 * gradient and blocked["all-reduce"] < 64, figures  # the loss alone
    assert blocked["reduce-scatter"] == pytest.approx((gradient + 4096 * 4096 * 4) * 63 / 64)
    assert figures["in_blocks"]["peak_bytes"] < 0.5 * figures["reduced"]["peak_bytes"], figures


@pytest.mark.parametrize("target, width, blocked", [("tpu:v5p:2x2x2", 256, False), ("tpu:v5p:2x2x2", 512, True),
                                                    ("cpu:8", 256, True)])
def test_the_combined_route_blocks_a_matrix_it_leaves_where_its_gradient_is_large(target, width, blocked):
    """[Note: weight gradient blocks]: two unrolled transformer blocks, activations kept, 64
    sequences of 64 tokens (512 rows a device: more than the matrices' inputs, so the route from
    activations leaves every matmul). With ``"from_activations+in_blocks"`` on TPU the 256-wide
    blocks' float32 gradients (``[256, 1024]``, 1 MiB) keep the reduced route: the lowered step
    reduce-scatters as many times as with ``"from_activations"``; the 512-wide ones' MLP gradients
    (4 MiB) are formed in blocks, as on CPU every matrix whose blocks XLA keeps whole is."""
    from benchmarks import memory_sweep

    tpu = target.startswith("tpu")
    mesh = memory_sweep.target_mesh(CompileTarget.parse(target)) if tpu else js.make_mesh()
    model = memory_sweep.Model("transformer", False, 2, width, 64, remat=False)
    scatters = {}
    for route in ("from_activations", "from_activations+in_blocks"):
        step, args = memory_sweep.jshard_step(model, mesh, weight_gradients=route)
        scatters[route] = len(re.findall(r"stablehlo\.reduce_scatter", step.lower(*args).as_text()))
    more = scatters["from_activations+in_blocks"] - scatters["from_activations"]
    assert (more > 0) == blocked, scatters


def test_gradients_reach_their_reduce_scatters_scattered_dim_first_on_v5p():
    """``collectives.reduce_scatter(dim_major=True)``: the sweep's unrolled 8x256 transformer, activations kept, with
    ``weight_gradients="in_blocks"`` (training step, v5p 2x2x2). XLA:TPU's layout assignment laid
    the MLP's gradient blocks and the attention output's whole gradient out with their scattered
    dim minor, and its reduce-scatter-decomposer made each of those reduce-scatters an all-reduce:
    28.22 MiB of all-reduce a step beside 7.27 of reduce-scatter. Handed over scattered dim first,
    they stay reduce-scatters: the reduced route's 21.27 MiB, and 0.22 of all-reduce (the vectors',
    too small for XLA:TPU to scatter)."""
    from benchmarks import memory_sweep

    mesh = memory_sweep.target_mesh(CompileTarget.parse("tpu:v5p:2x2x2"))
    model = memory_sweep.Model("transformer", False, 8, 256, 16, remat=False)
    reduced = memory_sweep.measure(model, mesh, ("jshard",), apply_sgd=True)["collective_bytes"]["jshard"]
    blocked = memory_sweep.measure(model, mesh, ("jshard",), apply_sgd=True,
                                   weight_gradients="in_blocks")["collective_bytes"]["jshard"]
    assert blocked["reduce-scatter"] == reduced["reduce-scatter"], (blocked, reduced)
    assert blocked["all-reduce"] == reduced["all-reduce"] < 0.25 * 2**20, (blocked, reduced)


def test_tpu_temporaries_are_what_the_compiler_checks_against_hbm():
    """[Note: TPU temporaries]: a recomputing ``lax.scan`` step on one v5p chip. ``memory_analysis()``
    counts 592.2 MiB of temporaries where the buffer assignment allocates 432.1 in HBM (160.1 of it
    fragmentation, which ``temp_size_in_bytes`` counts twice); under an HBM of 1 MiB less than the
    plan's peak, the compiler's own check names the plan's peak as what the step needs."""
    from tpu_hbm_check import sgd_scan

    step, args = sgd_scan()
    compiled, assignment = compile_reading_assignment(step.lower(*args))
    memory, mib = Memory.from_compiled(compiled, assignment), 2**20
    assert memory.xla_temp > 1.3 * memory.temp, (memory.xla_temp / mib, memory.temp / mib)
    limit = int(memory.peak / mib) - 1
    env = {**os.environ, "LIBTPU_INIT_ARGS": f"--xla_tpu_max_hbm_size_mib={limit}", "PYTHONPATH": str(ROOT),
           "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "tpu_hbm_check.py")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    required = json.loads(done.stdout.strip().splitlines()[-1])["required_mib"]
    assert required == pytest.approx(memory.peak / mib, abs=0.1), (required, memory.peak / mib)
    assert (memory.argument + memory.output + memory.xla_temp - memory.alias) / mib > required + 150
