"""FSDP collectives of a leaf that model axes split, run manual over those axes too.

XLA replicates a collective's operand over the mesh axes left to GSPMD (or to explicit
sharding), so an all-gather over ``fsdp`` of a weight split over ``tp`` would gather the
whole weight on every ``tp`` device (measured on jax 0.10.2 and 0.12.0.1, Shardy and
GSPMD alike). Inside the step, each FSDP collective therefore runs in a ``shard_map``
manual over the mesh's model axes as well: every device then gathers and reduce-scatters
only its own model-axis block ([Note: model axes]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec

from jshard._sharding.layout import LeafLayout
from jshard._sharding.mesh import MeshAxes
from jshard._sharding.model_axes import model_spec


def model_manual(layout: LeafLayout, axes: MeshAxes, fn: Callable[[Any], Any], gathered_in: bool,
                 gathered_out: bool) -> Callable:
    """``fn`` on this device's model-axis block of its argument, on a mesh with model axes.

    Every model axis of the mesh is made manual (a leaf no model axis splits is replicated
    over them): besides keeping each device to its own block, this keeps every FSDP
    collective out of the partially manual region, where XLA:CPU aborts on bf16 reductions
    ("Invalid binary instruction opcode copy", jax 0.10.2). ``gathered_in`` /
    ``gathered_out``: the argument / result is the gathered leaf (a composed placement dim
    then holds the whole dim), else the stored shard.
    """
    if not axes.model:
        return fn

    def spec(gathered: bool):
        return model_spec(layout.model, len(layout.shape), without=layout.dim if gathered and layout.composed else None)

    return manual_over_model_axes(fn, axes, spec(gathered_in), spec(gathered_out))


REPLICATED = PartitionSpec()


def manual_over_model_axes(fn: Callable[[Any], Any], axes: MeshAxes, in_spec: PartitionSpec = REPLICATED,
                           out_spec: PartitionSpec = REPLICATED) -> Callable:
    """``fn`` in a ``shard_map`` manual over the mesh's model axes (by default replicated over them)."""
    return jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(), in_specs=in_spec, out_specs=out_spec,
                         axis_names=set(axes.model_names), check_vma=False)


def _blocks(layout: LeafLayout, axes: MeshAxes) -> tuple[int, int, int]:
    m = axes.model_size(layout.model[layout.dim])
    return axes.shard_size, m, layout.padded // (axes.shard_size * m)


def interleave_model(x: jax.Array, layout: LeafLayout, axes: MeshAxes) -> jax.Array:
    """The whole composed dim from each model block's FSDP blocks: ``x`` holds, on the device of
    model index ``m``, the blocks ``(f, m)`` for every ``f``; the result all of them, block
    ``f * M + m`` at its place. Identity unless the placement dim is composed."""
    if not layout.composed:
        return x
    n, m, c = _blocks(layout, axes)
    d = layout.dim
    parts = jax.lax.all_gather(x, layout.model[d], axis=0, tiled=False)  # (M, ..., N*c, ...)
    parts = parts.reshape((m,) + x.shape[:d] + (n, c) + x.shape[d + 1 :])
    parts = jax.numpy.moveaxis(parts, 0, d + 1)  # (..., N, M, c, ...)
    return parts.reshape(x.shape[:d] + (n * m * c,) + x.shape[d + 1 :])


def model_piece(g: jax.Array, layout: LeafLayout, axes: MeshAxes) -> jax.Array:
    """The inverse selection for a gradient: of the whole (padded) composed dim, the blocks
    ``(f, m)`` of this device's model index ``m``, in ``f`` order. Identity unless composed."""
    if not layout.composed:
        return g
    n, m, c = _blocks(layout, axes)
    d = layout.dim
    g = g.reshape(g.shape[:d] + (n, m, c) + g.shape[d + 1 :])
    g = jax.lax.dynamic_index_in_dim(g, jax.lax.axis_index(layout.model[d]), axis=d + 1, keepdims=False)
    return g.reshape(g.shape[:d] + (n * c,) + g.shape[d + 2 :])
