"""Where each leaf of an Optax state lives, found by the parameters' structure in the state.

[Note: state layout] ``shard_optimizer`` runs the transformation on the parameters as the
user wrote them (units stripped, padding sliced off), so the state it makes has exactly the
structure of the unsharded state, whatever the transformation: masks, labels and Muon's or
SM3's own structures included. Optax builds a state from the parameters by mapping over
their tree (``optax.tree.zeros_like(params)``, ``jax.tree.map(f, params)``), so a state leaf
is tied to a parameter by where it sits in a copy of that tree, never by its name or shape:

- the state is walked from its root; a node where the parameters' tree, or one of its
  subtrees (``optax.lookahead`` keeps the state of ``params.fast``), fits is a copy of it:
  its nodes are the parameters' nodes (with the same keys), and where the parameters hold a
  leaf it holds that parameter's state: an array, a list of arrays (SM3's per-dim
  accumulators) or nothing (a ``MaskedNode`` or ``None``: masked out, also for a whole
  masked subtree). The largest tree that fits wins. Parameters that are one array have
  every array of the state for a copy;
- a state leaf at a parameter's place with that parameter's shape (Adam's ``mu``) mirrors
  it: the parameter's layout, in the leaf's dtype; another leaf there (SM3's accumulators,
  Adafactor's factored moments) belongs to it: replicated below ``min_size_to_shard``
  elements, else sharded on its largest dim, padded like a parameter;
- a node that fits several subtrees of the same size placed differently (two blocks of
  one structure, sharded on different dims) is ambiguous: an error names the state leaf,
  its shape and the candidates, never a guess;
- any other leaf (step counts, schedules' state) is replicated, outside every unit.

A copy of the whole tree (Adam's ``mu`` and ``nu``, Adafactor's ``v_row``) is stored with
the parameters' units around it, each unit's meta holding its leaves' state layouts: where
those equal the parameters' (``mu``), the metas are the parameters' own, so
``jax.tree.map(f, params, state[0].mu)`` works. Any other leaf that belongs to a parameter
(under a mask's or labels' partial tree, Muon's, SM3's lists) is a unit of one leaf. Either
way each unit carries its parameter's facts (mesh, axes, policy: offloaded parameters keep
their state in host memory) and each leaf its own layout, so :func:`jshard.unshard`, the
state dicts and checkpoints read the state exactly.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from jshard._sharding.layout import LeafLayout
from jshard._sharding.unit import FSDPUnit, is_unit
from jshard._state.stored_leaves import StoredLeaf, stored_leaves, strip_units


def replicated_layout(x: Any) -> LeafLayout:
    """The layout of a leaf stored whole on every device (a PRNG key array keeps its key dtype)."""
    dtype = x.dtype if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended) else np.dtype(x.dtype)
    return LeafLayout(tuple(np.shape(x)), dtype, None, 0)


def _own_layout(param: LeafLayout, x: Any, shard_size: int, min_size: int) -> LeafLayout:
    """The layout of a state leaf that belongs to ``param`` (see [Note: state layout])."""
    shape, dtype = tuple(x.shape), np.dtype(x.dtype)
    if shape == param.unpadded_shape:
        return dataclasses.replace(param, dtype=dtype)
    if param.ignored or not shape or math.prod(shape) < min_size:
        return LeafLayout(shape, dtype, None, 0, ignored=param.ignored)
    dim = int(np.argmax(shape))
    return LeafLayout(shape, dtype, dim, shard_size * math.ceil(shape[dim] / shard_size))


_AMBIGUOUS = (
    "shard_optimizer: the state leaf {leaf} of shape {shape} sits in a copy of several parameters' trees "
    "that are placed differently ({candidates}), so which parameter it belongs to is not known. Initialize "
    "the inner transformation on the whole parameters (mask the others out with optax.masked) so that its "
    "state has their structure, or shard these parameters alike (the same placement dim, mesh and policy)."
)


def _one_level(x: Any) -> tuple[Any, list[tuple[Any, Any]]]:
    """``x``'s own node (a treedef whose children are leaves) and its children with their keys."""
    pairs, node = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
    return node, [(path[0], child) for path, child in pairs]


def _is_array(x: Any) -> bool:
    treedef = jax.tree.structure(x)
    return treedef.num_nodes == 1 and treedef.num_leaves == 1


def _is_empty(x: Any) -> bool:
    """No leaves at all: a ``MaskedNode``, ``None``, an empty container."""
    return jax.tree.structure(x).num_leaves == 0


def _is_own_state(x: Any) -> bool:
    """What a state holds at a parameter's place: an array, a list of arrays (SM3), or nothing."""
    return _is_array(x) or _is_empty(x) or (type(x) in (list, tuple) and all(map(_is_array, x)))


