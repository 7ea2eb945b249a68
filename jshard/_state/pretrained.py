"""Pretrained weights from another library's unsharded checkpoint, read and placed one leaf at a time.

[Note: pretrained loading] ``load_full_state_dict`` needs the whole tree on the host first, twice
the model's bytes at the peak once the devices hold their shards. Here each leaf of ``like`` is
read from the file when it is placed, with its eager layout (padding, placement dim, memory
kind): ``jax.make_array_from_callback`` asks for each device's block, and the block is read
from the file alone ([Note: checkpoint files]), padded with zeros past the leaf's end and cast
to the leaf's dtype. So neither the host nor any device holds more than one full leaf at a
time; most blocks are one device's rows. An Orbax checkpoint of the plain tree is restored one
leaf per call with that leaf's padded global shape and sharding (Orbax's pad-or-truncate, as
``CheckpointManager.restore`` does), so each device reads its own rows from storage.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jshard._state.checkpoint_files import StoredTensor, msgpack_index, read_block, safetensors_index
from jshard._state.stored_leaves import StoredLeaf, as_like, key_name, stored_leaves


def _file_index(path: str) -> dict[str, tuple[str, StoredTensor]]:
    """``name -> (file, tensor)`` for a safetensors file, a Hugging Face sharded index or a msgpack file."""
    if path.endswith(".safetensors"):
        return {name: (path, t) for name, t in safetensors_index(path).items()}
    if path.endswith(".index.json"):
        with open(path) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        folder = os.path.dirname(path)
        return {n: v for file in files for n, v in _file_index(os.path.join(folder, file)).items()}
    if path.endswith(".msgpack"):
        return {name: (path, t) for name, t in msgpack_index(path).items()}
    raise ValueError(
        f"Cannot read {path!r}: pass a .safetensors file, a Hugging Face .safetensors.index.json, a Flax .msgpack "
        "file, or an Orbax checkpoint directory of the plain tree."
    )


def _orbax_index(path: str) -> tuple[Any, dict[str, tuple[int, Any]]]:
    """The tree structure of an Orbax checkpoint of a plain tree, and ``name -> (position, metadata)``."""
    import orbax.checkpoint as ocp  # only for Orbax checkpoints: `import jshard` loads no Orbax

    tree = ocp.PyTreeCheckpointer().metadata(path).item_metadata.tree
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return treedef, {".".join(key_name(e) for e in p): (i, m) for i, (p, m) in enumerate(flat)}


def _dtype(record: StoredLeaf) -> np.dtype:
    return np.dtype(record.layout.dtype if record.layout is not None else np.asarray(record.leaf).dtype)


def _check(found: dict[str, tuple[int, ...]], wanted: dict[str, StoredLeaf], path: str, strict: bool) -> None:
    missing = sorted(set(wanted) - set(found))
    extra = sorted(set(found) - set(wanted)) if strict else []
    if missing or extra:
        raise ValueError(
            f"The checkpoint {path!r} does not hold the leaves of `like`: missing {missing[:5]} ({len(missing)}), "
            f"unexpected {extra[:5]} ({len(extra)}); pass `names=` to map each leaf's dotted path onto the "
            "checkpoint's names, or strict=False to ignore the checkpoint's extra entries."
        )
    for name, record in wanted.items():
        if tuple(found[name]) != record.shape:
            raise ValueError(
                f"Leaf {record.name}: `like` has shape {record.shape}, but the checkpoint {path!r} holds "
                f"{name!r} with shape {tuple(found[name])}; load a checkpoint of the same model (a transposed "
                "layout, as torch's (out, in) against Flax's (in, out), must be converted first)."
            )


def _place_from_file(file: str, tensor: StoredTensor, record: StoredLeaf) -> Any:
    """One leaf placed like ``record``: each device's block read from ``file``, zero padded, cast."""
    dtype = _dtype(record)
    if record.sharding is None:
        value = read_block(file, tensor, (slice(None),) * len(tensor.shape)).astype(dtype)
        return as_like(record.leaf, value if not isinstance(record.leaf, jax.Array) else jax.numpy.asarray(value))
    shape = record.layout.padded_shape if record.layout is not None else record.shape

    def block(index: tuple[slice, ...]) -> np.ndarray:
        spans = [s.indices(n)[:2] for s, n in zip(index, shape, strict=True)]
        inside = tuple(slice(min(a, n), min(b, n)) for (a, b), n in zip(spans, tensor.shape, strict=True))
        rows = read_block(file, tensor, inside).astype(dtype, copy=False)
        widths = [(0, (b - a) - (s.stop - s.start)) for (a, b), s in zip(spans, inside, strict=True)]
        return np.pad(rows, widths) if any(w for _, w in widths) else rows

    return jax.make_array_from_callback(shape, record.sharding, block)


