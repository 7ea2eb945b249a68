"""How gradient reduce-scatters and parameter all-gathers follow the physical torus of a TPU slice.

[Note: torus phases] XLA:TPU on chips with a 3-D torus (v4, v5p) rewrites a reduce-scatter
over every device of a slice (one group; each slice's group of a multi-slice program too) that
spans more than one torus dimension into an all-reduce of the whole gradient followed by a
slice (its ``reduce-scatter-decomposer`` pass; measured on libtpu 0.0.42: an FSDP group of 8
v5p chips, 2x2x2). That moves twice a reduce-scatter's bytes and holds a full-size result per
gradient. A reduce-scatter along *one* torus dimension stays native there, and so does one over
part of a slice, in any order (two groups of 32 chips of a 4x4x4, each spanning all three
dimensions; HSDP's groups; the FSDP groups of a ``"tp"`` mesh: libtpu 0.0.42.1 and 0.0.50.1).
So when the devices of the shard axes form a row-major grid over torus dimensions (as
:func:`jshard.make_mesh` lays them out), the step reduces a gradient in one phase per
dimension, slowest first: each phase is a native reduce-scatter over the devices that differ
only in that coordinate, keeps this device's block, and the last leaves it exactly the chunk a
single reduce-scatter would (row-major digits). The bytes sent add up to ``(N - 1) / N`` of the
gradient, a ring reduce-scatter's. On 2-D tori (v5e, v6e) XLA:TPU keeps one reduce-scatter over
2x4, 2x8 and 4x8 slices but makes one over all chips of a 4x4 or 8x8 slice an all-reduce (a
v5e-16's FSDP gradients: 3.98 MiB of all-reduce instead of 1.99 of reduce-scatter); there the
step asks the compiler and reduces in one phase per torus dimension too
(:func:`_planar_phases`; groups of 4 stay native whatever their order). On GPUs and on CPU one
reduce-scatter is kept.

Memory decides (:func:`phases_pay_off`): XLA runs the all-reduce in place, holding one full
gradient, but combines independent all-reduces into one, holding all of them at once; the
phases hold a gradient and its first phase's half-size result. Unrolled units' all-reduces are
combined across units (every layer's gradient at once), so they are always reduced in phases;
one layer of a stack (a loop body) can only be combined within itself, so it keeps the
all-reduce when it is a single large leaf beside small ones (a tanh layer's weight and bias).
Measured on v5p 2x2x2: six stacked 1536 -> 4608 GELU blocks, peak 138.4 -> 111.4 MiB with
phases; eight unrolled 1536-wide tanh layers, batch 512, 74.6 -> 25.8 MiB; four stacked
512-wide tanh layers, 2.41 MiB without against 3.00 with. Groups over part of a slice are
reduced in phases too, though one reduce-scatter would stay native there: the phases hold a
little less (the 1b demo model with HSDP R=2 on a v5p 2x2x2, 8006.7 MiB against 8138.5 with
one reduce-scatter; on a 4x4x4, 4591.6 against 4590.9; libtpu 0.0.42.1).

[Note: two phases] Since a reduce-scatter over part of a slice stays native, an unrolled unit's
gradient needs only two phases (:func:`unit_phases`): one over the devices that share the
fastest torus coordinate (every other dimension at once), then one along the fastest. The first
leaves ``last / N`` of the gradient (a quarter on a 2x2x2, a sixteenth on a 4x4x8), not half,
and the bytes are the same ring figure; a gradient whose first phase XLA:TPU would pad wider
keeps one phase per dimension (``phases_and_sizes`` in ``scatter_padding.py``). Measured on the
v5p 2x2x2 training-step sweep (48 models, SGD applied) against one phase per dimension: the
worst row (tanh, 8 unrolled layers of 1536, kept, fp32) 31.93 -> 27.74 MiB on libtpu 0.0.42.1
and 34.64 -> 28.49 on 0.0.50.1. Loop bodies keep one phase per dimension: there the two phases
moved the stacked gradient into the temporaries of the 1536 -> 4608 GELU stacks (+33 and +50
MiB on both compilers) and gained nothing on the 1b demo's scan (5618.4 against 5618.2 MiB on a
2x2x2, 4328.2 against 4327.7 on a 4x4x8).

All-gathers follow the same torus, with a different threshold: XLA:TPU keeps one native
all-gather over 8 to 64 v5p chips (2x2x2, 2x4x4, 2x4x8, 8x8 planes) and over part of a slice
in any order (HSDP's group of 256 chips of an 8x8x8: 16.0 MiB of temporaries for a 16 MiB
gather, 18.5 gathered in phases), but turns one over every chip of a 4x4x4 slice or larger
(v5p-128 and up) into an all-reduce of a zero-filled full-size buffer, whatever its size:
twice the bytes and three full-size buffers (a 16 MiB gather held 48 MiB of temporaries on
4x4x4). There the step gathers one torus dimension at a time, fastest first
(:func:`gather_phases`; 22.0 MiB); each phase is a native all-gather and the bytes are a ring
all-gather's. Two phases (the fastest dimension, then the plane sharing its coordinate) hold
less alone (17.0 MiB), and the 1b demo model's peak fell by 64 MiB with them on a 4x4x4 and
a 4x4x8, but XLA:TPU packed the Llama-3-8B NNX plan's temporaries worse around its
embedding's and head's gathers: peak 5064.3 -> 6368.9 MiB on v5p-256, 6173.1 -> 7197.1 on a
4x4x4, the same 3512.1 MiB occupied at its fullest (libtpu 0.0.42.1). So one per dimension.
On 2-D tori (v5e, v6e) one all-gather stays native over 4x4 and 4x8 slices. Over every chip of
an 8x8, 8x16 or 16x16 slice XLA:TPU all-reduces a gather whose result is 16 MiB or less (256,
128 and 64 KiB a chip) and keeps the next sizes measured native (32, 32 and 24 MiB: 512, 256 and
96 KiB a chip; bf16, libtpu 0.0.42.1, thirty-third session). Those bytes are few, so gathers
there are not phased.
The Llama-3-8B NNX plan sends its key and value kernels (8 MiB each, gathered) and norm scales
so: on ``v6e-256`` 2048 MiB of all-reduce a step where gathers would send 1021, 1.8% of the
step's bytes.
"""

