"""Meshes: the default FSDP / HSDP mesh, and which axes shard and which replicate."""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jshard._sharding.policies import DataParallelMeshDims, FullyShardPolicy
from jshard._sharding.torus import (
    DECOMPOSING_KINDS,
    gather_phases,
    scatter_phases,
    slice_of,
    varying_dims,
    whole_slices,
)


def make_mesh(*, replicate: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The default data-parallel mesh over all global devices (every process).

    Args:
      replicate: ``1`` gives a 1-D mesh with axis ``"fsdp"``; ``R > 1`` gives a 2-D
        HSDP mesh with axes ``("replicate", "fsdp")`` and shape ``(R, N // R)``. Over
        devices of several TPU slices, ``R`` is a multiple of the number of slices and
        ``"replicate"`` runs across them, so that each FSDP group stays inside one slice
        (its all-gathers and reduce-scatters on the fast links, as
        ``mesh_utils.create_hybrid_device_mesh`` arranges); ``R = 1`` there spans the
        slices with one ``"fsdp"`` axis, every gather crossing the data-center network.
      devices: the devices to use (default: ``jax.devices()``).

    Returns:
      A :class:`jax.sharding.Mesh`.

    Example:
      >>> import jshard as js
      >>> js.make_mesh().axis_names
      ('fsdp',)
      >>> dict(js.make_mesh(replicate=2).shape)
      {'replicate': 2, 'fsdp': 4}
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if isinstance(replicate, bool) or not isinstance(replicate, int) or replicate < 1:
        raise ValueError(f"`replicate` must be a positive int, got {replicate!r}.")
    if n % replicate:
        raise ValueError(
            f"`replicate={replicate}` does not divide the {n} devices; choose a divisor of {n}."
        )
    slices = len({slice_of(d) for d in devices})
    if slices > 1:
        mesh = _multi_slice_mesh(devices, replicate, slices)
    elif replicate == 1:
        mesh = jax.make_mesh((n,), ("fsdp",), devices=devices)
    else:
        mesh = Mesh(_slice_grid((replicate, n // replicate), devices), ("replicate", "fsdp"),
                    axis_types=(AxisType.Explicit,) * 2)
    return torus_rows(mesh)


def _slice_grid(shape: tuple[int, ...], devices: list[jax.Device]) -> np.ndarray:
    """``jax.make_mesh``'s devices for ``shape`` over one slice; where jax's ``mesh_utils`` refuses
    because ``shape`` splits a torus dimension (two replicas of a v5p 4x4x4 or a v6e 4x4), the
    same devices with that dimension split (``allow_split_physical_axes``)."""
    try:
        return jax.make_mesh(shape, tuple(f"a{i}" for i in range(len(shape))), devices=devices).devices
    except NotImplementedError:
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)


def tensor_parallel_mesh(tensor_parallel: int, *, replicate: int = 1,
                         devices: Sequence[jax.Device] | None = None) -> Mesh:
    """:func:`make_mesh`'s mesh with its ``"fsdp"`` axis split into ``("fsdp", "tp")``, every axis Auto
    (GSPMD's tensor parallelism, as the demo's ``--tensor-parallel`` and the planner's meshes use it).

    Each ``"tp"`` group is ``tensor_parallel`` devices of one FSDP group, so it stays in one slice;
    on a TPU torus they run along a dimension of that size where there is one (else along the
    fastest, split), the FSDP groups row-major over the rest (on a v5p 2x2x2 with
    ``tensor_parallel=2`` a 2x2 grid, reduced in torus phases, which hold a little less than the
    one native reduce-scatter over jax 0.11+'s ring order: [Note: torus phases]). Unlike
    ``jax.make_mesh``, a ``"tp"`` axis that splits a torus dimension is built too (2 over a v5p
    4x4x4, which jax's ``mesh_utils`` refuses).

    Example:
      >>> from jshard._sharding.mesh import tensor_parallel_mesh
      >>> dict(tensor_parallel_mesh(2).shape), dict(tensor_parallel_mesh(2, replicate=2).shape)
      ({'fsdp': 4, 'tp': 2}, {'replicate': 2, 'fsdp': 2, 'tp': 2})
    """
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ValueError(f"`tensor_parallel` must be a positive int, got {tensor_parallel!r}.")
    mesh = make_mesh(replicate=replicate, devices=devices)
    if mesh.shape["fsdp"] % tensor_parallel:
        raise ValueError(
            f"`tensor_parallel={tensor_parallel}` does not divide mesh axis 'fsdp' of size {mesh.shape['fsdp']} "
            f"(mesh {{{_describe(mesh)}}}); choose a divisor of {mesh.shape['fsdp']}.")
    rows = [_tensor_parallel_last(list(row), tensor_parallel) for row in mesh.devices.reshape(-1, mesh.shape["fsdp"])]
    names = (*mesh.axis_names, "tp")
    shape = (*mesh.devices.shape[:-1], mesh.shape["fsdp"] // tensor_parallel, tensor_parallel)
    grid = np.array(rows).reshape(shape)
    for group in grid.reshape(-1, tensor_parallel):
        if len({slice_of(d) for d in group}) > 1:
            raise ValueError(
                f"`tensor_parallel={tensor_parallel}` does not divide the devices of each slice, so a 'tp' group "
                f"would span slices (mesh {{{_describe(mesh)}}}); choose a divisor of the devices per slice.")
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def _tensor_parallel_last(row: list[jax.Device], tensor_parallel: int) -> list[jax.Device]:
    """One FSDP group's devices ordered so that each ``tensor_parallel`` consecutive ones differ only
    along TPU torus dimensions whose sizes multiply to ``tensor_parallel`` (the fewest such, the
    first found), the other dimensions row-major before them; the group as it is where no
    dimensions fit (or the devices have no torus coordinates)."""
    if row[0].platform != "tpu":
        return row
    coords = np.array([d.coords for d in row])
    sizes = varying_dims(coords)
    varying = list(sizes)
    for count in range(1, len(varying) + 1):
        for dims in itertools.combinations(varying, count):
            if math.prod(sizes[d] for d in dims) == tensor_parallel:
                return _row_major(row, [d for d in varying if d not in dims] + list(dims))
    return row


def _row_major(row: list[jax.Device], dims: Sequence[int]) -> list[jax.Device]:
    """``row`` in row-major order over the torus coordinates ``dims`` (slowest first), slice by slice."""
    return sorted(row, key=lambda d: (slice_of(d), *(d.coords[k] for k in dims), d.core_on_chip))


def torus_rows(mesh: Mesh) -> Mesh:
    """``mesh`` (``"fsdp"`` its last axis), with each FSDP group's devices put in row-major order over
    the TPU torus where that lets its gradients be reduced in torus phases and jax's order does not
    ([Note: torus phases] in ``torus.py``); else ``mesh`` itself.

    jax 0.11+ lays the eight chips of a v5p 2x2x2 slice (one FSDP group, two, or one per slice) out
    as a ring, each chip a neighbour of the next, where 0.10 laid them out row-major: over the ring
    the step cannot reduce one torus dimension at a time, and XLA:TPU makes each gradient's
    reduce-scatter an all-reduce of the whole gradient, which its combiner merges across units
    (jax 0.12.0.1 with libtpu 0.0.50.1, v5p 2x2x2, twelve 2048-wide core units: 114.6 MiB of HBM
    temporaries held at once over the ring, 27.0 with the group reordered). Which device holds
    which shard within a group is free, so the group is reordered.

    Example:
      >>> import jshard as js
      >>> from jshard._sharding.mesh import torus_rows
      >>> mesh = js.make_mesh()
      >>> torus_rows(mesh) is mesh  # CPU devices: nothing to reorder
      True
    """
    first = mesh.devices.flat[0]
    if first.platform != "tpu" or first.device_kind not in DECOMPOSING_KINDS or scatter_phases(mesh, ("fsdp",)):
        return mesh
    rows = mesh.devices.reshape(-1, mesh.shape["fsdp"])
    grid = np.array([_row_major(list(row), range(len(first.coords))) for row in rows])
    ordered = Mesh(grid.reshape(mesh.devices.shape), mesh.axis_names, axis_types=mesh.axis_types)
    return ordered if scatter_phases(ordered, ("fsdp",)) else mesh


def _multi_slice_mesh(devices: list[jax.Device], replicate: int, slices: int) -> Mesh:
    """``("replicate", "fsdp")`` with ``replicate`` across slices: FSDP never leaves a slice
    (``replicate=1``: one ``"fsdp"`` axis over every slice, in slice order)."""
    n = len(devices)
    if replicate == 1:
        grid = mesh_utils.create_hybrid_device_mesh((n // slices,), (slices,), devices)
        return Mesh(np.asarray(grid), ("fsdp",), axis_types=(AxisType.Explicit,))
    if replicate % slices:
        raise ValueError(
            f"The {n} devices span {slices} slices: `replicate` must be a multiple of {slices} so that each "
            f"FSDP group stays inside one slice (got replicate={replicate}); use make_mesh(replicate={slices}), or "
            "replicate=1 for one FSDP group over all of them."
        )
    per_slice = replicate // slices
    grid = mesh_utils.create_hybrid_device_mesh((per_slice, n // replicate), (slices, 1), devices)
    return Mesh(np.asarray(grid), ("replicate", "fsdp"), axis_types=(AxisType.Explicit,) * 2)


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """Resolved axes of a mesh: what shards (FSDP), what replicates (HSDP), and sizes.

    ``model`` are the other axes with their sizes (tensor parallel and friends, "model
    axes"): leaves may arrive sharded over them, and the step leaves them to GSPMD or
    explicit sharding (see docs/parallelism.md). ``scatter_phases``: how a gradient's
    reduce-scatter over the shard axes follows the TPU torus, one phase per dimension
    (``()``: one reduce-scatter; see [Note: torus phases] in ``torus.py``); ``gather_phases``
    the same for a parameter's all-gather. ``tpu_mesh``: on TPU, the mesh whose compiler is
    asked which gradient sizes it reduce-scatters natively (see [Note: scatter padding] in
    ``scatter_padding.py``).
    """

    shard: tuple[str, ...]
    replicate: tuple[str, ...]
    shard_size: int
    replicate_size: int
    model: tuple[tuple[str, int], ...] = ()
    scatter_phases: tuple[int, ...] = ()
    gather_phases: tuple[int, ...] = ()
    tpu_mesh: Mesh | None = None

    @property
    def model_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.model)

    def model_size(self, names: tuple[str, ...]) -> int:
        """The number of devices along the model axes ``names``."""
        sizes = dict(self.model)
        return math.prod(sizes[n] for n in names)

    @property
    def data_parallel(self) -> tuple[str, ...]:
        """All axes the batch is split over: replicate axes first, then shard axes."""
        return self.replicate + self.shard

    @property
    def data_parallel_size(self) -> int:
        return self.shard_size * self.replicate_size

    @property
    def shard_entry(self) -> str | tuple[str, ...]:
        """The shard axes as one ``PartitionSpec`` entry (and as messages name them): the name of
        a single axis, else the tuple."""
        return self.shard[0] if len(self.shard) == 1 else self.shard


def _describe(mesh: Mesh) -> str:
    return ", ".join(f"{name!r}: {size}" for name, size in mesh.shape.items())


def resolve_axes(mesh: Mesh, dims: DataParallelMeshDims | None) -> MeshAxes:
    """Which axes of ``mesh`` shard and which replicate (see docs/design.md "Semantics")."""
    names = tuple(mesh.axis_names)
    if dims is None:
        if "fsdp" in names:
            dims = DataParallelMeshDims("fsdp", "replicate" if "replicate" in names else None)
        elif len(names) == 1:
            dims = DataParallelMeshDims(names[0])
        else:
            raise ValueError(
                f"Mesh with axes {{{_describe(mesh)}}} has no axis 'fsdp' and more than one "
                "axis: pass `dp_mesh_dims=js.DataParallelMeshDims(shard=..., replicate=...)` "
                "in the policy to say which axes shard and which replicate."
            )
    missing = [a for a in dims.shard + dims.replicate if a not in names]
    if missing:
        raise ValueError(
            f"Mesh with axes {{{_describe(mesh)}}} has no axis {missing[0]!r} named in "
            f"`dp_mesh_dims`; name axes of this mesh, or build the mesh with js.make_mesh()."
        )
    phases = scatter_phases(mesh, dims.shard)
    if (not phases and dims.shard == ("fsdp",) and names[-1] == "fsdp" and whole_slices(mesh, ("fsdp",))
            and torus_rows(mesh) is not mesh):
        warnings.warn(
            f"The {mesh.shape['fsdp']} devices of mesh axis 'fsdp' are not laid out row-major over the TPU "
            "torus (jax.make_mesh lays a v5p 2x2x2 slice out as a ring from jax 0.11 on), so gradients cannot "
            "be reduced one torus dimension at a time: XLA:TPU will all-reduce each gradient whole and hold "
            "several at once. Build the mesh with js.make_mesh(), which lays each FSDP group out row-major.",
            stacklevel=3)
    return MeshAxes(
        shard=dims.shard,
        replicate=dims.replicate,
        shard_size=math.prod(mesh.shape[a] for a in dims.shard),
        replicate_size=math.prod(mesh.shape[a] for a in dims.replicate),
        model=tuple((a, mesh.shape[a]) for a in names if a not in dims.shard + dims.replicate),
        scatter_phases=phases,
        gather_phases=gather_phases(mesh, dims.shard),
        tpu_mesh=mesh if mesh.devices.flat[0].platform == "tpu" else None,
    )


def check_reshard_group(axes: MeshAxes, policy: FullyShardPolicy) -> None:
    """Refuse ``reshard_after_forward=k`` unless ``k`` divides the shard size and is below it."""
    k = policy.reshard_after_forward
    if isinstance(k, bool) or not isinstance(k, int):
        return
    n = axes.shard_size
    if not (k < n and n % k == 0):
        raise ValueError(
            f"`reshard_after_forward={k}` must divide the shard size and be smaller than it: "
            f"mesh axis {axes.shard} has size {n}; choose a divisor of {n} below {n}, or True."
        )
