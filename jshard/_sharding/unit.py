"""The unit node: a pytree node whose aux data carries a unit's static facts.

[Note: unit node] ``fully_shard`` wraps the user's tree in an :class:`FSDPUnit`. Its one
child is the tree itself (with stored, padded leaves and nested sub-units); its aux data
is a :class:`UnitMeta` (mesh, axes, policy, one layout per own leaf). Because the facts
are aux data, they travel through ``jit``, ``grad``, ``tree_map``, Optax state and
Orbax unchanged, and ``jax.tree.leaves`` of a unit are exactly the leaves of the tree
it was made from, in order.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax.sharding import Mesh

from jshard._sharding.layout import LeafLayout
from jshard._sharding.local_shapes import refuse_shard_read
from jshard._sharding.mesh import MeshAxes
from jshard._sharding.policies import FullyShardPolicy
from jshard._sharding.step_state import active_step


@dataclasses.dataclass(frozen=True, eq=True)
class UnitMeta:
    """Static facts of a unit; ``layouts[i]`` is ``None`` where a sub-unit sits.

    Only facts that hold in every step: what a step decides for the unit lives in the
    step's :class:`jshard._sharding.step_state.StepState` ([Note: step state]).
    """

    mesh: Mesh
    axes: MeshAxes
    policy: FullyShardPolicy
    layouts: tuple[LeafLayout | None, ...]


@jax.tree_util.register_pytree_with_keys_class
class FSDPUnit:
    """A fully sharded unit: one all-gather and one reduce-scatter group.

    Index it like the tree it was made from (``unit["layer1"]["w"]``); ``unit.tree`` is
    that tree with stored (sharded, padded) leaves. Made by :func:`jshard.fully_shard`.

    Example:
      >>> import jax.numpy as jnp, jshard as js
      >>> unit = js.fully_shard({"w": jnp.ones((7, 3))})
      >>> unit["w"].shape  # padded to a multiple of the 8 devices
      (8, 3)
    """

    __slots__ = ("tree", "meta", "_top")

    def __init__(self, tree: Any, meta: UnitMeta, top: tuple[Any, tuple[Any, ...]] | None = None):
        self.tree = tree
        self.meta = meta
        self._top = top  # the tree's top-level structure and keys, found once ([Note: unit keys])

    def _children(self) -> tuple[list[Any], tuple[Any, tuple[Any, ...]]]:
        if self._top is None:
            self._top = _top_level(self.tree)
        top, _ = self._top
        children = [self.tree] if top is None else list(jax.tree_util.default_registry.flatten_one_level(self.tree)[0])
        return children, self._top

    def tree_flatten_with_keys(self):
        children, (top, keys) = self._children()
        return list(zip(keys, children, strict=True)), (self.meta, top, keys)

    def tree_flatten(self):
        children, (top, keys) = self._children()
        return children, (self.meta, top, keys)

    @classmethod
    def tree_unflatten(cls, aux: tuple[UnitMeta, Any, tuple[Any, ...]], children):
        meta, top, keys = aux
        return cls(children[0] if top is None else top.unflatten(children), meta, (top, keys))

    def __getitem__(self, key):
        return _check_read(self, key, self.tree[key])

    def __getattr__(self, name: str):
        """``unit.fast`` is ``unit.tree.fast`` for a unit made from a NamedTuple or dataclass."""
        if name.startswith("__") or name in FSDPUnit.__slots__ or not _is_container(self.tree):
            raise AttributeError(name)  # a unit of one array is no array: no .shape, .dtype...
        return _check_read(self, name, getattr(self.tree, name))

    def __contains__(self, key) -> bool:
        """``key in unit`` is ``key in unit.tree`` (Flax's ``TrainState`` asks this of params)."""
        return key in self.tree

    def __repr__(self) -> str:
        return f"FSDPUnit({self.tree!r})"

    def own_entries(self) -> list[Any]:
        """The entries that ``meta.layouts`` describes: own leaves and sub-units, in order."""
        return jax.tree.leaves(self.tree, is_leaf=is_unit)

    def with_entries(self, entries: list[Any]) -> Any:
        """``unit.tree`` with its own entries replaced (a plain tree, not a unit)."""
        return jax.tree.unflatten(jax.tree.structure(self.tree, is_leaf=is_unit), entries)


def _is_container(tree: Any) -> bool:
    return jax.tree.structure(tree).num_nodes > 1 or not jax.tree.leaves(tree)


class _UnitKey:
    """The key path entry of a unit made from a single array: it prints as nothing."""

    __slots__ = ()

    def __str__(self) -> str:
        return ""

    def __repr__(self) -> str:
        return "UnitKey()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _UnitKey)

    def __hash__(self) -> int:
        return hash(_UnitKey)


UNIT_KEY = _UnitKey()


def _top_level(tree: Any) -> tuple[Any, tuple[Any, ...]]:
    """The structure of ``tree``'s top-level node (``None`` for a bare leaf) and its
    children's keys (a key that prints as nothing for a bare leaf).

    [Note: unit keys] A unit is a pytree node that stands in for the top-level node of the
    tree it was made from: its children are that node's children, under that node's keys, so
    ``jax.tree_util.tree_flatten_with_path`` of a sharded tree gives the key paths of the
    tree ``fully_shard`` was given (``['layer']['bias']``), not ``.tree['layer']...``. Units
    are flattened on every ``jit`` call, so each unit finds this structure once and hands it
    to the units unflattened from it.
    """
    if jax.tree_util.default_registry.flatten_one_level(tree) is None:  # tree is a leaf itself
        return None, (UNIT_KEY,)
    keyed, top = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)
    return top, tuple(path[0] for path, _ in keyed)


