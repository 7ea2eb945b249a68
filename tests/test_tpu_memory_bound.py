"""FSDP's memory bound for every kind of unit (``tests/test_memory_bound.py``'s models) as
XLA:TPU compiles it for v5p 2x2x2, without a TPU (deviceless compilation; see
``tests/test_tpu_compiler.py``). Its own file so that the test run's workers share the TPU
compiles."""

import jax.numpy as jnp
import pytest
from jax_behaviour import on_other_libtpu, other_libtpu_reason
from memory_models import KINDS, activation_bytes, fsdp2_bound, layer_bytes, step_memory

import jshard as js
from benchmarks import heap_at_peak, memory_sweep
from jshard._sharding.platform_defaults import FSDP2_LAYOUT
from jshard.report import CompileTarget


def _hbm_temporaries(stats) -> int:
    """XLA:TPU's live peak in HBM less what the step takes and returns: ``memory_analysis()`` on
    TPU counts HBM only (buffers XLA places in on-chip memory count 0), and ``temp_size_in_bytes``
    is the temporaries' allocation, whose packing jumps with depth (25.3 MiB at 4 unrolled
    2048-wide layers, 42.5 at 8, 42.3 at 12)."""
    taken = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
    return stats.peak_memory_in_bytes - taken


def _v5p_mesh():
    return memory_sweep.target_mesh(CompileTarget.parse("tpu:v5p:2x2x2"))


def _mixed_precision(precision: str) -> js.MixedPrecisionPolicy:
    return js.MixedPrecisionPolicy() if precision == "fp32" else js.MixedPrecisionPolicy(jnp.bfloat16, jnp.float32)


def _bound_growth(kind: str, raf: bool, precision: str, width: int = 2048, **layout) -> tuple[float, dict[int, int]]:
    """Per extra layer, from 4 to 12, the HBM temporaries' growth; and the allocation at each depth. FSDP2's
    layout unless ``layout`` says otherwise (v5p's own defaults differ: [Note: platform defaults])."""
    mesh = _v5p_mesh()
    layout = {**FSDP2_LAYOUT, **layout}
    policy = js.FullyShardPolicy(reshard_after_forward=raf, mp_policy=_mixed_precision(precision), **layout)
    stats = {layers: step_memory(kind, layers, policy, mesh, width)[0] for layers in (4, 12)}
    grown = (_hbm_temporaries(stats[12]) - _hbm_temporaries(stats[4])) / 8
    return grown, {layers: s.temp_size_in_bytes for layers, s in stats.items()}


# FSDP2's layout on v5p: core units and ``js.scan`` in the default run; NNX and Linen units run
# there under the TPU defaults below, and every kind on CPU under FSDP2's layout
# (tests/test_memory_bound.py).
FSDP2_KINDS = [kind if kind in ("core", "scan") else pytest.param(kind, marks=pytest.mark.slow) for kind in KINDS]
# The TPU defaults: nested units (core's layers, nested) and NNX's and Linen's stacks (``js.scan``'s
# loop, lifted) in -m slow.
DEFAULTS_KINDS = [pytest.param(kind, marks=pytest.mark.slow) if kind in ("nested", "nnx_scan", "linen_scan") else kind
                  for kind in KINDS]


@pytest.mark.parametrize("kind", FSDP2_KINDS)
def test_the_memory_bound_holds_for_every_kind_of_unit_on_v5p(kind):
    """tests/test_memory_bound.py's tanh MLP, every kind of unit, 2048 wide (a gathered layer is
    16 MiB in fp32, 8 in bf16) so that XLA:TPU keeps its layers in HBM: with
    ``reshard_after_forward=True`` an extra layer adds at most three activations and a
    sixteenth of a layer (1.75 MiB), and the allocation stays within FSDP2's bound at 4 and 12
    layers. Measured (MiB per layer, fp32 / bf16): core and nested 0.61 / 0.81, NNX 0.18 / 1.02,
    Linen 0.24 / 1.02, stacked 1.50 / 1.38 (``js.scan``) and 1.39 / 1.26 (``nnx.scan``,
    ``nn.scan``): a stack's shards in bf16, 1 MiB per layer, which XLA:TPU casts before its loop
    for the default-precision matmuls, and activations. Unrolled units grow unevenly (NNX in bf16:
    1.97 from 4 to 8 layers, 0.06 from 8 to 12, where a re-gathered layer is in HBM at the peak
    of 8 and not of 4), so the growth is read over eight layers."""
    for precision in ("fp32", "bf16"):
        grown, temp = _bound_growth(kind, True, precision)
        assert grown <= 3 * activation_bytes(2048) + layer_bytes(2048) // 16, (kind, precision, grown / 2**20)
        for layers, allocated in temp.items():
            assert allocated <= fsdp2_bound(layers, 2048), (kind, precision, layers, allocated / 2**20)


