"""Local-view collectives: small pure functions of (arrays, axis names), for ``shard_map``."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jshard._sharding import scatter_layout
from jshard._sharding.torus import phase_groups

Axes = tuple[str, ...]


def all_gather(x: jax.Array, axes: Axes, dim: int, groups: Sequence[Sequence[int]] | None = None,
               phases: Sequence[int] = ()) -> jax.Array:
    """Concatenate the shards of ``x`` along ``dim`` over ``axes`` (device order).

    ``groups``: gather within these groups of indices over ``axes`` only. ``phases`` (sizes
    whose product is the size of ``axes``, slowest first) splits the gather into one per phase,
    fastest first, over the devices that differ in that digit of their index, with the same
    result: the TPU torus's dimensions (see [Note: torus phases] in ``torus.py``).

    Example:
      >>> import jax, jax.numpy as jnp, jshard as js
      >>> mesh = js.make_mesh()
      >>> def both(x):
      ...     one = js.collectives.all_gather(x, ("fsdp",), 0)
      ...     return one, js.collectives.all_gather(x, ("fsdp",), 0, phases=(2, 2, 2))
      >>> f = jax.shard_map(both, mesh=mesh, in_specs=jax.P("fsdp"), out_specs=jax.P(), check_vma=False)
      >>> one, phased = f(jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, jax.P("fsdp"))))
      >>> one.tolist(), bool((one == phased).all())
      ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], True)
    """
    if len(phases) < 2:
        return jax.lax.all_gather(x, axes, axis=dim, tiled=True, axis_index_groups=groups)
    if groups is not None:
        raise ValueError("all_gather takes `groups` or `phases`, not both")
    for k in reversed(range(len(phases))):
        x = jax.lax.all_gather(x, axes, axis=dim, tiled=True, axis_index_groups=phase_groups(phases, k))
    return x


def reduce_scatter(g: jax.Array, axes: Axes, dim: int, phases: Sequence[int] = (),
                   sizes: Sequence[int] = (), dim_major: bool = False) -> jax.Array:
    """Sum ``g`` over ``axes`` and keep this device's chunk of ``dim`` (tiled).

    ``phases`` (sizes whose product is the size of ``axes``, slowest first) splits it into one
    reduce-scatter per phase over the devices that differ in that digit of their index, with
    the same result: the TPU torus's dimensions (see [Note: torus phases] in ``torus.py``).
    ``sizes`` (one per reduce-scatter, default ``g``'s): pad each device's chunk of ``dim`` so
    that the scattered input has this size, and drop the padding from the result; the size
    XLA:TPU scatters natively ([Note: scatter padding] in ``scatter_padding.py``). ``dim_major``:
    hand each reduce-scatter its operand with ``dim`` most major in memory, the only layout
    XLA:TPU keeps a reduce-scatter in (it makes the others all-reduces; ``scatter_layout.py``).

    Example:
      >>> import jax, jax.numpy as jnp, jshard as js
      >>> mesh = js.make_mesh()
      >>> def both(g):
      ...     one = js.collectives.reduce_scatter(g, ("fsdp",), 0)
      ...     return one, js.collectives.reduce_scatter(g, ("fsdp",), 0, phases=(2, 2, 2))
      >>> f = jax.shard_map(both, mesh=mesh, in_specs=jax.P(), out_specs=jax.P("fsdp"), check_vma=False)
      >>> one, phased = f(jnp.arange(16.0))
      >>> bool((one == phased).all()), one.tolist()[:3]
      (True, [0.0, 8.0, 16.0])
    """
    if len(phases) < 2:
        n = math.prod(jax.lax.axis_size(a) for a in axes) if sizes else 1
        return _scatter_padded(g, axes, dim, None, n, sizes[:1], dim_major)
    for k in range(len(phases)):
        g = _scatter_padded(g, axes, dim, phase_groups(phases, k), phases[k], sizes[k : k + 1], dim_major)
    return g


def _scatter_padded(g: jax.Array, axes: Axes, dim: int, groups, n: int, size: Sequence[int],
                    major: bool) -> jax.Array:
    """One tiled reduce-scatter over ``n`` devices, each chunk padded so that ``dim`` has ``size``
    (``major``: its operand laid out ``dim`` first)."""
    rows = g.shape[dim]
    padded = bool(size) and size[0] != rows
    if padded:
        chunks = g.reshape(g.shape[:dim] + (n, rows // n) + g.shape[dim + 1 :])
        widths = [(0, 0)] * chunks.ndim
        widths[dim + 1] = (0, size[0] // n - rows // n)
        g = jnp.pad(chunks, widths).reshape(g.shape[:dim] + (size[0],) + g.shape[dim + 1 :])
    g = scatter_layout.dim_major(g, dim) if major else g
    out = jax.lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True, axis_index_groups=groups)
    return jax.lax.slice_in_dim(out, 0, rows // n, axis=dim) if padded else out


def all_reduce(g: jax.Array, axes: Axes) -> jax.Array:
    """Sum ``g`` over ``axes`` (identity when ``axes`` is empty)."""
    return jax.lax.psum(g, axes) if axes else g


def divide_factors(factor: float, reduce_dtype: np.dtype, force_sum: bool) -> tuple[float, float]:
    """How to split the division by ``factor`` around a summing collective.

    float16 overflows when summing many gradients, so (as FSDP2 does) it is pre-divided
    by a power of two near ``sqrt(factor)`` and post-divided by the rest; other dtypes
    are divided once, after the sum, unless ``force_sum`` asks for the split.

    Example:
      >>> from jshard.collectives import divide_factors
      >>> import numpy as np
      >>> divide_factors(8, np.dtype("float32"), False), divide_factors(8, np.dtype("float16"), False)
      ((1.0, 8.0), (4.0, 2.0))
    """
    if reduce_dtype != np.float16 and not force_sum:
        return 1.0, float(factor)
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return float(pre), float(factor) / pre


def int8_all_gather(x: jax.Array, axes: Axes, dim: int, block: int = 256) -> jax.Array:
    """All-gather in int8 with one float32 scale per block of ``block`` elements.

    A drop-in ``FullyShardPolicy(custom_all_gather=...)``: each element is rounded to
    the nearest of 255 levels of its block's absolute maximum, so the error is at most
    ``max|block| / 254``; bytes on the wire are ``1/4 + 1/block`` of float32's.

    Example:
      >>> import jax, jax.numpy as jnp, jshard as js
      >>> mesh = js.make_mesh()
      >>> f = jax.shard_map(lambda x: js.int8_all_gather(x, ("fsdp",), 0), mesh=mesh,
      ...                   in_specs=jax.P("fsdp"), out_specs=jax.P(), check_vma=False)
      >>> x = jax.device_put(jnp.linspace(-1.0, 1.0, 64), jax.NamedSharding(mesh, jax.P("fsdp")))
      >>> bool(jnp.abs(f(x) - x).max() <= 1 / 254)
      True
    """
    n = x.size
    flat = jnp.ravel(x).astype(jnp.float32)
    nblocks = math.ceil(n / block)
    flat = jnp.pad(flat, (0, nblocks * block - n)).reshape(nblocks, block)
    scale = jnp.max(jnp.abs(flat), axis=1, keepdims=True) / 127.0
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(flat / safe), -127, 127).astype(jnp.int8)
    qs = jax.lax.all_gather(q, axes, axis=0, tiled=False)
    scales = jax.lax.all_gather(scale, axes, axis=0, tiled=False)
    shards = (qs.astype(jnp.float32) * scales).reshape(qs.shape[0], -1)[:, :n]
    shards = shards.reshape((qs.shape[0],) + x.shape).astype(x.dtype)
    full = jnp.moveaxis(shards, 0, dim)
    return full.reshape(x.shape[:dim] + (-1,) + x.shape[dim + 1 :])


FLOAT8_MAX = 448.0  # the largest finite float8_e4m3fn


def float8_all_gather(x: jax.Array, axes: Axes, dim: int, scaling: str = "row") -> jax.Array:
    """All-gather in float8 (e4m3) with float32 scales, data and scales in one collective.

    A drop-in ``FullyShardPolicy(custom_all_gather=...)`` for float32 or bfloat16 shards
    (torchao's float8 all-gather): each shard is scaled so that its absolute maximum
    (``scaling="tensor"``) or each row's (``"row"``: every index of the shard's dim 0) maps
    to 448, rounded to e4m3 (3 mantissa bits: an element's error is at most ``2**-4`` of it,
    or ``2**-10`` of its scale ``amax / 448`` where it is subnormal), and sent as one
    ``uint8`` buffer holding the float8 bytes followed by the scales' bytes, padded to rows of
    128 bytes (a flat ``uint8`` buffer gathered whole is laid out by XLA:TPU with a unit
    dimension padded fourfold). Bytes on the wire: one per element plus four per scale,
    half of bfloat16's when rows are long. The gathered values are rescaled in the shard's
    dtype, so no float32 copy of the gathered leaf is made for a bfloat16 one.

    Example:
      >>> import jax, jax.numpy as jnp, jshard as js
      >>> mesh = js.make_mesh()
      >>> f = jax.shard_map(lambda x: js.float8_all_gather(x, ("fsdp",), 0), mesh=mesh,
      ...                   in_specs=jax.P("fsdp"), out_specs=jax.P(), check_vma=False)
      >>> x = jax.device_put(jnp.linspace(-1.0, 1.0, 64 * 4).reshape(64, 4), jax.NamedSharding(mesh, jax.P("fsdp")))
      >>> bool((jnp.abs(f(x) - x) <= jnp.abs(x) / 16 + 1 / 512).all())
      True
    """
    if scaling not in ("row", "tensor"):
        raise ValueError(f"`scaling` must be 'row' or 'tensor', got {scaling!r}.")
    rows = x.reshape(x.shape[0], -1).astype(jnp.float32) if x.ndim else x.reshape(1, 1).astype(jnp.float32)
    amax = jnp.max(jnp.abs(rows), axis=1 if scaling == "row" else None, keepdims=True)
    scale = jnp.where(amax > 0, amax / FLOAT8_MAX, 1.0).astype(jnp.float32)
    q = (rows / scale).astype(jnp.float8_e4m3fn)
    packed = jnp.concatenate([jax.lax.bitcast_convert_type(q, jnp.uint8).ravel(),
                              jax.lax.bitcast_convert_type(scale, jnp.uint8).ravel()])
    width = 128  # rows of 128 bytes: the uint8 buffer tiles on TPU without padding a unit dimension
    packed = jnp.pad(packed, (0, -packed.size % width)).reshape(-1, width)
    gathered = jax.lax.all_gather(packed, axes, axis=0, tiled=True).reshape(-1, packed.size)  # one collective
    n = q.size
    data = jax.lax.bitcast_convert_type(gathered[:, :n], jnp.float8_e4m3fn).reshape((-1,) + rows.shape)
    scales = jax.lax.bitcast_convert_type(gathered[:, n : n + 4 * scale.size].reshape((-1,) + scale.shape + (4,)),
                                          jnp.float32)
    shards = (data.astype(x.dtype) * scales.astype(x.dtype)).reshape((-1,) + x.shape)
    full = jnp.moveaxis(shards, 0, dim)
    return full.reshape(x.shape[:dim] + (-1,) + x.shape[dim + 1 :])
