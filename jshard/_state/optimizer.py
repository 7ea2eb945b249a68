"""Optax on sharded parameters: ``shard_optimizer`` runs any transformation on the unpadded view.

[Note: unpadded view] A stored leaf is padded with zero rows (see [Note: layout]). Most
transformations are elementwise and keep zero rows zero, but any statistic that counts
elements does not: ``optax.adafactor`` takes means over rows and columns and the RMS of
the parameter, so padding rows change its result; its factoring decision even depends on
the (padded) shape. ``shard_optimizer(tx)`` therefore never shows ``tx`` a padded array:
inside one ``jit`` it slices the padding off every leaf of ``updates``, ``params`` and
the state, runs ``tx`` on arrays of the original shapes, and pads the results back with
zeros. The slices are unevenly sharded global arrays, which GSPMD supports in ``Auto``
mode only, so the computation runs under ``jax.sharding.auto_axes``. GSPMD's uneven tiling
(``ceil(d / N)`` rows per device) is exactly the layout's, so slicing and padding move no
data: a sum over a sharded dim is the only communication, as in the unsharded program.
Leaves offloaded to host memory (``CPUOffloadPolicy``) are moved to device memory for the
update and the results back to their stored memory kind, as ``js.offload_optimizer(tx,
"device")`` does.

[Note: state layout] The state is stored padded and sharded too. A state leaf inside a
unit that has its parameter's shape (Adam's ``mu``, ``nu``) gets the parameter's layout.
Any other leaf inside a unit (Adafactor's factored ``v_row`` / ``v_col``, its ``(1,)``
placeholders) is replicated when it has fewer than ``min_size_to_shard`` elements, and
otherwise sharded on its largest dim, padded like a parameter. Leaves outside units
(step counts) are replicated. Units in the state carry these layouts in their meta, so
:func:`jshard.unshard` and :mod:`jshard.state_dict` read the state exactly; where the
layouts equal the parameter's (``mu``, ``nu``), the meta equals the parameter unit's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding

from jshard._sharding.layout import LeafLayout, memory_kind, pad, partition_spec, unpad
from jshard._sharding.mesh import MeshAxes
from jshard._sharding.model_axes import axes_of_type, only_axes
from jshard._sharding.unit import FSDPUnit, all_units, is_unit, map_unit_leaves


@dataclasses.dataclass(frozen=True)
class _Place:
    """Where one stored leaf lives: its layout and memory kind (a leaf for tree utils)."""

    layout: LeafLayout
    kind: str | None


class _Target(NamedTuple):
    mesh: Mesh
    axes: MeshAxes


def _common_target(tree: Any, name: str) -> _Target:
    units = all_units(tree)
    if not units:
        raise ValueError(
            f"shard_optimizer got `{name}` without any FSDPUnit: it runs on trees made by js.fully_shard; "
            "for plain arrays use the Optax transformation directly."
        )
    first = units[0][0].meta
    for unit, _ in units:
        if (unit.meta.mesh, unit.meta.axes) != (first.mesh, first.axes):
            raise ValueError(
                f"shard_optimizer got units on different meshes in `{name}`: {dict(unit.meta.mesh.shape)} with "
                f"shard axes {unit.meta.axes.shard} beside {dict(first.mesh.shape)} with {first.axes.shard}; "
                "fully_shard every unit on the same mesh."
            )

    for path, leaf in jax.tree.flatten_with_path(tree, is_leaf=is_unit)[0]:
        if not is_unit(leaf):
            raise ValueError(
                f"Leaf {jax.tree_util.keystr(path)} of shape {tuple(np.shape(leaf))} in `{name}` belongs to no "
                "unit; apply js.fully_shard to the root of the parameters (it keeps existing units)."
            )
    return _Target(first.mesh, first.axes)


def _replicated(x: Any) -> LeafLayout:
    shape = tuple(np.shape(x))
    return LeafLayout(shape, np.dtype(x.dtype), None, 0)


def _places(tree: Any) -> list[_Place]:
    """The placement of every stored leaf of ``tree``, in ``jax.tree.leaves`` order."""

    def place(meta, layout, x):
        if layout is None:
            return _Place(_replicated(x), None)
        return _Place(layout, memory_kind(layout, meta.policy))

    return jax.tree.leaves(map_unit_leaves(place, tree))


def _state_layout(param: LeafLayout, x: Any, shard_size: int, min_size: int) -> LeafLayout:
    """The layout of a state leaf inside a unit (see [Note: state layout])."""
    shape, dtype = tuple(x.shape), np.dtype(x.dtype)
    if shape == param.shape:
        return dataclasses.replace(param, dtype=dtype)
    if param.ignored or not shape or math.prod(shape) < min_size:
        return LeafLayout(shape, dtype, None, 0, ignored=param.ignored)
    dim = int(np.argmax(shape))
    return LeafLayout(shape, dtype, dim, shard_size * math.ceil(shape[dim] / shard_size))


def _state_tree_layout(view: Any, shard_size: int, min_size: int) -> Any:
    """The stored form of an (abstract) view state: units get metas with state layouts, leaves become layouts."""
    if is_unit(view):
        entries, layouts = [], []
        for layout, x in zip(view.meta.layouts, view.own_entries(), strict=True):
            new = _state_tree_layout(x, shard_size, min_size) if layout is None else _state_layout(
                layout, x, shard_size, min_size)
            entries.append(new)
            layouts.append(None if layout is None else new)
        return FSDPUnit(view.with_entries(entries), dataclasses.replace(view.meta, layouts=tuple(layouts)))
    treedef = jax.tree.structure(view, is_leaf=is_unit)
    entries = [_state_tree_layout(x, shard_size, min_size) if is_unit(x) else _replicated(x)
               for x in treedef.flatten_up_to(view)]
    return jax.tree.unflatten(treedef, entries)


def _auto_mesh(mesh: Mesh) -> Mesh:
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _sharding(target: _Target, place: _Place, mesh: Mesh | None = None) -> NamedSharding:
    spec = partition_spec(place.layout, target.axes)
    return NamedSharding(target.mesh if mesh is None else mesh, spec, memory_kind=place.kind)


def _on_device(place: _Place) -> _Place:
    return dataclasses.replace(place, kind=None)


def _unpadded(x: jax.Array, place: _Place, target: _Target) -> jax.Array:
    sharding = _sharding(target, _on_device(place), _auto_mesh(target.mesh))
    if place.kind is not None:  # offloaded: the update runs in device memory (see [Note: unpadded view])
        x = jax.device_put(x, sharding.with_memory_kind("device"))
    if place.layout.padding == 0:
        return x
    return jax.lax.with_sharding_constraint(unpad(x, place.layout), sharding)


def _padded(x: jax.Array, place: _Place, target: _Target) -> jax.Array:
    sharding = _sharding(target, _on_device(place), _auto_mesh(target.mesh))
    return jax.lax.with_sharding_constraint(pad(x, place.layout), sharding)


def _view(tree: Any, target: _Target) -> Any:
    """``tree`` with every stored leaf unpadded; units and their metas kept."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [_unpadded(x, p, target) for x, p in zip(leaves, _places(tree), strict=True)])


