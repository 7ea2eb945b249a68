"""A step over units on different data-parallel axes of one mesh: its batch axes, each leaf's view.

[Note: step axes] Each unit resolves its own ``dp_mesh_dims`` (FSDP2's per-parameter mesh,
torchtitan's ``ShardPlacementResult``). On one mesh ``("data", "expert")`` the dense units
shard over both axes while the expert units shard over ``"data"`` only, their weights
``(E, d, f)`` arriving split over ``"expert"`` on dim 0. A step then splits its batch over
the *union* of its units' data-parallel axes (:func:`batch_axes`), and its ``shard_map`` is
manual over that union, so the loss may ``all_to_all`` over ``"expert"`` to dispatch tokens.
Inside it, each leaf is seen as :func:`leaf_view` says:

- the model axes of its unit that the step is manual over are no longer model axes: a dim
  they split holds this device's block (an expert unit's local experts), and no collective
  runs over them for that leaf; the contributions of other devices' tokens reach its
  gradient through the ``all_to_all``'s transpose;
- an axis of the batch split that neither the unit's axes nor the leaf's split name (a
  router weight stored whole in an expert unit) is one more replicate axis of that leaf: its
  gradient is all-reduced over it, as HSDP's are over ``replicate``;
- the gradient divide factor is the size of the whole batch split, not of the unit's own
  axes: the loss is the mean over every batch shard, so an expert gradient summed over
  ``"data"`` and, through the ``all_to_all``, over its expert group still divides by all of
  them (torchtitan sets this by hand with ``set_gradient_divide_factor``).

A step whose units all share one set of axes is the ordinary step: every view is the unit's
own layout and axes, unchanged.
"""

from __future__ import annotations

import dataclasses
import math

from jax.sharding import Mesh, PartitionSpec

from jshard._sharding.layout import LeafLayout, manual_spec
from jshard._sharding.mesh import MeshAxes
from jshard._sharding.model_axes import spec_of


def batch_axes(mesh: Mesh, units_axes: list[MeshAxes]) -> MeshAxes:
    """The axes a step's batch is split over: the one units' axes, or the union of several.

    For several, the replicate axes are every axis some unit replicates over, the shard axes
    every other axis some unit takes part on (mesh order), the model axes the rest.
    """
    first = units_axes[0]
    if all(axes == first for axes in units_axes):
        return first
    named = {a for axes in units_axes for a in axes.data_parallel}
    replicate = tuple(a for a in mesh.axis_names if any(a in axes.replicate for axes in units_axes))
    shard = tuple(a for a in mesh.axis_names if a in named and a not in replicate)
    return MeshAxes(
        shard=shard,
        replicate=replicate,
        shard_size=math.prod(mesh.shape[a] for a in shard),
        replicate_size=math.prod(mesh.shape[a] for a in replicate),
        model=tuple((a, mesh.shape[a]) for a in mesh.axis_names if a not in named),
    )


def _split_by(layout: LeafLayout, manual: frozenset[str]) -> list[tuple[str, ...]]:
    """Per dim, the axes among ``manual`` that split the stored leaf (model axes only)."""
    model = list(layout.model) or [()] * len(layout.shape)
    return [tuple(a for a in names if a in manual) for names in model]


def check_leaf(path: str, layout: LeafLayout, axes: MeshAxes, step: MeshAxes) -> None:
    """Refuse a leaf the step cannot view: split on its FSDP placement dim by an axis the
    step is manual over ([Note: model axes]: its local block would not be contiguous)."""
    if axes == step or not layout.composed:
        return
    names = _split_by(layout, frozenset(step.data_parallel))[layout.dim]
    if names:
        raise ValueError(
            f"Leaf {path} of shape {layout.shape} is split over mesh axes {names} (size "
            f"{axes.model_size(names)}) on its FSDP placement dim {layout.dim}, and this step is manual over "
            "them (another unit shards or replicates over them), so its block there would not be "
            "contiguous; give it another placement dim with `shard_placement_fn`, or leave it unsplit "
            "over those axes."
        )


def leaf_view(layout: LeafLayout, axes: MeshAxes, step: MeshAxes) -> tuple[LeafLayout, MeshAxes]:
    """``layout`` and ``axes`` of one leaf as a step manual over ``step``'s data-parallel axes
    sees them ([Note: step axes]); the leaf passed :func:`check_leaf`."""
    if axes == step:
        return layout, axes
    manual = frozenset(step.data_parallel)
    split = _split_by(layout, manual)
    sizes = dict(axes.model)  # on the one mesh, every axis the unit does not shard or replicate over
    extra = tuple(a for a in step.data_parallel
                  if a not in axes.data_parallel and not any(a in names for names in split))
    shape = tuple(s // math.prod(sizes[a] for a in names) for s, names in zip(layout.shape, split, strict=True))
    model = tuple(tuple(a for a in names if a not in manual) for names in layout.model)
    view = dataclasses.replace(layout, shape=shape, model=model if any(model) else ())
    return view, dataclasses.replace(
        axes,
        replicate=axes.replicate + extra,
        replicate_size=axes.replicate_size * math.prod(sizes[a] for a in extra),
        model=tuple((a, s) for a, s in axes.model if a not in manual),
    )


def step_spec(layout: LeafLayout, axes: MeshAxes, step: MeshAxes) -> PartitionSpec:
    """The stored leaf's spec over the step's manual axes: the unit's shard axes at the
    placement dim, and the step-manual axes that split its other dims."""
    if axes == step:
        return manual_spec(layout, axes)
    entries = _split_by(layout, frozenset(step.data_parallel))
    if layout.dim is not None:
        entries[layout.dim] = axes.shard + entries[layout.dim]
    return spec_of(entries)