@pytest.mark.parametrize("kind", ["core", "scan"])
def test_the_tpu_memory_bound_catches_gathered_layers_kept(kind):
    """The reading above can fail: ``reshard_after_forward=False`` keeps each layer's gathered
    weight (XLA:TPU keeps it in bf16 for the default-precision matmul, 8 MiB): core units grow by
    7.83 MiB per layer, ``js.scan`` by 8.50."""
    grown, _ = _bound_growth(kind, False, "fp32")
    assert grown > 3 * activation_bytes(2048) + layer_bytes(2048) // 16, (kind, grown / 2**20)


def _hbm_occupied(kind: str, layers: int, policy: js.FullyShardPolicy, tmp_path, mesh=None, width: int = 2048) -> int:
    """The most bytes of XLA:TPU's HBM temporaries occupied at once, read from its buffer assignment and
    live ranges (``benchmarks.heap_at_peak``): what the device holds beyond what the step takes and returns."""
    directory = tmp_path / f"{kind}_{layers}"
    step_memory(kind, layers, policy, mesh or _v5p_mesh(), width, compiler_options={"xla_dump_to": str(directory)})
    return heap_at_peak.read_dump(directory)[0].occupied


@pytest.mark.parametrize("kind", DEFAULTS_KINDS)
def test_the_memory_bound_holds_with_v5ps_own_defaults(kind, tmp_path):
    """v5p's defaults ([Note: platform defaults]: vectors whole, weight gradients from activations
    where that sends less, else in blocks): the layers' matmuls run on the shard (32 rows a device
    against 2048 inputs), and an extra layer adds at most three activations and a sixteenth of a
    layer to the HBM XLA:TPU holds at its fullest. Measured (MiB per layer from 4 to 12 layers, fp32 /
    bf16): core 1.06 / 0.99, nested 0.09 / 0.13, NNX and Linen 0.80 / 0.86, ``js.scan`` 1.75 / 1.41
    (the stack's bf16 cast, 1 MiB a layer), ``nnx.scan`` and ``nn.scan`` 1.00 / 1.00; at 12 layers
    2.75-19.53 MiB. With the route alone and vectors sharded (the twenty-second session): core and
    nested 0.09 / 1.12, NNX and Linen 0.09 / 0.12, the stacks as here; the reduced route 26.25-32.50
    MiB at 12 layers. ``memory_analysis()``'s peak less the arguments reads more with the defaults
    (1.25-2.01 MiB per layer): its unitemised part, not what the buffers occupy."""
    limit = 3 * activation_bytes(2048) + layer_bytes(2048) // 16
    for precision in ("fp32", "bf16"):
        policy = js.FullyShardPolicy(mp_policy=_mixed_precision(precision))
        held = {layers: _hbm_occupied(kind, layers, policy, tmp_path / precision) for layers in (4, 12)}
        grown = (held[12] - held[4]) / 8
        if grown > limit and kind in ("nnx_scan", "linen_scan") and on_other_libtpu():
            pytest.xfail(other_libtpu_reason("the stacked NNX and Linen units grow by 1.87 MiB a layer in fp32, "
                                             "over the 1.75 MiB bound"))
        assert grown <= limit, (kind, precision, held)


def test_the_hbm_reading_catches_gathered_layers_kept(tmp_path):
    """The reading above can fail: with ``reshard_after_forward=False`` no matrix is routed (a routed one is
    freed after forward) and each layer's gathered weight is kept, 8 MiB in bf16."""
    policy = js.FullyShardPolicy(reshard_after_forward=False, weight_gradients="from_activations")
    held = {layers: _hbm_occupied("core", layers, policy, tmp_path) for layers in (4, 12)}
    assert (held[12] - held[4]) / 8 > 3 * activation_bytes(2048) + layer_bytes(2048) // 16, held


@pytest.mark.parametrize("kind", ["core", pytest.param("scan", marks=pytest.mark.slow)])  # stacks: v5p's test above
def test_the_memory_bound_holds_with_the_tpu_defaults_on_v6e(kind, tmp_path):
    """[Note: platform defaults] on v6e 2x4: the same tanh MLP, 8192 wide (a gathered float32 layer
    is 256 MiB; at 2048 wide XLA:TPU keeps every temporary on chip there and HBM reads 0, and at 4
    layers of 8192 too), read from 8 to 12 layers: an extra layer adds at most three activations
    and a sixteenth of a layer (19 MiB). Measured (fp32 / bf16, MiB per layer): core and nested
    2.64 / 1.63, NNX 2.65 / 2.00, Linen 1.77 / 1.01, at 12 layers 4.03-12.56 MiB; the stacks 16.03-
    16.25, their shards' bf16 cast (16 MiB a layer), 192.13-193.00 MiB at 12 layers, where FSDP2's
    layout holds 719.00 (``js.scan``, fp32, 591.00 at 4)."""
    mesh = memory_sweep.target_mesh(CompileTarget.parse("tpu:v6e:2x4"))
    policy = js.FullyShardPolicy()
    held = {layers: _hbm_occupied(kind, layers, policy, tmp_path, mesh, 8192) for layers in (8, 12)}
    assert 0 < (held[12] - held[8]) / 4 <= 3 * activation_bytes(8192) + layer_bytes(8192) // 16, held