def _abstract_view(tree: Any) -> Any:
    def shape(meta, layout, x):
        return jax.ShapeDtypeStruct(x.shape if layout is None else layout.shape, x.dtype)

    return map_unit_leaves(shape, tree)


def _store(view: Any, stored: Any, target: _Target) -> Any:
    """Pad the leaves of a view into the structure and placements of ``stored``."""
    places = _places(stored)
    leaves = [_padded(x, p, target) for x, p in zip(jax.tree.leaves(view), places, strict=True)]
    return jax.tree.unflatten(jax.tree.structure(stored), leaves)


def _in_auto_mode(fn: Any, target: _Target, stored_like: Any) -> Any:
    """``fn`` run with Auto mesh axes; its outputs placed (memory kind included) like ``stored_like``."""
    places = _places(stored_like)
    treedef = jax.tree.structure(stored_like)
    explicit = axes_of_type(target.mesh, AxisType.Explicit)  # axes the mesh leaves Auto need no switching
    on_device = jax.tree.unflatten(treedef, [only_axes(_sharding(target, _on_device(p)), explicit) for p in places])
    auto_fn = jax.sharding.auto_axes(fn, axes=explicit, out_sharding=on_device) if explicit else fn

    def placed(*args):
        with jax.sharding.use_abstract_mesh(target.mesh.abstract_mesh):  # also when no output names the mesh
            out = zip(jax.tree.leaves(auto_fn(*args)), places, strict=True)
        return jax.tree.unflatten(treedef, [x if p.kind is None else jax.device_put(x, _sharding(target, p))
                                            for x, p in out])

    return placed