from __future__ import annotations

import functools
import itertools

import jax
import numpy as np
from jax.sharding import Mesh

from jshard._sharding.compiler_probe import compiled_scatter

# Device kinds whose compiler decomposes reduce-scatters that span several torus dimensions.
DECOMPOSING_KINDS = frozenset({"TPU v4", "TPU v5", "TPU v5p"})


@functools.cache
def scatter_phases(mesh: Mesh, shard_axes: tuple[str, ...]) -> tuple[int, ...]:
    """Sizes of the per-dimension phases of a reduce-scatter over ``shard_axes`` (slowest
    first), or ``()`` where one reduce-scatter is kept (see the Note above). Cached: every
    ``fully_shard`` call on a mesh asks, for its gathers and its ring check too.

    Example:
      >>> import jshard as js
      >>> from jshard._sharding.torus import scatter_phases
      >>> scatter_phases(js.make_mesh(), ("fsdp",))  # CPU devices: one reduce-scatter
      ()
    """
    devices = mesh.devices
    if devices.flat[0].platform != "tpu":
        return ()
    names = list(mesh.axis_names)
    order = [names.index(a) for a in names if a not in shard_axes] + [names.index(a) for a in shard_axes]
    rows = np.transpose(devices, order).reshape(-1, int(np.prod([mesh.shape[a] for a in shard_axes])))
    coords = np.array([[list(d.coords) for d in row] for row in rows])  # (groups, N, torus dims)
    if devices.flat[0].device_kind not in DECOMPOSING_KINDS:
        return _planar_phases(mesh, shard_axes, coords)
    phases = _grid_order(coords[0])
    if phases is None or any(_grid_order(c) != phases for c in coords[1:]) or len(phases) < 2:
        return ()
    return tuple(size for _, size in phases)


def _planar_phases(mesh: Mesh, shard_axes: tuple[str, ...], coords: np.ndarray) -> tuple[int, ...]:
    """On a 2-D torus (v5e, v6e): the sizes of the two torus dimensions the shard axes span,
    where XLA:TPU makes one reduce-scatter over them an all-reduce (4x4 and 8x8 v5e/v6e
    slices do, 2x4, 2x8 and 4x8 do not: asked of the compiler), else ``()``. Each phase is a
    group of devices of consecutive indices or of one stride; XLA keeps those native."""
    spans = {tuple(len(set(group[:, d])) for d in range(group.shape[1])) for group in coords}
    sizes = tuple(size for size in spans.pop() if size > 1) if len(spans) == 1 else ()
    if len(sizes) < 2 or int(np.prod(sizes)) != coords.shape[1]:
        return ()
    kind, _ = compiled_scatter(mesh, shard_axes, None, (coords.shape[1] * 128, 512), "float32", 0)
    return tuple(sorted(sizes, reverse=True)) if kind == "all-reduce" else ()


def _grid_order(coords: np.ndarray) -> tuple[tuple[int, int], ...] | None:
    """``((torus dim, size), ...)`` slowest first, if the devices' coordinates run row-major
    over the dimensions that vary (each taking ``size`` consecutive values); else ``None``."""
    sizes = varying_dims(coords)
    varying = list(sizes)
    if int(np.prod(list(sizes.values()) or [1])) != len(coords):
        return None
    for perm in itertools.permutations(varying):
        digits = np.array(list(itertools.product(*(range(sizes[d]) for d in perm))))
        expected = [coords[:, d].min() + digits[:, k] for k, d in enumerate(perm)]
        if all(np.array_equal(coords[:, d], e) for d, e in zip(perm, expected, strict=True)):
            return tuple((d, sizes[d]) for d in perm)
    return None


