"""Nested dicts addressed by key paths: build one from ``(path, value)`` items, read, replace."""

from __future__ import annotations

from typing import Any

Path = tuple[Any, ...]


class KeyCollision(ValueError):
    """Two values at one key path (or a value where another path needs a dict)."""

    def __init__(self, path: Path):
        super().__init__(f"two values at key path {path}")
        self.path = path


def nest(items: list[tuple[Path, Any]]) -> dict:
    """A nested dict holding each value at its path; :class:`KeyCollision` if two paths collide.

    Example:
      >>> from jshard._sharding.nested import nest
      >>> nest([(("a", "w"), 1), (("b",), 2)])
      {'a': {'w': 1}, 'b': 2}
    """
    root: dict = {}
    for path, value in items:
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise KeyCollision(path)
        if path[-1] in node:
            raise KeyCollision(path)
        node[path[-1]] = value
    return root


def get_in(tree: Any, path: Path) -> Any:
    """``tree[path[0]][path[1]]...``."""
    for key in path:
        tree = tree[key]
    return tree


def set_in(tree: dict, path: Path, value: Any) -> Any:
    """A copy of ``tree`` with ``value`` at ``path`` (only the dicts along the path are copied).

    Example:
      >>> from jshard._sharding.nested import set_in
      >>> set_in({"a": {"w": 1, "b": 2}}, ("a", "w"), 3)
      {'a': {'w': 3, 'b': 2}}
    """
    if not path:
        return value
    out = dict(tree)
    out[path[0]] = set_in(tree[path[0]], path[1:], value)
    return out
