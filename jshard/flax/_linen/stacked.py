"""Which Linen units are stacked, carried by the params through ``nn.scan`` / ``nn.vmap``.

[Note: Linen stacking] ``shard_params`` learns that a wrapped module is called inside
``nn.scan`` (its params stacked: ``scan_axis=0``) the way Flax carries sharding metadata:
each leaf of the params goes into the abstract call boxed in :class:`Stacked`, an
``AxisMetadata``; a lifted transform that splits the params (``nn.scan``, ``nn.vmap``)
calls ``remove_axis`` on the boxes on the way in, so the wrapped module finds on its own
params the axes that were removed above it, never guessed from shapes. The module unboxes
its own params before its code runs; the params of wrapped modules inside it stay boxed
until they reach theirs (so its code, and a tied embedding read through ``variables``,
sees plain arrays).
"""

from __future__ import annotations

from typing import Any

import jax
from flax import struct
from flax.core import meta

from jshard.flax._paths import Path, scope_path


class Stacked(struct.PyTreeNode, meta.AxisMetadata):
    """A param leaf with the axes lifted transforms removed from it, outermost first.

    Example:
      >>> import jax.numpy as jnp
      >>> from jshard.flax._linen.stacked import Stacked
      >>> Stacked(jnp.ones((4, 3))).remove_axis(0, {}).removed
      (0,)
    """

    value: Any
    removed: tuple[int, ...] = struct.field(pytree_node=False, default=())

    def unbox(self) -> Any:
        return self.value

    def replace_boxed(self, val: Any) -> Stacked:
        return self.replace(value=val)

    def add_axis(self, index: int, params: dict[Any, Any]) -> Stacked:
        return self.replace(removed=self.removed[:-1])

    def remove_axis(self, index: int, params: dict[Any, Any]) -> Stacked:
        return self.replace(removed=(*self.removed, index))


def box(params: Any) -> Any:
    """Every leaf of ``params`` in a :class:`Stacked` box with nothing removed yet."""
    return jax.tree.map(Stacked, params)


def own_unboxed(params: Any, path: Path, units: tuple[Path, ...]) -> tuple[Any, tuple[int, ...]]:
    """The params of the wrapped module at ``path`` with its own leaves unboxed (those of the
    wrapped modules inside it, ``units``, stay boxed), and the axes removed from its own leaves.

    Raises:
      ValueError: its own leaves had different axes removed, or an axis other than one
        leading axis (jshard stacks layers along axis 0 only).
    """
    inner = [q[len(path):] for q in units if len(q) > len(path) and q[: len(path)] == path]
    removed: dict[tuple[int, ...], str] = {}

    def unbox_own(keys: Any, leaf: Any) -> Any:
        where = tuple(k.key for k in keys)
        if not isinstance(leaf, Stacked) or any(where[: len(q)] == q for q in inner):
            return leaf
        removed.setdefault(leaf.removed, scope_path(path + where))
        return leaf.value

    params = jax.tree_util.tree_map_with_path(unbox_own, params, is_leaf=lambda x: isinstance(x, Stacked))
    axes = set(removed) - {()}
    if len(removed) > 1 or axes - {(0,)}:
        found = ", ".join(f"{leaf} split on {list(axes)}" for axes, leaf in removed.items())
        raise ValueError(
            f"Linen module at `{scope_path(path)}` is wrapped with jshard.flax.linen.fully_shard and called where "
            f"lifted transforms split its params unlike one stack of layers ({found}): jshard stacks a unit's "
            "layers along axis 0 only; use nn.scan / nn.vmap with variable_axes={'params': 0} around the wrapped "
            "module, once."
        )
    return params, next(iter(removed), ())
