"""The layout XLA:TPU keeps a reduce-scatter in: its scattered dim most major."""

from __future__ import annotations

import jax
from jax.experimental.layout import Layout, with_layout_constraint


def dim_major(x: jax.Array, dim: int) -> jax.Array:
    """``x`` constrained to a layout with ``dim`` most major in memory, the rest in order.

    XLA:TPU keeps a reduce-scatter only where its scattered dim is the most major of its
    operand's layout; any other (which its layout assignment picks for a weight gradient formed
    from transposed activations, or read by a concatenation along another dim) it decomposes
    into an all-reduce of the whole operand and a slice: twice the bytes, the whole buffer held
    (libtpu 0.0.42.1 and 0.0.50.1, v5p; the reduce-scatter-decomposer pass after layout
    assignment). A no-op for 1-D ``x``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jshard._sharding.scatter_layout import dim_major
      >>> "LayoutConstraint" in jax.jit(lambda x: dim_major(x, 1)).lower(jnp.ones((4, 8))).as_text()
      True
      >>> dim_major(jnp.ones(3), 0).shape  # 1-D: as it is
      (3,)
    """
    if x.ndim < 2:
        return x
    return with_layout_constraint(x, Layout(major_to_minor=(dim, *(d for d in range(x.ndim) if d != dim))))