READ_SHARD = (
    "Leaf [{key!r}] of shape {shape} was read from its unit inside the step without js.unshard, so it "
    "holds this device's shard {local} (of the padded {padded}, split over mesh axis {axis!r} of size "
    "{n}), not the parameter. Call js.unshard(unit) right before using it (js.scan for stacked units), "
    "or use js.value_and_grad(loss_fn) with unshard_params=True to receive full parameters."
)
READ_PADDED = (
    "Leaf [{key!r}] of shape {shape} is stored padded to {padded} (split over mesh axis {axis!r} of "
    "size {n}), and it was read under jax.grad / jax.value_and_grad of sharded parameters, which would "
    "differentiate the padded global arrays. Use js.value_and_grad(loss_fn)(sharded, batch) instead: "
    "it gathers each unit, unpads it and reduce-scatters its gradient."
)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _refuse_derivative(value: Any, message: str) -> Any:
    """``value`` itself, whose derivative is an error: a custom JVP rule runs only when ``value``
    is differentiated (``jax.grad``, ``jvp``, ``linearize``, under ``jit`` too), never for
    other reads, so no tracer type needs recognising."""
    return value


@_refuse_derivative.defjvp
def _refuse_derivative_jvp(message: str, primals: tuple[Any], tangents: tuple[Any]) -> Any:
    raise RuntimeError(message)


def _check_read(unit: FSDPUnit, key: Any, value: Any) -> Any:
    """``unit.tree[key]``, refusing the two common ways of reading a leaf as a parameter
    when it is not one: a shard read inside the step (an error now, [Note: shard reads]) and a
    padded global array differentiated outside it (an error if the read value is differentiated)."""
    step = active_step()
    reading_shard = step is not None and step.holds_shards
    traced_outside = step is None and isinstance(value, jax.core.Tracer)
    if not hasattr(value, "shape") or not (reading_shard or traced_outside):
        return value  # the common case (eager reads, reads of gathered values): no layout lookup
    layout = _own_layout(unit, key)
    if layout is None or not layout.sharded or layout.ignored:
        return value
    axes = unit.meta.axes
    refuse_shard_read(value, layout, axes, unit.meta.policy.scan_axis, step, READ_SHARD, key=key)
    if traced_outside and layout.padding:
        return _refuse_derivative(value, READ_PADDED.format(key=key, shape=layout.shape, padded=layout.padded_shape,
                                                            axis=axes.shard_entry, n=axes.shard_size))
    return value


