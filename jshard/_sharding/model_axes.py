"""Leaves that arrive sharded over model axes (tensor parallel and friends), and their specs.

[Note: model axes] A mesh's "model axes" are its axes that neither shard nor replicate
(``MeshAxes.model``). A leaf that arrives sharded over them (a ``NamedSharding`` on the
unit's mesh) keeps that split: ``LeafLayout.model[d]`` names the model axes that split
dim ``d``. The FSDP split goes to a dim no model axis splits (``default_dim`` over the
free dims). Where none is free (a tensor-parallel bias), both split the same dim, FSDP
outermost: it is padded to a multiple of ``N * M`` and device ``(f, m)`` holds block
``f * M + m``. FSDP2's strided sharding puts TP outermost instead; jshard puts FSDP
outermost so that the step's ``shard_map``, manual over the data-parallel axes only, sees
each device's FSDP block as one contiguous piece. Either way a device holds ``1 / (N * M)``
of the leaf. In the step every FSDP collective on such a mesh runs in a ``shard_map``
manual over the mesh's model axes too (``jshard/_step/model_manual.py``).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jshard._sharding.mesh import MeshAxes

Entries = tuple[tuple[str, ...], ...]


def _names(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _same_mesh(a: Any, b: Any) -> bool:
    return tuple(a.shape.items()) == tuple(b.shape.items())


def incoming_model_axes(leaf: Any, mesh: Any, axes: MeshAxes) -> Entries:
    """Per dim, the model axes that split ``leaf`` as it arrives (``()`` when none do).

    Only a ``NamedSharding`` on a mesh of the unit's axes counts (a leaf placed elsewhere,
    e.g. on one device, has nothing to keep; a traced leaf's is its type's); data-parallel
    axes in it are dropped (jshard places the leaf over them itself).
    """
    sharding = incoming_sharding(leaf)
    if not axes.model or not isinstance(sharding, NamedSharding) or not _same_mesh(sharding.mesh, mesh):
        return ()
    spec = tuple(sharding.spec) + (None,) * (len(leaf.shape) - len(sharding.spec))
    model = set(axes.model_names)
    entries = tuple(tuple(n for n in _names(e) if n in model) for e in spec)
    return entries if any(entries) else ()


def incoming_sharding(leaf: Any) -> Any:
    """The sharding ``leaf`` arrives with: a concrete array's, or a traced value's type's (its
    ``Explicit`` axes: a traced value's ``Auto`` split is not known before XLA's propagation)."""
    if isinstance(leaf, jax.core.Tracer):
        return jax.typeof(leaf).sharding
    return getattr(leaf, "sharding", None)


def spec_of(entries: list[tuple[str, ...]] | Entries) -> PartitionSpec:
    """A ``PartitionSpec`` from per-dim axis names (a single name as itself, trailing dims left out)."""
    out = [None if not names else names[0] if len(names) == 1 else tuple(names) for names in entries]
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def model_spec(model: Entries, ndim: int, *, without: int | None = None) -> PartitionSpec:
    """The model axes of each dim as a spec (dim ``without`` left replicated)."""
    entries = list(model) or [()] * ndim
    if without is not None:
        entries[without] = ()
    return spec_of(entries)


def axes_of_type(mesh: Any, kind: AxisType) -> tuple[str, ...]:
    """The mesh's axes of one type (``AxisType.Explicit`` or ``AxisType.Auto``)."""
    return tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == kind)


def only_axes(sharding: NamedSharding, names: tuple[str, ...]) -> NamedSharding:
    """``sharding`` with the axes not in ``names`` dropped from its spec.

    JAX takes Explicit axes only in ``reshard`` / ``auto_axes(out_sharding=)`` and Auto axes
    only in ``with_sharding_constraint``; a mesh with both gets each its part.
    """
    entries = [tuple(n for n in _names(e) if n in names) for e in sharding.spec]
    return NamedSharding(sharding.mesh, spec_of(entries), memory_kind=sharding.memory_kind)