def _is_array_tree(value: Any) -> bool:
    return all(isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex)) for x in jax.tree.leaves(value))


def shard_optimizer(tx: optax.GradientTransformation, *, min_size_to_shard: int = 1024
                    ) -> optax.GradientTransformationExtraArgs:
    """Run an Optax transformation on sharded parameters exactly as on unsharded ones.

    ``tx`` sees every leaf at its original shape (the padding sliced off, the arrays
    still sharded), so statistics that count elements (Adafactor's means and parameter
    RMS, anything with ``mean`` or ``size``) match the unsharded run, and padding never
    reaches the state or the parameters: returned updates have zero padding rows. The
    state is stored sharded like the parameters it mirrors; other state leaves of a unit
    (e.g. Adafactor's factored moments) are replicated below ``min_size_to_shard``
    elements and sharded on their largest dim above it. ``init`` and ``update`` are
    jitted, and work inside an outer ``jit`` too.

    Args:
      tx: any Optax gradient transformation (a ``chain`` included).
      min_size_to_shard: state leaves that do not mirror a parameter are sharded only
        from this many elements on.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``init`` takes a tree of units
      (:func:`jshard.fully_shard`) and whose ``update`` takes gradients of that layout
      (:func:`jshard.value_and_grad`). Extra keyword arguments of ``update`` are passed
      to ``tx``.

    Raises:
      ValueError: a tree without units, a leaf outside every unit, units on different
        meshes or data-parallel axes.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, jshard as js
      >>> from jshard.optim import shard_optimizer
      >>> params = js.fully_shard({"w": jnp.ones((7, 3))})
      >>> tx = shard_optimizer(optax.sgd(0.1, momentum=0.9))
      >>> state = tx.init(params)
      >>> updates, state = tx.update(params, state, params)
      >>> updates["w"].shape, np.asarray(updates["w"])[6:, 0].tolist()  # the padding row stays zero
      ((8, 3), [-0.1..., 0.0])
    """
    if isinstance(min_size_to_shard, bool) or not isinstance(min_size_to_shard, int) or min_size_to_shard < 1:
        raise ValueError(f"`min_size_to_shard` must be a positive int, got {min_size_to_shard!r}.")
    inner = optax.with_extra_args_support(tx)

    def stored_state(params: Any, target: _Target) -> Any:
        abstract = jax.eval_shape(inner.init, _abstract_view(params))
        return _state_tree_layout(abstract, target.axes.shard_size, min_size_to_shard)

    @jax.jit
    def init_fn(params: Any) -> Any:
        target = _common_target(params, "params")
        layouts = stored_state(params, target)
        return _in_auto_mode(lambda p: _store(inner.init(_view(p, target)), layouts, target), target, layouts)(params)

    @functools.partial(jax.jit, static_argnums=(4,))
    def update_jit(updates, state, params, arrays, static):
        target = _common_target(updates, "updates")
        view_state = jax.tree.structure(jax.eval_shape(inner.init, _abstract_view(updates)))
        extra = dict(arrays, **dict(static))

        def body(u, s, p):
            u_view = _view(u, target)
            s_view = jax.tree.unflatten(view_state, jax.tree.leaves(_view(s, target)))
            p_view = None if p is None else _view(p, target)
            new_u, new_s = inner.update(u_view, s_view, p_view, **extra)
            return _store(new_u, u, target), _store(new_s, s, target)

        return _in_auto_mode(body, target, (updates, state))(updates, state, params)

    def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> tuple[Any, Any]:
        arrays = {k: v for k, v in extra_args.items() if _is_array_tree(v)}
        static = tuple(sorted((k, v) for k, v in extra_args.items() if k not in arrays))
        return update_jit(updates, state, params, arrays, static)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
