"""Linen params boxed with partitioning metadata (``nn.with_partitioning``, logical axis names).

Flax Linen's ``init`` returns such params boxed (``nn.Partitioned``, ``nn.LogicallyPartitioned``)
and unplaced; the boxes name the mesh axes (or logical axes, mapped through the axis rules in
context) that split each leaf. ``shard_params`` unboxes them and places each leaf so on its
unit's mesh, so that ``fully_shard`` keeps the split over the model axes ([Note: model axes]).
"""

from __future__ import annotations

from typing import Any

import jax
from flax import linen as nn
from flax.core import meta
from jax.sharding import NamedSharding, PartitionSpec

from jshard._sharding.nested import get_in, set_in
from jshard.flax._paths import Path


def is_box(x: Any) -> bool:
    return isinstance(x, meta.AxisMetadata)


def _spec(box: Any) -> PartitionSpec:
    if isinstance(box, nn.LogicallyPartitioned):
        return nn.logical_to_mesh_axes(box.names, box.rules)
    return PartitionSpec(*box.names)


def unbox(params: Any) -> tuple[Any, dict[Path, PartitionSpec]]:
    """``params`` without boxes, and the spec each boxed leaf's metadata names, by key path."""
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_box)[0]
    specs = {tuple(k.key for k in path): _spec(x) for path, x in flat if isinstance(x, nn.Partitioned)}
    return meta.unbox(params), specs


def place(params: dict, specs: dict[Path, PartitionSpec], mesh_of: Any) -> dict:
    """Each leaf that had a box placed on ``mesh_of(path)`` as its spec says."""
    for path, spec in specs.items():
        params = set_in(params, path, jax.device_put(get_in(params, path), NamedSharding(mesh_of(path), spec)))
    return params
