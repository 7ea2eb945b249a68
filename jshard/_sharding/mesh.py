"""Meshes: the default FSDP / HSDP mesh, and which axes shard and which replicate."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from jshard._sharding.policies import DataParallelMeshDims, FullyShardPolicy


def make_mesh(*, replicate: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The default data-parallel mesh over all global devices (every process).

    Args:
      replicate: ``1`` gives a 1-D mesh with axis ``"fsdp"``; ``R > 1`` gives a 2-D
        HSDP mesh with axes ``("replicate", "fsdp")`` and shape ``(R, N // R)``.
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
    if replicate == 1:
        return jax.make_mesh((n,), ("fsdp",), devices=devices)
    return jax.make_mesh((replicate, n // replicate), ("replicate", "fsdp"), devices=devices)


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """Resolved axes of a mesh: what shards (FSDP), what replicates (HSDP), and sizes.

    ``model`` are the other axes with their sizes (tensor parallel and friends, "model
    axes"): leaves may arrive sharded over them, and the step leaves them to GSPMD or
    explicit sharding (see docs/parallelism.md).
    """

    shard: tuple[str, ...]
    replicate: tuple[str, ...]
    shard_size: int
    replicate_size: int
    model: tuple[tuple[str, int], ...] = ()

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
    return MeshAxes(
        shard=dims.shard,
        replicate=dims.replicate,
        shard_size=math.prod(mesh.shape[a] for a in dims.shard),
        replicate_size=math.prod(mesh.shape[a] for a in dims.replicate),
        model=tuple((a, mesh.shape[a]) for a in names if a not in dims.shard + dims.replicate),
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