def _place_from_orbax(path: str, treedef: Any, position: int, record: StoredLeaf) -> Any:
    """One leaf restored alone from an Orbax checkpoint into ``record``'s layout (the others skipped)."""
    import orbax.checkpoint as ocp

    from jshard._state.checkpoint import leaf_restore_args

    args = [ocp.PLACEHOLDER] * treedef.num_leaves
    args[position] = leaf_restore_args(record, _dtype(record))
    args = jax.tree.unflatten(treedef, args)
    out = ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(item=args, restore_args=args))
    return as_like(record.leaf, treedef.flatten_up_to(out)[position])


def _dotted(record: StoredLeaf) -> str:
    return ".".join(record.keys)


def load_pretrained(path: Any, like: Any, *, names: Callable[[str], str] | None = None, strict: bool = True) -> Any:
    """Load an unsharded checkpoint written by another library onto ``like``'s layouts, one leaf at a time.

    Each leaf is read when it is placed, and each device receives only its own rows (padded,
    on its placement dim and memory kind, as ``fully_shard`` lays it out), so neither the host
    nor any device holds more than one full leaf at a time ([Note: pretrained loading]).

    Args:
      path: a ``str`` or ``os.PathLike`` naming a ``.safetensors`` file (Hugging Face,
        ``safetensors.numpy.save_file``), a Hugging Face ``model.safetensors.index.json`` of
        several files, a Flax ``.msgpack`` file (``flax.serialization.to_bytes``, Hugging
        Face's ``flax_model.msgpack``), or the directory of an Orbax checkpoint of the plain
        tree (``PyTreeCheckpointer().save``).
      like: the sharded tree to fill (concrete, or abstract: ``fully_shard`` of
        ``jax.ShapeDtypeStruct`` leaves, or ``jax.eval_shape`` of a born-sharded initialiser).
      names: maps each leaf's dotted path in ``like`` without unit nodes
        (``"block.w"``, list indices as numbers) to its name in the checkpoint; default: the
        dotted path itself (Flax's ``flatten_dict(sep=".")``, how Hugging Face Flax names tensors).
      strict: whether checkpoint entries that no leaf of ``like`` names are an error.

    Returns:
      A tree like ``like`` holding the checkpoint's values, cast to ``like``'s dtypes.

    Raises:
      ValueError: a leaf the checkpoint lacks (or, with ``strict``, an entry ``like`` lacks),
        or a leaf of another shape than the checkpoint's.

    Example:
      >>> import tempfile, os, numpy as np, jax.numpy as jnp, jshard as js
      >>> from safetensors.numpy import save_file
      >>> from jshard.state_dict import load_pretrained
      >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
      >>> save_file({"block.w": np.ones((7, 15), np.float32)}, path)
      >>> like = js.fully_shard({"block": {"w": jnp.zeros((7, 15))}})
      >>> loaded = load_pretrained(path, like)
      >>> loaded["block"]["w"].shape, float(loaded["block"]["w"].sum())
      ((8, 15), 105.0)
    """
    path, records = os.fspath(path), stored_leaves(like)
    wanted = {(names or (lambda n: n))(_dotted(r)): r for r in records}
    if len(wanted) < len(records):
        raise ValueError("`names` maps two leaves of `like` onto one checkpoint entry; give each leaf its own name.")
    if os.path.isdir(path):
        treedef, index = _orbax_index(path)
        _check({n: m.shape for n, (_, m) in index.items()}, wanted, path, strict)
        leaves = [_place_from_orbax(path, treedef, index[n][0], r) for n, r in wanted.items()]
    else:
        files = _file_index(path)
        _check({n: t.shape for n, (_, t) in files.items()}, wanted, path, strict)
        leaves = [_place_from_file(*files[n], r) for n, r in wanted.items()]
    return jax.tree.unflatten(jax.tree.structure(like), leaves)