def _fit(anchor: Any, x: Any, param_path: tuple, state_path: tuple, out: list) -> bool:
    """Whether state node ``x`` is a copy of the parameters' subtree ``anchor``; ``out`` gets
    ``(state leaf path, parameter path, leaf)`` for every leaf it holds at a parameter's place."""
    if _is_array(anchor):
        if not _is_own_state(x):
            return False
        out.extend((state_path + p, param_path, leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(x)[0])
        return True
    if _is_empty(x):  # a masked-out subtree
        return True
    (node, children), (x_node, x_children) = _one_level(anchor), _one_level(x)
    return node == x_node and all(_fit(a, c, param_path + (k,), state_path + (k,), out)
                                  for (k, a), (_, c) in zip(children, x_children, strict=True))


def _anchors(plain: Any) -> dict[Any, list[tuple[int, tuple, Any]]]:
    """Every subtree of the parameters that holds a parameter, by its own node: ``(size, path, subtree)``,
    largest first."""
    found: dict[Any, list] = {}

    def visit(path: tuple, x: Any) -> None:
        if _is_array(x) or _is_empty(x):
            return
        node, children = _one_level(x)
        found.setdefault(node, []).append((jax.tree.structure(x).num_nodes, path, x))
        for key, child in children:
            visit(path + (key,), child)

    visit((), plain)
    return {node: sorted(entries, key=lambda e: -e[0]) for node, entries in found.items()}


def _owners(path: tuple, x: Any, anchors: dict, facts: dict[tuple, StoredLeaf]) -> dict[tuple, StoredLeaf] | None:
    """The parameter of every leaf of state node ``x`` (by the leaf's path), if ``x`` is a copy of the
    parameters' tree or of a subtree: the largest that fits, and one placement (see [Note: state layout])."""
    fits: list[tuple[int, list]] = []
    for size, anchor_path, anchor in anchors.get(_one_level(x)[0], []):
        if fits and size < fits[0][0]:
            break
        out: list = []
        if _fit(anchor, x, anchor_path, path, out):
            fits.append((size, out))
    if not fits:
        return None
    owners = {}
    for (leaf_path, param_path, leaf), *others in zip(*(out for _, out in fits), strict=True):
        candidates = [param_path] + [p for _, p, _ in others]
        if len({(facts[p].meta, facts[p].layout) for p in candidates}) > 1:
            raise ValueError(_AMBIGUOUS.format(leaf=jax.tree_util.keystr(leaf_path), shape=tuple(np.shape(leaf)),
                                               candidates=", ".join(map(jax.tree_util.keystr, candidates))))
        owners[leaf_path] = facts[param_path]
    return owners


def _with_units(subtree: Any, params: Any, min_size: int) -> Any:
    """A state subtree of the parameters' structure, inside the parameters' units."""
    leaves = iter(jax.tree.leaves(subtree))

    def rebuild(p: Any) -> FSDPUnit:  # every leaf of the parameters is in a unit
        entries, layouts = [], []
        for layout, entry in zip(p.meta.layouts, p.own_entries(), strict=True):
            if layout is None:
                entries.append(rebuild(entry))
                layouts.append(None)
                continue
            x = next(leaves)
            own = _own_layout(layout, x, p.meta.axes.shard_size, min_size)
            entries.append(jax.ShapeDtypeStruct(own.padded_shape, x.dtype))
            layouts.append(own)
        return FSDPUnit(p.with_entries(entries), dataclasses.replace(p.meta, layouts=tuple(layouts)))

    return jax.tree.map(rebuild, params, is_leaf=is_unit)


def stored_state(abstract_state: Any, params: Any, min_size: int) -> Any:
    """The stored form of a state (abstract, of the unsharded structure; see the Note):
    copies of the parameters' whole tree inside the parameters' units, other leaves of a
    parameter as units of one leaf, the rest as they are (replicated)."""
    facts = {record.path: record for record in stored_leaves(params)}
    plain = jax.tree.structure(strip_units(params))
    anchors = _anchors(strip_units(params))

    def one_leaf_unit(record: StoredLeaf, x: Any) -> FSDPUnit:
        layout = _own_layout(record.layout, x, record.meta.axes.shard_size, min_size)
        meta = dataclasses.replace(record.meta, layouts=(layout,))
        return FSDPUnit(jax.ShapeDtypeStruct(layout.padded_shape, x.dtype), meta)

    def store(path: tuple, x: Any) -> Any:
        if _is_array(x) and () in facts:  # the parameters are one array: every array is a copy of them
            return one_leaf_unit(facts[()], x)
        if _is_array(x) or _is_empty(x):  # outside every copy of the parameters: replicated
            return x
        owners = _owners(path, x, anchors, facts)
        if owners is None:
            node, children = _one_level(x)
            return jax.tree.unflatten(node, [store(path + (key,), child) for key, child in children])
        if jax.tree.structure(x) == plain:
            return _with_units(x, params, min_size)
        return jax.tree_util.tree_map_with_path(lambda p, leaf: one_leaf_unit(owners[path + p], leaf), x)

    return store((), abstract_state)
