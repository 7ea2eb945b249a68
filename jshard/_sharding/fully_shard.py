"""``fully_shard`` and the global view's gather and re-shard (outside ``shard_map``).

:func:`unshard_global` / :func:`reshard` work on whole trees of units;
:func:`gather_own` / :func:`shard_own` on one unit's own leaves (the NNX adapter's
``module.unshard()`` / ``module.reshard()`` use them).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from jshard._sharding.agreement import check_unit
from jshard._sharding.layout import LeafLayout, leaf_layout, named_sharding, pad, pad_layers, unpad, unpad_layers
from jshard._sharding.mesh import check_reshard_group, make_mesh, resolve_axes
from jshard._sharding.model_axes import model_spec
from jshard._sharding.platform_defaults import for_mesh
from jshard._sharding.policies import FullyShardPolicy
from jshard._sharding.stages import StagedLayers
from jshard._sharding.traced import (
    check_computed_over_model_axes,
    check_computed_split,
    check_model_axes_visible,
    check_not_manual,
    is_traced,
    place_traced,
)
from jshard._sharding.unit import FSDPUnit, UnitMeta, is_unit


def _check_list_of_subtrees(params: Any) -> None:
    if not isinstance(params, list):
        return
    seen: dict[int, int] = {}
    for i, sub in enumerate(params):
        if id(sub) in seen:
            raise ValueError(
                f"Sub-tree [{i}] is the same object as sub-tree [{seen[id(sub)]}] in the list "
                "passed to fully_shard: each sub-tree must appear once (a parameter owned "
                "twice would be sharded twice and untied); pass it once."
            )
        seen[id(sub)] = i


def _unstaged(params: Any, policy: FullyShardPolicy) -> tuple[Any, int | None]:
    """The tree and, for a stack laid out by ``js.stage_layers``, its layer count ``L``."""
    staged = [jax.tree_util.keystr(path) for path, x in jax.tree.flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, StagedLayers))[0] if isinstance(x, StagedLayers)]
    if not isinstance(params, StagedLayers) and staged:
        raise ValueError(f"fully_shard got a stack laid out as pipeline stages at {staged[0]}; make it a unit of its "
                         "own first: fully_shard(js.stage_layers(stack, mesh), mesh, FullyShardPolicy(scan_axis=0)).")
    if isinstance(params, StagedLayers) and policy.scan_axis != 0:
        raise ValueError(f"fully_shard got a stack of {params.layers} layers laid out as pipeline stages with "
                         f"FullyShardPolicy(scan_axis={policy.scan_axis}); pass FullyShardPolicy(scan_axis=0, ...).")
    return (params.tree, params.layers) if isinstance(params, StagedLayers) else (params, None)


@functools.lru_cache(maxsize=1024)
def _padder(layouts: tuple[LeafLayout, ...], shardings: tuple[Any, ...]):
    """One compiled pad-and-place per distinct set of layouts (eager calls do not retrace)."""
    return jax.jit(lambda xs: [pad(x, layout) for x, layout in zip(xs, layouts, strict=True)],
                   out_shardings=list(shardings))


@functools.lru_cache(maxsize=1024)
def _unpadder(layouts: tuple[LeafLayout, ...], shardings: tuple[NamedSharding, ...]):
    def unpad_all(xs):
        return [unpad_layers(unpad(jax.device_put(x, s), layout), layout)
                for x, layout, s in zip(xs, layouts, shardings, strict=True)]

    return jax.jit(unpad_all, out_shardings=list(shardings))


def full_sharding(meta: UnitMeta, layout: LeafLayout) -> NamedSharding:
    """Where a gathered (global-view) leaf lives: replicated over the data-parallel axes, still split
    over its model axes except on a composed placement dim ([Note: model axes]) and on a stage-split
    stack's layer axis (its ``L`` layers need not divide over the stages)."""
    model = ((),) + layout.model[1:] if layout.layers is not None else layout.model
    spec = model_spec(model, len(layout.shape), without=layout.dim if layout.composed else None)
    return NamedSharding(meta.mesh, spec)


def shard_leaves(leaves: list[Any], layouts: list[LeafLayout], shardings: list[Any]) -> list[Any]:
    """Pad and place leaves; abstract leaves become abstract sharded leaves."""
    out: list[Any] = list(leaves)
    concrete = []
    for i, (leaf, layout, sharding) in enumerate(zip(leaves, layouts, shardings, strict=True)):
        if layout.ignored:
            continue
        if isinstance(leaf, jax.ShapeDtypeStruct):
            out[i] = jax.ShapeDtypeStruct(layout.padded_shape, layout.dtype, sharding=sharding)
        else:
            concrete.append(i)
    eager = [i for i in concrete if not is_traced(leaves[i])]
    if eager:
        fn = _padder(tuple(layouts[i] for i in eager), tuple(shardings[i] for i in eager))
        for i, y in zip(eager, fn([leaves[i] for i in eager]), strict=True):
            out[i] = y
    for i in concrete:  # traced leaves, and eager ones staged into an outer trace ([Note: born sharded])
        y = pad(leaves[i], layouts[i]) if is_traced(leaves[i]) else out[i]
        if is_traced(y):
            out[i] = place_traced(y, shardings[i])
    return out