def _own_layout(unit: FSDPUnit, key: Any) -> LeafLayout | None:
    """The layout of ``unit.tree[key]`` when it is one of the unit's own leaves."""
    flat = jax.tree_util.tree_flatten_with_path(unit.tree, is_leaf=is_unit)[0]
    for i, (path, _) in enumerate(flat):
        if len(path) == 1 and getattr(path[0], "key", getattr(path[0], "idx", None)) == key:
            return unit.meta.layouts[i] if i < len(unit.meta.layouts) else None
    return None


def is_unit(x: Any) -> bool:
    return isinstance(x, FSDPUnit)


def map_unit_leaves(fn: Any, tree: Any, *rest: Any) -> Any:
    """Map ``fn(meta, layout, leaf, *rest_leaves)`` over every leaf of ``tree``.

    ``meta`` and ``layout`` are the leaf's unit's :class:`UnitMeta` and the leaf's
    :class:`LeafLayout`, both ``None`` for a leaf outside any unit.
    ``rest`` are trees of the same structure. Units keep their metas.
    """
    if is_unit(tree):
        entries = tree.own_entries()
        treedef = jax.tree.structure(tree.tree, is_leaf=is_unit)
        others = [treedef.flatten_up_to(r.tree) for r in rest]
        out = []
        for i, (layout, x) in enumerate(zip(tree.meta.layouts, entries, strict=True)):
            rs = [o[i] for o in others]
            out.append(map_unit_leaves(fn, x, *rs) if layout is None else fn(tree.meta, layout, x, *rs))
        return FSDPUnit(jax.tree.unflatten(treedef, out), tree.meta)
    treedef = jax.tree.structure(tree, is_leaf=is_unit)
    entries = treedef.flatten_up_to(tree)
    others = [treedef.flatten_up_to(r) for r in rest]
    out = []
    for i, x in enumerate(entries):
        rs = [o[i] for o in others]
        out.append(map_unit_leaves(fn, x, *rs) if is_unit(x) else fn(None, None, x, *rs))
    return jax.tree.unflatten(treedef, out)


def all_units(tree: Any) -> list[tuple[FSDPUnit, bool]]:
    """Every unit in ``tree`` with whether it is a root (inside no other unit), outer first."""
    found: list[tuple[FSDPUnit, bool]] = []

    def visit(x: Any, root: bool) -> None:
        for entry in jax.tree.leaves(x.tree if is_unit(x) else x, is_leaf=is_unit):
            if is_unit(entry):
                found.append((entry, root))
                visit(entry, False)

    visit([tree], True)
    return found


def one_mesh(units: list[tuple[FSDPUnit, bool]], who: str) -> Mesh:
    """The mesh all ``units`` share, or an error that names both meshes; ``who`` says what
    needs one mesh. The one home of that rule. Units may shard and replicate over different
    axes of it ([Note: step axes] in ``step_axes.py``)."""
    mesh = units[0][0].meta.mesh
    for unit, _ in units:
        if unit.meta.mesh != mesh:
            raise ValueError(
                f"{who} must share a mesh, got units on different meshes: mesh {_describe(unit.meta.mesh)} "
                f"beside mesh {_describe(mesh)}. Build one mesh with an axis for each kind of split (e.g. "
                "jax.make_mesh((2, 4), ('data', 'expert'))), fully_shard every unit on that same mesh, and say "
                "which axes each unit shards over with FullyShardPolicy(dp_mesh_dims=js.DataParallelMeshDims(...))."
            )
    return mesh


def _describe(mesh: Mesh) -> str:
    devices = mesh.devices.flatten().tolist()
    ids = [d.id for d in devices]
    return f"{dict(mesh.shape)} over devices {ids}"
