"""``fully_shard`` / ``unshard`` / ``reshard`` in the global view (outside ``shard_map``)."""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jshard import _consistency, _context, _local
from jshard._api import FullyShardPolicy
from jshard._layout import LeafLayout, named_sharding, pad, plan_leaf, unpad
from jshard._mesh import MeshAxes, make_mesh, resolve_axes
from jshard._unit import FSDPUnit, UnitMeta, is_unit


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


def _check_mesh_shape(axes: MeshAxes, policy: FullyShardPolicy) -> None:
    k = policy.reshard_after_forward
    if isinstance(k, bool) or not isinstance(k, int):
        return
    n = axes.shard_size
    if not (k < n and n % k == 0):
        raise ValueError(
            f"`reshard_after_forward={k}` must divide the shard size and be smaller than it: "
            f"mesh axis {axes.shard} has size {n}; choose a divisor of {n} below {n}, or True."
        )


@functools.lru_cache(maxsize=1024)
def _padder(layouts: tuple[LeafLayout, ...], shardings: tuple[Any, ...]):
    """One compiled pad-and-place per distinct set of layouts (eager calls do not retrace)."""
    return jax.jit(lambda xs: [pad(x, layout) for x, layout in zip(xs, layouts, strict=True)],
                   out_shardings=list(shardings))


@functools.lru_cache(maxsize=1024)
def _unpadder(layouts: tuple[LeafLayout, ...], replicated: NamedSharding):
    def unpad_all(xs):
        return [unpad(jax.device_put(x, replicated), layout) for x, layout in zip(xs, layouts, strict=True)]

    return jax.jit(unpad_all, out_shardings=[replicated] * len(layouts))


def _shard_leaves(leaves: list[Any], layouts: list[LeafLayout], shardings: list[Any]) -> list[Any]:
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
    if concrete:
        fn = _padder(tuple(layouts[i] for i in concrete), tuple(shardings[i] for i in concrete))
        for i, y in zip(concrete, fn([leaves[i] for i in concrete]), strict=True):
            out[i] = y
    return out


