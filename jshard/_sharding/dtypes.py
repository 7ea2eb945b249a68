"""Which leaves are floating, and casting the floating leaves of a tree (one rule for all).

Only floating arrays are cast (mixed precision never touches integer or boolean leaves,
nor non-array leaves such as Flax Variables left in place by ``is_leaf``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def is_floating(dtype: Any) -> bool:
    """Whether ``dtype`` is a floating dtype (parameters that train and get cast).

    Example:
      >>> import jax.numpy as jnp
      >>> from jshard._sharding.dtypes import is_floating
      >>> is_floating(jnp.bfloat16), is_floating(jnp.int32)
      (True, False)
    """
    return bool(jnp.issubdtype(dtype, jnp.floating))


def cast_floating(tree: Any, dtype: Any, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """``tree`` with every floating ``jax.Array`` leaf cast to ``dtype`` (``None``: unchanged).

    Example:
      >>> import jax.numpy as jnp
      >>> from jshard._sharding.dtypes import cast_floating
      >>> out = cast_floating({"x": jnp.ones(2), "i": jnp.arange(2)}, jnp.bfloat16)
      >>> out["x"].dtype, out["i"].dtype
      (dtype(bfloat16), dtype('int32'))
    """
    if dtype is None:
        return tree

    def cast(x):
        return x.astype(dtype) if isinstance(x, jax.Array) and is_floating(x.dtype) else x

    return jax.tree.map(cast, tree, is_leaf=is_leaf)
