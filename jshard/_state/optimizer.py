"""Optax on sharded parameters: ``shard_optimizer`` runs any transformation on the unpadded view.

[Note: unpadded view] A stored leaf is padded with zero rows (see [Note: layout]). Most
transformations are elementwise and keep zero rows zero, but any statistic that counts
elements does not: ``optax.adafactor`` takes means over rows and columns and the RMS of
the parameter, so padding rows change its result; its factoring decision even depends on
the (padded) shape. The same holds for a stack laid out as pipeline stages, stored as
``S * K`` layer slots of which those past its ``L`` layers are zeros ([Note: pipeline
stages]): Adafactor would factor a ``(S * K, d)`` bias over the slots, and its moments'
shapes would depend on ``S``, so a checkpoint could not restore onto another stage count.
``shard_optimizer(tx)`` therefore never shows ``tx`` a padded array: inside one ``jit`` it
slices the padding (and the layer slots past ``L``) off every leaf of ``updates``,
``params`` and the state, runs ``tx`` on arrays of the original shapes, and pads the
results back with zeros. The slices are unevenly sharded global arrays, which GSPMD supports in ``Auto``
mode only, so the computation runs under ``jax.sharding.auto_axes``. GSPMD's uneven tiling
(``ceil(d / N)`` rows per device) is exactly the layout's, so slicing and padding move no
data: a sum over a sharded dim is the only communication, as in the unsharded program.
Leaves offloaded to host memory (``CPUOffloadPolicy``) are moved to device memory for the
update and the results back to their stored memory kind, as ``js.offload_optimizer(tx,
"device")`` does.

The state has the structure of the unsharded state, whatever the transformation (masks,
labels, Muon): see [Note: state layout] in ``state_layout.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding

from jshard._sharding.layout import LeafLayout, memory_kind, pad, pad_layers, partition_spec, unpad, unpad_layers
from jshard._sharding.mesh import MeshAxes
from jshard._sharding.model_axes import axes_of_type, only_axes
from jshard._sharding.unit import all_units, is_unit, map_unit_leaves, one_mesh
from jshard._state.state_layout import replicated_layout, stored_state
from jshard._state.stored_leaves import strip_units


@dataclasses.dataclass(frozen=True)
class _Place:
    """Where one stored leaf lives: its layout, its unit's axes and memory kind (a leaf for
    tree utils). Units may shard over different axes of the one mesh ([Note: step axes])."""

    layout: LeafLayout
    kind: str | None
    axes: MeshAxes = MeshAxes((), (), 1, 1)  # outside every unit: replicated


class _Target(NamedTuple):
    mesh: Mesh


def _common_target(tree: Any, name: str) -> _Target:
    units = all_units(tree)
    if not units:
        raise ValueError(
            f"shard_optimizer got `{name}` without any FSDPUnit: it runs on trees made by js.fully_shard; "
            "for plain arrays use the Optax transformation directly."
        )
    mesh = one_mesh(units, f"The units shard_optimizer gets in `{name}`")

    for path, leaf in jax.tree.flatten_with_path(tree, is_leaf=is_unit)[0]:
        if not is_unit(leaf):
            raise ValueError(
                f"Leaf {jax.tree_util.keystr(path)} of shape {tuple(np.shape(leaf))} in `{name}` belongs to no "
                "unit; apply js.fully_shard to the root of the parameters (it keeps existing units)."
            )
    return _Target(mesh)


def _places(tree: Any) -> list[_Place]:
    """The placement of every stored leaf of ``tree``, in ``jax.tree.leaves`` order."""

    def place(meta, layout, x):
        if layout is None:
            return _Place(replicated_layout(x), None)
        return _Place(layout, memory_kind(layout, meta.policy), meta.axes)

    return jax.tree.leaves(map_unit_leaves(place, tree))


def _auto_mesh(mesh: Mesh) -> Mesh:
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _sharding(target: _Target, place: _Place, mesh: Mesh | None = None) -> NamedSharding:
    spec = partition_spec(place.layout, place.axes)
    return NamedSharding(target.mesh if mesh is None else mesh, spec, memory_kind=place.kind)


def _on_device(place: _Place) -> _Place:
    return dataclasses.replace(place, kind=None)


def _unpadded(x: jax.Array, place: _Place, target: _Target) -> jax.Array:
    sharding = _sharding(target, _on_device(place), _auto_mesh(target.mesh))
    if place.kind is not None:  # offloaded: the update runs in device memory (see [Note: unpadded view])
        x = jax.device_put(x, sharding.with_memory_kind("device"))
    if place.layout.padding == 0 and place.layout.layers is None:
        return x
    return jax.lax.with_sharding_constraint(unpad_layers(unpad(x, place.layout), place.layout), sharding)


def _padded(x: jax.Array, place: _Place, target: _Target) -> jax.Array:
    sharding = _sharding(target, _on_device(place), _auto_mesh(target.mesh))
    return jax.lax.with_sharding_constraint(pad(pad_layers(x, place.layout), place.layout), sharding)


def _view(tree: Any, target: _Target) -> Any:
    """``tree`` with every stored leaf unpadded; units and their metas kept."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [_unpadded(x, p, target) for x, p in zip(leaves, _places(tree), strict=True)])


def _plain_view(tree: Any, target: _Target) -> Any:
    """The tree as the user wrote it: units stripped, every stored leaf unpadded."""
    return strip_units(_view(tree, target))


def _abstract_plain(tree: Any) -> Any:
    """Shapes and dtypes of the tree as the user wrote it (units stripped, unpadded), unplaced."""
    if tree is None:
        return None
    return strip_units(_abstract_view(jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)))