def fully_shard(params: Any, mesh: Mesh | None = None, policy: FullyShardPolicy | None = None) -> FSDPUnit:
    """Shard a pytree of parameters over the mesh as one unit (FSDP2's ``fully_shard``).

    Apply it bottom-up: to each block, then to the root; sub-trees already returned by
    ``fully_shard`` stay their own units. Every non-ignored leaf with ``ndim >= 1`` is
    sharded on its placement dim (default 0) over the shard axes, zero-padded at the end
    to a multiple of the shard size ``N``; 0-d leaves, and leaves under the policy's
    ``replicate_below`` elements, stay replicated. Traced inside
    ``jax.jit`` (a model initialised there: "born sharded") it gives the eager layout and
    values, each device computing only its own rows ([Note: born sharded]).

    Args:
      params: a pytree of arrays (or ``jax.ShapeDtypeStruct`` for planning), or a list
        of pytrees that form one unit together, or a stack laid out by
        :func:`jshard.stage_layers` (its layer count is recorded in the unit).
      mesh: the mesh (default: :func:`jshard.make_mesh`).
      policy: a :class:`jshard.FullyShardPolicy` (default: ``FullyShardPolicy()``); the settings
        it leaves ``None`` are filled in for the mesh's devices ([Note: platform defaults]).

    Returns:
      An :class:`jshard.FSDPUnit`, indexable like ``params``.

    Raises:
      ValueError: an empty tree, a sub-tree twice in a list, a non-array leaf, a
        placement dim out of range, a mesh without the needed axes; a traced leaf that
        every device computed whole (under ``jax.set_mesh`` with ``Explicit`` shard axes)
        or computed with an ``Explicit`` type not split over the shard axes (over model axes
        only), traced inside ``shard_map``, or traced on a mesh whose model axes are ``Auto``.
      RuntimeError: ``params`` is already a unit.

    Example:
      >>> import jax.numpy as jnp, jshard as js
      >>> params = {"layer1": {"w": jnp.ones((7, 15))}, "b": jnp.zeros(())}
      >>> sharded = js.fully_shard(params)
      >>> sharded["layer1"]["w"].shape, sharded["layer1"]["w"].sharding.spec
      ((8, 15), P('fsdp',))
      >>> bool((js.unshard(sharded)["layer1"]["w"] == params["layer1"]["w"]).all())
      True
    """
    if is_unit(params):
        raise RuntimeError(
            "fully_shard got a tree that is already fully sharded as a whole (an FSDPUnit); "
            "apply fully_shard once per unit: to sub-trees first, then to a root that "
            "contains them, e.g. fully_shard({'block': unit, 'head': head_params})."
        )
    if not jax.tree.leaves(params):
        raise ValueError("fully_shard got an empty pytree (no leaves): pass the parameters to shard.")
    _check_list_of_subtrees(params)
    mesh = make_mesh() if mesh is None else mesh
    policy = for_mesh(FullyShardPolicy() if policy is None else policy, mesh)  # [Note: platform defaults]
    params, layers = _unstaged(params, policy)
    axes = resolve_axes(mesh, policy.dp_mesh_dims)
    check_reshard_group(axes, policy)
    entries_with_path, treedef = jax.tree.flatten_with_path(params, is_leaf=is_unit)
    own = [i for i, (_, x) in enumerate(entries_with_path) if not is_unit(x)]
    layouts: list[LeafLayout | None] = [None] * len(entries_with_path)
    for i in own:
        check_not_manual(*entries_with_path[i], axes.shard, dict(mesh.shape))
        check_model_axes_visible(*entries_with_path[i], mesh, axes.model)
        layouts[i] = dataclasses.replace(leaf_layout(*entries_with_path[i], axes, policy, mesh=mesh), layers=layers)
        if layouts[i].sharded and not layouts[i].ignored:
            check_computed_split(*entries_with_path[i], axes.shard, dict(mesh.shape))
            check_computed_over_model_axes(*entries_with_path[i], axes.shard, dict(mesh.shape))
    meta = UnitMeta(mesh, axes, policy, tuple(layouts))
    check_unit([path for path, _ in entries_with_path], meta)  # multi-process only
    return FSDPUnit(jax.tree.unflatten(treedef, shard_own(meta, [x for _, x in entries_with_path])), meta)


