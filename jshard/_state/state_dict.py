"""Full and sharded state dicts of sharded trees (parameters, optimizer states), and loading them.

A *full* state dict is the user's tree (units replaced by their inner trees) with every
leaf unpadded, of its original shape, as NumPy on the host: gathered one leaf at a time,
so at most one full leaf is on the devices at once (FSDP2's ``full_state_dict=True,
cpu_offload=True``). Loading it copies each device's rows straight from the host, so no
device ever holds a full leaf. A *sharded* state dict is the same tree holding the stored
arrays themselves: getting and loading it moves no data.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jshard._sharding.layout import LeafLayout, pad_layers, unpad, unpad_layers
from jshard._state.stored_leaves import StoredLeaf, check_structure, stored_leaves, strip_units

_STORED_MISMATCH = (
    "Leaf {name}: the stored array has shape {got}, but its unit's layout says {want}; this leaf does not mirror "
    "its parameter (e.g. Adafactor's factored moments under plain Optax): build the optimizer state with "
    "jshard.optim.shard_optimizer(tx), whose state records each leaf's own layout."
)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _gathered(x: jax.Array, layout: LeafLayout | None, replicated: NamedSharding) -> jax.Array:
    x = jax.device_put(x, replicated)
    x = x if layout is None else unpad_layers(unpad(x, layout), layout)
    return jax.lax.with_sharding_constraint(x, replicated)  # Auto (model) axes: the output stays replicated


def _replicated(sharding: Any) -> NamedSharding | None:
    mesh = getattr(sharding, "mesh", None)
    return None if mesh is None else NamedSharding(mesh, PartitionSpec())


def _to_host(record: StoredLeaf, keep: bool) -> np.ndarray | None:
    """One leaf, unpadded, on the host (``None`` when ``keep`` is false; the gather runs on every process)."""
    x, layout = record.leaf, record.layout
    if not isinstance(x, jax.Array):
        return np.asarray(x) if keep else None
    if layout is not None and tuple(x.shape) != layout.padded_shape:
        raise ValueError(_STORED_MISMATCH.format(name=record.name, got=tuple(x.shape), want=layout.padded_shape))
    padded = layout is not None and (layout.padding > 0 or layout.layers is not None)
    if padded or not x.is_fully_replicated:
        x = _gathered(x, layout if padded else None, _replicated(x.sharding))
    return np.asarray(x.addressable_data(0)) if keep else None


def full_state_dict(tree: Any, *, process0_only: bool = False) -> Any | None:
    """The tree with every leaf unpadded, at its original shape, as NumPy on the host.

    Units are replaced by their inner trees, so the result has the structure of the tree
    ``fully_shard`` was given (or of the unsharded optimizer state). Leaves are gathered
    one at a time: at most one full leaf is on the devices at once. Every process must
    call it (the gathers are collectives).

    Args:
      tree: parameters, gradients or an optimizer state holding units.
      process0_only: only process 0 (``jax.process_index() == 0``) receives the tree;
        the others get ``None`` and skip the host copies.

    Returns:
      The full state dict, or ``None`` on processes other than 0 with ``process0_only``.

    Raises:
      ValueError: a stored leaf whose shape is not its unit's padded shape.

    Example:
      >>> import jax.numpy as jnp, jshard as js
      >>> from jshard.state_dict import full_state_dict
      >>> sharded = js.fully_shard({"w": jnp.arange(10.0).reshape(5, 2)})
      >>> full = full_state_dict(sharded)
      >>> type(full["w"]).__name__, full["w"].shape
      ('ndarray', (5, 2))
    """
    keep = not process0_only or jax.process_index() == 0
    host = [_to_host(r, keep) for r in stored_leaves(tree)]
    return jax.tree.unflatten(jax.tree.structure(strip_units(tree)), host) if keep else None


def _check_full(record: StoredLeaf, value: Any) -> np.ndarray:
    value = np.asarray(value)
    want_dtype = record.layout.dtype if record.layout is not None else np.asarray(record.leaf).dtype
    if value.shape != record.shape or value.dtype != want_dtype:
        raise ValueError(
            f"Leaf {record.name}: the full state dict has shape {value.shape} and dtype {value.dtype}, but `like` "
            f"expects shape {record.shape} and dtype {want_dtype}; load a state dict of the same model (cast "
            "with .astype if only the dtype differs)."
        )
    return value


def _from_host(record: StoredLeaf, value: Any) -> Any:
    """One full leaf placed like ``record``: each device copies only its own rows from the host."""
    host, layout, sharding = _check_full(record, value), record.layout, record.sharding
    if layout is not None:
        host = pad_layers(host, layout)
    if layout is not None and layout.padding:
        widths = [(0, 0)] * host.ndim
        widths[layout.dim] = (0, layout.padding)
        host = np.pad(host, widths)
    if sharding is None:
        if isinstance(record.leaf, bool | int | float | complex):  # a Python scalar (a step count) stays one
            return type(record.leaf)(host.item())
        return host if isinstance(record.leaf, np.ndarray | np.generic) else jax.numpy.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def load_full_state_dict(full: Any, like: Any) -> Any:
    """Shard a full state dict onto the meshes and layouts of ``like`` (the inverse of :func:`full_state_dict`).

    Args:
      full: a tree with the structure of ``like`` without unit nodes, each leaf of its
        original shape and dtype (NumPy, or fully addressable arrays). Every process
        passes the whole tree.
      like: the sharded tree to copy units, layouts and shardings from (concrete, or
        abstract from ``fully_shard`` on ``jax.ShapeDtypeStruct`` leaves).

    Returns:
      A tree like ``like`` holding ``full``: padded with zeros, sharded.

    Raises:
      ValueError: a different structure, or a leaf of another shape or dtype.

    Example:
      >>> import numpy as np, jax.numpy as jnp, jshard as js
      >>> from jshard.state_dict import load_full_state_dict
      >>> like = js.fully_shard({"w": jnp.zeros((5, 2))})
      >>> loaded = load_full_state_dict({"w": np.ones((5, 2), np.float32)}, like)
      >>> loaded["w"].shape, float(loaded["w"].sum())
      ((8, 2), 10.0)
    """
    values = check_structure(full, like, "full state dict")
    leaves = [_from_host(r, v) for r, v in zip(stored_leaves(like), values, strict=True)]
    return jax.tree.unflatten(jax.tree.structure(like), leaves)


def sharded_state_dict(tree: Any) -> Any:
    """The tree without unit nodes, holding the stored (padded, sharded) arrays themselves: no data moves.

    Example:
      >>> import jax.numpy as jnp, jshard as js
      >>> from jshard.state_dict import sharded_state_dict
      >>> sharded = js.fully_shard({"w": jnp.ones((5, 2))})
      >>> sharded_state_dict(sharded)["w"] is sharded["w"]
      True
    """
    return strip_units(tree)


def load_sharded_state_dict(state_dict: Any, like: Any) -> Any:
    """Put a sharded state dict back into ``like``'s units, without moving data.

    Args:
      state_dict: the output of :func:`sharded_state_dict` for a tree laid out like
        ``like`` (same meshes, shapes and shardings).
      like: the sharded tree whose units and layouts to use.

    Returns:
      A tree like ``like`` holding the very arrays of ``state_dict``.

    Raises:
      ValueError: a different structure, or a leaf of another stored shape or sharding
        (use :func:`load_full_state_dict` or :mod:`jshard.checkpoint` to change meshes).

    Example:
      >>> import jax.numpy as jnp, jshard as js
      >>> from jshard.state_dict import load_sharded_state_dict, sharded_state_dict
      >>> sharded = js.fully_shard({"w": jnp.ones((5, 2))})
      >>> load_sharded_state_dict(sharded_state_dict(sharded), sharded)["w"] is sharded["w"]
      True
    """
    values = check_structure(state_dict, like, "sharded state dict")
    for record, value in zip(stored_leaves(like), values, strict=True):
        want = getattr(record.leaf, "shape", None), getattr(record.leaf, "sharding", None)
        got = getattr(value, "shape", None), getattr(value, "sharding", None)
        same = got[0] == want[0] and (want[1] is None or (got[1] is not None and got[1].is_equivalent_to(
            want[1], len(got[0]))))
        if not same:
            raise ValueError(
                f"Leaf {record.name}: the sharded state dict holds shape {got[0]} with sharding {got[1]}, but `like` "
                f"stores shape {want[0]} with sharding {want[1]}; a sharded state dict loads only onto the layout it "
                "came from: use load_full_state_dict or jshard.checkpoint to change meshes."
            )
    return jax.tree.unflatten(jax.tree.structure(like), values)

