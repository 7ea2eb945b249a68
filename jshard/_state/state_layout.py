"""Where each leaf of an Optax state lives, found by its key path among the parameters'.

[Note: state layout] ``shard_optimizer`` runs the transformation on the parameters as the
user wrote them (units stripped, padding sliced off), so the state it makes has exactly the
structure of the unsharded state, whatever the transformation: masks, labels and Muon's or
SM3's own structures included. Each state leaf is then placed by its key path:

- a leaf whose path ends with a parameter's path and has that parameter's shape (Adam's
  ``mu['layer']['w']``) mirrors it: the parameter's layout, in the leaf's dtype;
- a leaf whose path ends as a parameter's does, with its shape, mirrors it too
  (``optax.lookahead`` keeps the state of ``params.fast`` under ``fast_state``);
- a leaf under a parameter's path otherwise (SM3's per-dim accumulators
  ``mu['layer']['w'][0]``, Adafactor's factored moments) belongs to it: replicated below
  ``min_size_to_shard`` elements, else sharded on its largest dim, padded like a parameter;
- any other leaf (step counts, schedules' state) is replicated, outside every unit.

A subtree with the structure of the parameters (Adam's ``mu`` and ``nu``, Adafactor's
``v_row``) is stored with the parameters' units around it, each unit's meta holding its
leaves' state layouts: where those equal the parameters' (``mu``), the metas are the
parameters' own, so ``jax.tree.map(f, params, state[0].mu)`` works. Any other leaf that
belongs to a parameter (under a mask's or labels' partial tree, Muon's, SM3's lists) is a
unit of one leaf. Either way each unit carries its parameter's facts (mesh, axes, policy:
offloaded parameters keep their state in host memory) and each leaf its own layout, so
:func:`jshard.unshard`, the state dicts and checkpoints read the state exactly.
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
    if shape == param.shape:
        return dataclasses.replace(param, dtype=dtype)
    if param.ignored or not shape or math.prod(shape) < min_size:
        return LeafLayout(shape, dtype, None, 0, ignored=param.ignored)
    dim = int(np.argmax(shape))
    return LeafLayout(shape, dtype, dim, shard_size * math.ceil(shape[dim] / shard_size))


def _parameters(params: Any) -> dict[tuple, StoredLeaf]:
    """Every parameter's unit facts (``meta``, ``layout``), by its key path in the user's tree."""
    return {record.path: record for record in stored_leaves(params)}


def _owner(path: tuple, shape: tuple[int, ...], params: dict[tuple, StoredLeaf]) -> StoredLeaf | None:
    """The parameter a state leaf at ``path`` belongs to: the one whose whole path ends ``path``
    or a prefix of it (longest first); else one of its shape whose path ends as ``path`` does
    (most keys first: ``optax.lookahead`` keeps ``fast``'s state under ``fast_state``)."""
    best = None
    for q, facts in params.items():
        n = len(q)
        for end in range(len(path), n - 1, -1):
            if path[end - n : end] == q:
                exact = end == len(path) and shape == facts.layout.shape
                if best is None or n > best[0] or (n == best[0] and exact):
                    best = (n, facts)
                break
    if best is not None:
        return best[1]
    for k in range(len(path), 0, -1):
        for q, facts in params.items():
            if q[-k:] == path[-k:] and len(q) >= k and shape == facts.layout.shape:
                return facts
    return None


def _with_units(subtree: Any, params: Any, shard_size: int, min_size: int) -> Any:
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
            own = _own_layout(layout, x, shard_size, min_size)
            entries.append(jax.ShapeDtypeStruct(own.padded_shape, x.dtype))
            layouts.append(own)
        return FSDPUnit(p.with_entries(entries), dataclasses.replace(p.meta, layouts=tuple(layouts)))

    return jax.tree.map(rebuild, params, is_leaf=is_unit)


def stored_state(abstract_state: Any, params: Any, shard_size: int, min_size: int) -> Any:
    """The stored form of a state (abstract, of the unsharded structure; see the Note):
    subtrees of the parameters' structure inside the parameters' units, other leaves of a
    parameter as units of one leaf, the rest as they are (replicated)."""
    by_path = _parameters(params)
    plain = jax.tree.structure(strip_units(params))

    def of_params(x: Any) -> bool:
        return plain.num_nodes > 1 and jax.tree.structure(x) == plain

    def place(path, x):
        if of_params(x):
            return _with_units(x, params, shard_size, min_size)
        facts = _owner(path, tuple(np.shape(x)), by_path)
        if facts is None:
            return x
        layout = _own_layout(facts.layout, x, shard_size, min_size)
        meta = dataclasses.replace(facts.meta, layouts=(layout,))
        return FSDPUnit(jax.ShapeDtypeStruct(layout.padded_shape, x.dtype), meta)

    return jax.tree_util.tree_map_with_path(place, abstract_state, is_leaf=of_params)
