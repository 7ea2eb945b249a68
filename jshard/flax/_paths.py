"""Paths in the Flax adapters: a unit tree's entries by key path, and how messages print paths.

NNX users address parameters by attribute (``blocks[0].attn``), Linen users by scope
(``Block_0/Dense_1``); each adapter prints paths its users' way, from one place.
"""

from __future__ import annotations

from typing import Any

import jax

from jshard._sharding.unit import is_unit

Path = tuple[Any, ...]


def entry_paths(tree: Any) -> list[tuple[Path, Any]]:
    """``(path, entry)`` of a unit's tree in tree order; sub-units are entries, paths are dict keys.

    Example:
      >>> from jshard.flax._paths import entry_paths
      >>> entry_paths({"attn": {"q": 1}, "b": 2})
      [(('attn', 'q'), 1), (('b',), 2)]
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_unit)
    return [(tuple(k.key for k in keys), x) for keys, x in flat]


def attribute_path(path: Path) -> str:
    """An NNX path as attribute access: ``('blocks', 0, 'attn')`` -> ``'blocks[0].attn'``.

    Example:
      >>> from jshard.flax._paths import attribute_path
      >>> attribute_path(("blocks", 0, "attn"))
      'blocks[0].attn'
    """
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out


def scope_path(path: Path) -> str:
    """A Linen scope path: ``('Block_0', 'Dense_1')`` -> ``'Block_0/Dense_1'``; the root is ``<root>``.

    Example:
      >>> from jshard.flax._paths import scope_path
      >>> scope_path(("Block_0", "Dense_1")), scope_path(())
      ('Block_0/Dense_1', '<root>')
    """
    return "/".join(path) or "<root>"