def _abstract_view(tree: Any) -> Any:
    def shape(meta, layout, x):
        return jax.ShapeDtypeStruct(x.shape if layout is None else layout.unpadded_shape, x.dtype)

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


_STRUCTURE = (
    "shard_optimizer({tx}): the transformation could not match a tree of its own (a mask, labels "
    "or per-parameter settings) to the parameters: {error}. It runs on the parameters as you wrote "
    "them, without FSDPUnit nodes, so write masks and labels for that tree (a dict, a FrozenDict or a "
    "callable on params), not for the sharded one; js.state_dict.sharded_state_dict(params) gives "
    "that plain tree of a sharded one."
)


def _updates_like(new: Any, updates: Any, params: Any, tx: Any) -> Any:
    """The sharded tree whose structure the new updates have: the updates' own, or the
    parameters' (``optax.lookahead`` takes updates of ``params.fast`` and returns updates of
    ``LookaheadParams``)."""
    structure = jax.tree.structure(new)
    for like in (updates, params):
        if like is not None and jax.tree.structure(strip_units(like)) == structure:
            return like
    raise ValueError(
        f"shard_optimizer({_name(tx)}): its updates have the structure {structure}, neither the updates' "
        "nor the parameters' as you wrote them, so they cannot be placed like either; a transformation "
        "whose updates are not updates of the parameters (a measurement) cannot run under shard_optimizer."
    )


def _name(tx: Any) -> str:
    init = getattr(tx, "init", None)
    qualname = getattr(init, "__qualname__", type(tx).__name__)
    return qualname.split(".<locals>")[0]


def _is_array_tree(value: Any) -> bool:
    return all(isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex)) for x in jax.tree.leaves(value))


def shard_optimizer(tx: optax.GradientTransformation, *, min_size_to_shard: int = 1024
                    ) -> optax.GradientTransformationExtraArgs:
    """Run an Optax transformation on sharded parameters exactly as on unsharded ones.

    ``tx`` sees the parameters as you wrote them: your containers without FSDPUnit nodes,
    every leaf at its original shape (the padding sliced off, the arrays still sharded).
    So masks and labels written for your tree (``optax.adamw(mask={...})``,
    ``optax.masked``, ``optax.multi_transform``, a dict, a ``FrozenDict`` or a callable)
    work as on unsharded parameters, statistics that count elements (Adafactor's means,
    parameter RMS) match the unsharded run, and padding never reaches the state or the
    parameters: returned updates have zero padding rows. The state has the structure of
    the unsharded state; a leaf that mirrors a parameter (Adam's ``mu``) is stored sharded
    like it, another leaf of a parameter (SM3's accumulators, Adafactor's factored
    moments) is replicated below ``min_size_to_shard`` elements and sharded on its largest
    dim above it, the rest (step counts) replicated ([Note: state layout]). ``init`` and
    ``update`` are jitted, and work inside an outer ``jit`` too.

    Args:
      tx: any Optax gradient transformation (a ``chain``, ``masked``,
        ``multi_transform``, ``optax.contrib.muon`` included).
      min_size_to_shard: state leaves that belong to a parameter without mirroring it are
        sharded only from this many elements on.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``init`` takes a tree of units
      (:func:`jshard.fully_shard`) and whose ``update`` takes gradients of that layout
      (:func:`jshard.value_and_grad`). Extra keyword arguments of ``update`` are passed
      to ``tx``.

    Raises:
      ValueError: a tree without units, a leaf outside every unit, units on different
        meshes or data-parallel axes; a mask or labels tree that does not match the
        parameters as you wrote them (the message names the transformation and the fix); a
        state node that is a copy of several parameters' subtrees placed differently (the
        message names the state leaf, its shape and the candidates).

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

    def stored(params: Any, target: _Target) -> Any:
        abstract = jax.eval_shape(init_on_view, strip_units(_abstract_view(params)))
        return stored_state(abstract, params, min_size_to_shard)

    def init_on_view(view: Any) -> Any:
        try:
            return inner.init(view)
        except (ValueError, TypeError) as e:
            if "structure" not in str(e):  # JAX's "pytree structure error", "tree structure"...
                raise
            raise ValueError(_STRUCTURE.format(tx=_name(tx), error=e)) from e

    @jax.jit
    def init_fn(params: Any) -> Any:
        target = _common_target(params, "params")
        layouts = stored(params, target)
        init = lambda p: _store(init_on_view(_plain_view(p, target)), layouts, target)  # noqa: E731
        return _in_auto_mode(init, target, layouts)(params)

    @functools.partial(jax.jit, static_argnums=(4,))
    def update_jit(updates, state, params, arrays, static):
        target = _common_target(updates, "updates")

        def plain_update(view: Callable[[Any], Any], u, s, p, a):
            a = {k: view(v) for k, v in a.items()}  # grad=: a tree like the parameters
            return inner.update(view(u), view(s), view(p), **a, **dict(static))

        abstract = [_abstract_plain(t) for t in (updates, state, params)]
        new_shapes, _ = jax.eval_shape(functools.partial(plain_update, lambda t: t), *abstract,
                                       {k: _abstract_plain(v) for k, v in arrays.items()})
        like = _updates_like(new_shapes, updates, params, tx)

        def body(u, s, p, a):
            new_u, new_s = plain_update(lambda t: _plain_view(t, target) if all_units(t) else t, u, s, p, a)
            return _store(new_u, like, target), _store(new_s, s, target)

        return _in_auto_mode(body, target, (like, state))(updates, state, params, arrays)

    def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> tuple[Any, Any]:
        arrays = {k: v for k, v in extra_args.items() if _is_array_tree(v)}
        static = tuple(sorted((k, v) for k, v in extra_args.items() if k not in arrays))
        return update_jit(updates, state, params, arrays, static)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
