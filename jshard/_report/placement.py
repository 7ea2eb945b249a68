"""Where each leaf of a sharded tree is split, and how much of what it stores is padding."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from jshard._sharding.unit import map_unit_leaves


@dataclasses.dataclass(frozen=True)
class LeafPlacement:
    """One leaf: its key path, original and stored shapes, placement dim and padding share.

    ``padding_share`` is the fraction of the stored (padded) leaf that is zeros, which is
    also the fraction of each device's shard that holds no parameter on average.
    """

    path: str
    shape: tuple[int, ...]
    stored: tuple[int, ...]
    dim: int | None
    padding_share: float


def placements(params: Any) -> tuple[LeafPlacement, ...]:
    """Every leaf's :class:`LeafPlacement`, in tree order (leaves outside units are left out).

    Example:
      >>> import jax.numpy as jnp, jshard as js
      >>> from jshard._report.placement import placements
      >>> [(p.path, p.dim, p.padding_share) for p in placements(js.fully_shard({"k": jnp.ones((1, 1, 4, 8))}))]
      [("['k']", 3, 0.0)]
    """
    layouts: list[Any] = []
    map_unit_leaves(lambda meta, layout, x: layouts.append(layout), params)
    out = []
    for (path, _), layout in zip(jax.tree_util.tree_flatten_with_path(params)[0], layouts, strict=True):
        if layout is None:
            continue
        stored = math.prod(layout.padded_shape)
        share = (stored - math.prod(layout.shape)) / stored if stored else 0.0
        out.append(LeafPlacement(jax.tree_util.keystr(path), layout.shape, layout.padded_shape, layout.dim, share))
    return tuple(out)


def parameter_count(tree: Any) -> int:
    """Elements of the parameters as they were written, padding excluded.

    ``sum(x.size for x in jax.tree.leaves(sharded))`` counts the stored arrays, padding
    rows included; this counts each leaf at its original shape (the figure the report
    prints as "parameters").

    Example:
      >>> import jax, jax.numpy as jnp, jshard as js
      >>> from jshard.report import parameter_count
      >>> sharded = js.fully_shard({"w": jnp.ones((15, 13)), "v": jnp.ones((15, 2)), "b": jnp.ones(15)})
      >>> parameter_count(sharded), sum(x.size for x in jax.tree.leaves(sharded))
      (240, 256)
    """
    sizes = map_unit_leaves(lambda meta, layout, x: math.prod(x.shape if layout is None else layout.shape), tree)
    return int(sum(jax.tree.leaves(sizes)))
