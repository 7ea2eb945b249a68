"""Every stored leaf of a tree with its unit's facts, keyed by its path in the user's own tree.

State dicts and checkpoints address leaves by their path in the tree without unit nodes
(``params["block"]["w"]``, ``opt_state[0].mu["block"]["w"]``), so they do not depend on
how the tree was split into units, nor on the mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from jshard._sharding.layout import LeafLayout, named_sharding
from jshard._sharding.unit import UnitMeta, is_unit, map_unit_leaves


@dataclasses.dataclass(frozen=True)
class StoredLeaf:
    """One stored leaf: its path without unit nodes, its unit's meta and layout (``None`` outside units).

    ``sharding`` is where the stored leaf belongs: its layout's sharding, else the
    leaf's own (an abstract mesh made concrete with a unit's mesh), else ``None``.
    """

    path: tuple
    meta: UnitMeta | None
    layout: LeafLayout | None
    leaf: Any
    sharding: Any

    @property
    def name(self) -> str:
        return jax.tree_util.keystr(self.path)

    @property
    def keys(self) -> tuple[str, ...]:
        """The path as strings (dict keys, sequence indices, field names): how checkpoints name the leaf."""
        return tuple(key_name(e) for e in self.path) or ("value",)

    @property
    def shape(self) -> tuple[int, ...]:
        """The original (unpadded) shape; a stage-split stack's first ``layers`` layers only."""
        return tuple(np.shape(self.leaf)) if self.layout is None else self.layout.unpadded_shape


def key_name(entry: Any) -> str:
    """One path entry as a string: a dict key, a sequence index, a field name."""
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _sharding(meta: UnitMeta | None, layout: LeafLayout | None, leaf: Any, meshes: dict) -> Any:
    if layout is not None and layout.ignored:
        return NamedSharding(meta.mesh, PartitionSpec())
    if layout is not None:
        return named_sharding(meta.mesh, layout, meta.axes, meta.policy)
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, AbstractMesh) and sharding.mesh in meshes:
        return NamedSharding(meshes[sharding.mesh], sharding.spec, memory_kind=sharding.memory_kind)
    return sharding


def as_like(like: Any, value: Any) -> Any:
    """A value restored for the leaf ``like``: Python scalars come back as Python scalars, the rest as given."""
    return type(like)(value) if isinstance(like, int | float | bool) else value


def strip_units(tree: Any) -> Any:
    """``tree`` with every unit replaced by its inner tree (the same leaves, the user's structure)."""
    return jax.tree.map(lambda x: strip_units(x.tree) if is_unit(x) else x, tree, is_leaf=is_unit)


def stored_leaves(tree: Any) -> list[StoredLeaf]:
    """The stored leaves of ``tree`` in ``jax.tree.leaves`` order."""

    class _Facts:  # a pytree leaf holding one leaf's facts
        def __init__(self, meta, layout):
            self.meta, self.layout = meta, layout

    facts = jax.tree.leaves(map_unit_leaves(lambda meta, layout, x: _Facts(meta, layout), tree))
    meshes = {f.meta.mesh.abstract_mesh: f.meta.mesh for f in facts if f.meta is not None}
    paths_leaves = jax.tree.flatten_with_path(strip_units(tree))[0]
    return [StoredLeaf(p, f.meta, f.layout, x, _sharding(f.meta, f.layout, x, meshes))
            for (p, x), f in zip(paths_leaves, facts, strict=True)]


def check_structure(tree: Any, like: Any, what: str) -> list[Any]:
    """The leaves of ``tree``, which must have the structure of ``like`` without unit nodes."""
    treedef = jax.tree.structure(strip_units(like))
    try:
        return treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"The {what} does not have the structure of `like` (without unit nodes): {e}; pass a {what} made "
            "from a tree of the same structure."
        ) from None