def _own_sharded(meta: UnitMeta) -> list[int]:
    return [i for i, layout in enumerate(meta.layouts) if layout is not None and not layout.ignored]


def gather_own(unit: FSDPUnit) -> list[Any]:
    """The unit's own entries with each sharded leaf gathered: original shape, replicated, unpadded."""
    meta = unit.meta
    entries = unit.own_entries()
    own = _own_sharded(meta)
    shardings = tuple(full_sharding(meta, meta.layouts[i]) for i in own)
    if any(isinstance(entries[i], jax.ShapeDtypeStruct) for i in own):
        full = [jax.ShapeDtypeStruct(meta.layouts[i].unpadded_shape, meta.layouts[i].dtype, sharding=s)
                for i, s in zip(own, shardings, strict=True)]
    else:
        full = _unpadder(tuple(meta.layouts[i] for i in own), shardings)([entries[i] for i in own])
    for i, x in zip(own, full, strict=True):
        entries[i] = x
    return entries


def shard_own(meta: UnitMeta, entries: list[Any]) -> list[Any]:
    """``entries`` (a unit's own entries, full leaves in original shapes) with each leaf padded and placed."""
    out = list(entries)
    own = [i for i, layout in enumerate(meta.layouts) if layout is not None]
    shardings = [named_sharding(meta.mesh, meta.layouts[i], meta.axes, meta.policy) for i in own]
    for i, x in zip(own, shard_leaves([entries[i] for i in own], [meta.layouts[i] for i in own], shardings),
                    strict=True):
        out[i] = x
    return out


def _gather_global(unit: FSDPUnit) -> Any:
    entries = gather_own(unit)
    for i, layout in enumerate(unit.meta.layouts):
        if layout is None:
            entries[i] = _gather_global(entries[i])
    return unit.with_entries(entries)


def unshard_global(sharded: Any) -> Any:
    """Every unit in ``sharded`` gathered back to the tree it was made from (see :func:`jshard.unshard`)."""
    return jax.tree.map(lambda x: _gather_global(x) if is_unit(x) else x, sharded, is_leaf=is_unit)


def _reshard_unit(full: Any, like: FSDPUnit) -> FSDPUnit:
    meta = like.meta
    treedef = jax.tree.structure(like.tree, is_leaf=is_unit)
    entries = treedef.flatten_up_to(full)
    like_entries = like.own_entries()
    own = [i for i, layout in enumerate(meta.layouts) if layout is not None]
    for i in own:
        layout, x = meta.layouts[i], entries[i]
        if not layout.ignored and (tuple(x.shape) != layout.unpadded_shape or x.dtype != layout.dtype):
            path = jax.tree_util.keystr(jax.tree.flatten_with_path(like.tree, is_leaf=is_unit)[0][i][0])
            raise ValueError(
                f"Leaf {path}: reshard got shape {tuple(x.shape)} and dtype {x.dtype}, but the "
                f"unit was made from shape {layout.unpadded_shape} and dtype {layout.dtype}; pass a full "
                "tree of the original shapes (e.g. the output of js.unshard)."
            )
        entries[i] = x if layout.ignored else pad_layers(x, layout)
    entries = shard_own(meta, entries)
    for i, layout in enumerate(meta.layouts):
        if layout is None:
            entries[i] = _reshard_unit(entries[i], like_entries[i])
    return FSDPUnit(jax.tree.unflatten(treedef, entries), meta)


def reshard(full: Any, like: Any) -> Any:
    """Shard a full tree with the layout of ``like`` (the inverse of :func:`jshard.unshard`).

    Args:
      full: a tree with the structure and original shapes of the unsharded parameters.
      like: a tree of units (e.g. the output of :func:`fully_shard`) to copy layouts from.

    Returns:
      A tree of units with ``like``'s meshes, policies and layouts holding ``full``.

    Example:
      >>> import jax.numpy as jnp, jshard as js
      >>> sharded = js.fully_shard({"w": jnp.zeros((5, 2))})
      >>> js.reshard({"w": jnp.ones((5, 2))}, sharded)["w"].shape
      (8, 2)
    """
    if is_unit(like):
        return _reshard_unit(full, like)
    treedef = jax.tree.structure(like, is_leaf=is_unit)
    fulls = treedef.flatten_up_to(full)
    likes = treedef.flatten_up_to(like)
    out = [_reshard_unit(f, u) if is_unit(u) else f for f, u in zip(fulls, likes, strict=True)]
    return jax.tree.unflatten(treedef, out)