def varying_dims(coords: np.ndarray) -> dict[int, int]:
    """``{torus dim: number of distinct coordinates}`` for the dimensions along which the devices
    of ``coords`` (one row of coordinates per device) differ, in dimension order.

    Example:
      >>> import numpy as np
      >>> from jshard._sharding.torus import varying_dims
      >>> varying_dims(np.array([[0, 0, 0], [1, 0, 0], [0, 0, 1], [1, 0, 1]]))
      {0: 2, 2: 2}
    """
    counts = {d: len(set(coords[:, d])) for d in range(coords.shape[1])}
    return {d: n for d, n in counts.items() if n > 1}


def gather_phases(mesh: Mesh, shard_axes: tuple[str, ...]) -> tuple[int, ...]:
    """Sizes of the per-dimension phases of an all-gather over ``shard_axes`` (slowest first), or
    ``()`` where one all-gather is kept: phases only where the devices are every chip of their
    slice and span all three torus dimensions with four or more chips each (see [Note: torus
    phases]).

    Example:
      >>> import jshard as js
      >>> from jshard._sharding.torus import gather_phases
      >>> gather_phases(js.make_mesh(), ("fsdp",))
      ()
    """
    phases = scatter_phases(mesh, shard_axes)
    if len(phases) != 3 or min(phases) < 4 or not whole_slices(mesh, shard_axes):
        return ()
    return phases


def whole_slices(mesh: Mesh, shard_axes: tuple[str, ...]) -> bool:
    """Whether each group of devices over ``shard_axes`` is every device of its slice (or of the
    mesh): the groups whose one reduce-scatter or all-gather XLA:TPU makes an all-reduce (see
    [Note: torus phases]).

    Example:
      >>> import jshard as js
      >>> from jshard._sharding.torus import whole_slices
      >>> whole_slices(js.make_mesh(), ("fsdp",)), whole_slices(js.make_mesh(replicate=2), ("fsdp",))
      (True, False)
    """
    slices = len({slice_of(d) for d in mesh.devices.flat})
    return int(np.prod([mesh.shape[a] for a in shard_axes])) in (mesh.devices.size, mesh.devices.size // slices)


def slice_of(device: jax.Device) -> int:
    """The TPU slice a device belongs to (0 for devices without ``slice_index``)."""
    return int(getattr(device, "slice_index", 0) or 0)


def phase_groups(phases: tuple[int, ...], k: int) -> list[list[int]]:
    """The device groups (indices over the shard axes) of phase ``k``: devices that differ
    only in digit ``k`` of their row-major index over ``phases``.

    Example:
      >>> from jshard._sharding.torus import phase_groups
      >>> phase_groups((2, 4), 0), phase_groups((2, 4), 1)
      ([[0, 4], [1, 5], [2, 6], [3, 7]], [[0, 1, 2, 3], [4, 5, 6, 7]])
    """
    index = np.arange(int(np.prod(phases))).reshape(phases)
    return np.moveaxis(index, k, -1).reshape(-1, phases[k]).tolist()


def phases_pay_off(leaf_bytes: list[int], in_loop: bool) -> bool:
    """Whether a unit (``in_loop``: one layer of a stack) with gradients of ``leaf_bytes`` is
    reduced in torus phases (see the Note).

    Example:
      >>> from jshard._sharding.torus import phases_pay_off
      >>> phases_pay_off([4 << 20, 4 << 20], True), phases_pay_off([4 << 20, 2 << 10], True)
      (True, False)
      >>> phases_pay_off([4 << 20, 2 << 10], False)
      True
    """
    sizes = sorted(leaf_bytes, reverse=True)
    return not in_loop or (len(sizes) > 1 and 2 * sizes[1] >= sizes[0])


def unit_phases(phases: tuple[int, ...], in_loop: bool) -> tuple[int, ...]:
    """The phases a unit's gradients are reduced in, given the mesh's per-dimension ``phases``:
    those in a loop body (``in_loop``: one layer of a stack); for an unrolled unit two, every
    torus dimension but the fastest at once (a reduce-scatter over part of the slice, which
    XLA:TPU keeps native), then the fastest, so that the first leaves ``last / N`` of the
    gradient where one per dimension leaves half of it (see [Note: two phases]).

    Example:
      >>> from jshard._sharding.torus import unit_phases
      >>> unit_phases((2, 2, 2), False), unit_phases((2, 2, 2), True), unit_phases((4, 4), False)
      ((4, 2), (2, 2, 2), (4, 4))
    """
    return phases if in_loop or len(phases) < 3 else (int(np.prod(phases[:-1])), phases[-1])