def fully_shard(params: Any, mesh: Mesh | None = None, policy: FullyShardPolicy | None = None) -> FSDPUnit:
    """Shard a pytree of parameters over the mesh as one unit (FSDP2's ``fully_shard``).

    Apply it bottom-up: to each block, then to the root; sub-trees already returned by
    ``fully_shard`` stay their own units. Every non-ignored leaf with ``ndim >= 1`` is
    sharded on its placement dim (default 0) over the shard axes, zero-padded at the end
    to a multiple of the shard size ``N``; 0-d leaves stay replicated.

    Args:
      params: a pytree of arrays (or ``jax.ShapeDtypeStruct`` for planning), or a list
        of pytrees that form one unit together.
      mesh: the mesh (default: :func:`jshard.make_mesh`).
      policy: a :class:`jshard.FullyShardPolicy` (default: ``FullyShardPolicy()``).

    Returns:
      An :class:`jshard.FSDPUnit`, indexable like ``params``.

    Raises:
      ValueError: an empty tree, a sub-tree twice in a list, a non-array leaf, a
        placement dim out of range, a mesh without the needed axes.
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
    policy = FullyShardPolicy() if policy is None else policy
    axes = resolve_axes(mesh, policy.dp_mesh_dims)
    _check_mesh_shape(axes, policy)
    entries_with_path, treedef = jax.tree.flatten_with_path(params, is_leaf=is_unit)
    own = [i for i, (_, x) in enumerate(entries_with_path) if not is_unit(x)]
    layouts: list[LeafLayout | None] = [None] * len(entries_with_path)
    for i in own:
        layouts[i] = plan_leaf(*entries_with_path[i], axes, policy)
    meta = UnitMeta(mesh, axes, policy, tuple(layouts))
    _consistency.check_unit([path for path, _ in entries_with_path], meta)  # multi-process only
    entries = [x for _, x in entries_with_path]
    shardings = [named_sharding(mesh, layouts[i], axes, policy) for i in own]
    stored = _shard_leaves([entries[i] for i in own], [layouts[i] for i in own], shardings)
    for i, x in zip(own, stored, strict=True):
        entries[i] = x
    return FSDPUnit(jax.tree.unflatten(treedef, entries), meta)


def _gather_global(unit: FSDPUnit) -> Any:
    meta = unit.meta
    entries = unit.own_entries()
    own = [i for i, layout in enumerate(meta.layouts) if layout is not None and not layout.ignored]
    replicated = NamedSharding(meta.mesh, PartitionSpec())
    if any(isinstance(entries[i], jax.ShapeDtypeStruct) for i in own):
        full = [jax.ShapeDtypeStruct(meta.layouts[i].shape, meta.layouts[i].dtype, sharding=replicated) for i in own]
    else:
        full = _unpadder(tuple(meta.layouts[i] for i in own), replicated)([entries[i] for i in own])
    for i, x in zip(own, full, strict=True):
        entries[i] = x
    for i, layout in enumerate(meta.layouts):
        if layout is None:
            entries[i] = _gather_global(entries[i])
    return unit.with_entries(entries)


def unshard(sharded: Any) -> Any:
    """Gather units back to full parameters.

    Global view (outside the step): every unit in ``sharded`` becomes the tree it was
    made from, each leaf of its original shape and dtype, replicated on the mesh,
    padding removed; ``unshard(fully_shard(p))`` equals ``p`` exactly. Works eagerly and
    under ``jit``.

    Local view (inside :func:`jshard.value_and_grad` with ``unshard_params=False``):
    all-gathers the unit's own shards just in time, in ``param_dtype``; sub-units stay
    units, to be unsharded when they are used. The gradient of the result is
    reduce-scattered as the unit's policy says.

    Args:
      sharded: an :class:`jshard.FSDPUnit`, or any pytree containing units.

    Returns:
      The tree with units replaced by full parameters.

    Example:
      >>> import jax.numpy as jnp, jshard as js
      >>> p = {"w": jnp.arange(10.0)}
      >>> js.unshard(js.fully_shard(p))["w"].shape
      (10,)
    """
    view = _context.current()
    if view is not None:
        if not is_unit(sharded):
            raise TypeError(
                f"js.unshard inside the step takes one FSDPUnit, got {type(sharded).__name__}; "
                "call it on each unit right before its parameters are used."
            )
        return _local.unshard_unit(sharded, view)
    return jax.tree.map(lambda x: _gather_global(x) if is_unit(x) else x, sharded, is_leaf=is_unit)


def _reshard_unit(full: Any, like: FSDPUnit) -> FSDPUnit:
    meta = like.meta
    treedef = jax.tree.structure(like.tree, is_leaf=is_unit)
    entries = treedef.flatten_up_to(full)
    like_entries = like.own_entries()
    own = [i for i, layout in enumerate(meta.layouts) if layout is not None]
    for i in own:
        layout, x = meta.layouts[i], entries[i]
        if not layout.ignored and (tuple(x.shape) != layout.shape or x.dtype != layout.dtype):
            path = jax.tree_util.keystr(jax.tree.flatten_with_path(like.tree, is_leaf=is_unit)[0][i][0])
            raise ValueError(
                f"Leaf {path}: reshard got shape {tuple(x.shape)} and dtype {x.dtype}, but the "
                f"unit was made from shape {layout.shape} and dtype {layout.dtype}; pass a full "
                "tree of the original shapes (e.g. the output of js.unshard)."
            )
    shardings = [named_sharding(meta.mesh, meta.layouts[i], meta.axes, meta.policy) for i in own]
    stored = _shard_leaves([entries[i] for i in own], [meta.layouts[i] for i in own], shardings)
    for i, x in zip(own, stored, strict=True):
        entries[i] = x
    for i, layout in enumerate(meta.layouts):
        if layout is None:
            entries[i] = _reshard_unit(entries[i], like_entries[i])
    return FSDPUnit(jax.tree.unflatten(treedef, entries), meta)


def reshard(full: Any, like: Any) -> Any:
    """Shard a full tree with the layout of ``like`` (the inverse of :func:`unshard`).

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
