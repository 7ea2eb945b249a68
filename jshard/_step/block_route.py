"""Weight gradients reduced a block at a time: the matmuls that read a gathered matrix.

[Note: weight gradient blocks] FSDP's reduction receives the whole gradient ``x^T dy`` a device
formed from its rows, a ``[K, N]`` buffer, and reduce-scatters it (for an unrolled unit on a v5p
slice in two phases, a quarter-size buffer beside it). With
``FullyShardPolicy(weight_gradients="in_blocks")`` a marked matrix's matmul ``x @ w`` (found as
``weight_route.py`` finds them) becomes :func:`blocked_matmul`, whose backward forms the gradient
``BLOCKS`` blocks at a time along the matrix's unsharded dim and reduce-scatters each block (the
gradients' rule: torus phases and XLA:TPU's native sizes) before the next block's matmul runs, so
the whole gradient never exists; bytes and FLOPs are the reduction's. Forward gathers the shard
and multiplies; backward gathers it again for ``dx`` (the gathered matrix is not kept between
them). Each block's matmul waits for the previous block's reduction through ``remat.depend`` (an
``optimization_barrier`` there pinned buffers: tanh unrolled 8x1536 kept bf16 peaked at 25.79 MiB,
18.29 with ``depend``). Three limits, measured on the v5p 2x2x2 training-step sweep: a matrix
whose blocks would be under ``MIN_TPU_BLOCK`` keeps the reduced route (:func:`block_parts`), so
does one the route from activations left (a policy's ``"from_activations+in_blocks"``) whose
gradient is under ``MIN_TPU_FALLBACK_GRADIENT``, and so does every matrix of a recomputed piece (a
layer or segment under a ``remat_policy``), where the recomputed forward's gather, then the block
route's own in backward, would gather it three times a step: 1.5x the analytic bytes
(``weight_route.route_whole``). A matrix its unit keeps gathered through backward (the root's,
``reshard_after_forward=False``: marked ``freed=False``) is gathered once by the route's forward
and kept for its backward, as the unit would keep it, wherever its matmul runs: no extra bytes,
and its whole gradient never exists (the Llama-3-8B NNX plan on ``v5p-256`` with weight gradients
``from_activations+in_blocks``: the output head's float32 gradient, 2004 MiB, no longer at the
step's fullest point; docs/planning.md). Blocks are equal where that keeps them native, else
``BLOCK_ALIGN`` wide but the last (:func:`block_parts`): on v5e XLA:TPU all-reduces the first
torus phase of the Llama-3-8B head's gradient whole and in equal blocks, not in blocks of 32768
columns, and the NNX plan on ``v5e-256`` fell from 5555.8 to 4049.2 MiB (thirty-third session;
the Hugging Face plan there rose from 4375.5 to 5718.6, as docs/benchmarks.md says).
Measured by hand first: ``benchmarks/weight_gradient_route.py``'s ``chunks`` route,
docs/benchmarks.md "Weight gradients reduced a block at a time".
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jshard._sharding.scatter_padding import first_kept, phases_and_sizes
from jshard._step.gather import LeafComm, gather_cast, reduce_summed, scatter_native
from jshard._step.remat import SAVED, depend

BLOCKS = 4  # blocks of the unsharded dim, where it divides and XLA keeps them native (else 2)
# Smaller blocks save little and add their matrix's re-gather: blocking a transformer's [256, 256]
# float32 matrices too ([256, 64] blocks) raised the sweep's unrolled 8x256 peak 80.85 -> 82.88 MiB.
MIN_TPU_BLOCK = 256 << 10
# A matrix the route from activations left (``"from_activations+in_blocks"``, more rows than it
# has inputs) is blocked on TPU only where its gradient holds this much: under it the blocks saved
# less than their reductions cost. The sweep's 8x256 transformers' [256, 1024] float32 gradients
# (1 MiB), blocked at 64 rows a device on v5p, raised the unrolled kept model 71.23 -> 79.24 MiB
# (the recipe's 63.37; 74.42 -> 78.59 under the async flags, against 72.93).
MIN_TPU_FALLBACK_GRADIENT = 4 << 20
# Where equal blocks are not native, blocks this many columns (or rows) wide but the last: XLA:TPU
# on v5e-256 all-reduces the first phase of the Llama-3-8B head's [4096, 32064] and [4096, 64128]
# blocks (and its whole gradient) but scatters [4096, 32768] and [4096, 29952] ones.
BLOCK_ALIGN = 1024


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def blocked_matmul(comm: LeafComm, precision: Any, preferred: Any, kept: bool, x: jax.Array,
                   shard: jax.Array) -> jax.Array:
    """``x @ gather(shard)``, its weight gradient reduced a block at a time (see the Note);
    ``precision`` and ``preferred`` are the matmul's own; ``kept``: the gathered matrix is kept for
    backward (its unit keeps it), else gathered again there."""
    return _fwd(comm, precision, preferred, kept, x, shard)[0]


def contract(a: jax.Array, b: jax.Array, dims: Any, precision: Any = None, preferred: Any = None) -> jax.Array:
    """``a`` and ``b`` contracted over ``dims`` (``(a's, b's)``), no batch dims: the matmuls of
    this route and of ``weight_route.py``'s.

    Example:
      >>> import jax.numpy as jnp
      >>> from jshard._step.block_route import contract
      >>> contract(jnp.ones((2, 3)), jnp.ones((2, 4)), ((0,), (0,))).shape  # x^T dy
      (3, 4)
    """
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=precision, preferred_element_type=preferred)


def ordered(value: jax.Array, after: jax.Array) -> jax.Array:
    """``value``, available only once ``after`` is (``remat.depend``): a block after the last one's reduction."""
    return depend(value, [after])


def _fwd(comm, precision, preferred, kept, x, shard):
    w = gather_cast(comm, shard)
    if kept:  # saved as its unit's gathered leaves are, under any policy
        w = checkpoint_name(w, SAVED)
    return contract(x, w, ((x.ndim - 1,), (0,)), precision, preferred), (x, w if kept else shard)


def _bwd(comm, precision, preferred, kept, residuals, dy):
    x, w = residuals
    if not kept:
        w = gather_cast(comm, ordered(w, dy))  # gathered again once the cotangent arrives
    dx = contract(dy, w, ((dy.ndim - 1,), (1,)), precision, preferred)
    return dx.astype(x.dtype), reduce_summed(comm, _matmul_blocks(comm, x, dy))


blocked_matmul.defvjp(_fwd, _bwd)


def _matmul_blocks(comm: LeafComm, x: jax.Array, dy: jax.Array) -> jax.Array:
    """This device's shard of ``x^T dy`` (contracted over all but their last dims) summed over the
    shard axes, formed and reduce-scattered in blocks (:func:`reduced_in_blocks`). ``x`` and
    ``dy`` keep their leading dims (not reshaped to rows: XLA:TPU then lays the blocks out as it
    lays out the reduced route's whole gradient)."""
    dim, lead = comm.layout.dim, tuple(range(x.ndim - 1))

    def form(part: slice, after: jax.Array | None) -> jax.Array:
        a, b = (x, dy[..., part]) if dim == 0 else (x[..., part], dy)
        if after is not None:  # this block's matmul after the last block's reduction
            a, b = (a, ordered(b, after)) if dim == 0 else (ordered(a, after), b)
        return contract(a, b, (lead, lead))

    return reduced_in_blocks(comm, (x.shape[-1], dy.shape[-1]), form)


def reduced_in_blocks(comm: LeafComm, shape: tuple[int, int], form: Callable[[slice, Any], jax.Array]) -> jax.Array:
    """This device's shard of a ``shape`` matrix's gradient summed over the shard axes, in
    ``reduce_dtype``, formed and reduce-scattered a block of its unsharded dim at a time
    (:func:`block_parts`): ``form(part, after)`` is the gradient's block ``part`` of that dim,
    its inputs ordered after ``after`` (the previous block's reduction; ``None`` for the first).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, jshard as js
      >>> from jax.sharding import PartitionSpec as P
      >>> from jshard._sharding.layout import LeafLayout
      >>> from jshard._sharding.mesh import resolve_axes
      >>> from jshard._step.block_route import reduced_in_blocks
      >>> from jshard._step.gather import LeafComm
      >>> mesh = js.make_mesh()
      >>> comm = LeafComm(LeafLayout((8, 8), np.dtype("float32"), 0, 8), resolve_axes(mesh, None),
      ...                 js.FullyShardPolicy(), 1.0)
      >>> f = jax.shard_map(lambda: reduced_in_blocks(comm, (8, 8), lambda part, after: jnp.ones((8, 2))),
      ...                   mesh=mesh, in_specs=(), out_specs=P("fsdp"))
      >>> np.asarray(f())[0].tolist()  # device 0's row, summed over the 8 devices, 4 blocks of 2 columns
      [8.0, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0]
    """
    dim = comm.layout.dim
    blocks, done = [], None
    for part in block_parts(comm, shape):
        done = scatter_native(comm, form(part, done).astype(comm.reduce_dtype), dim)
        blocks.append(done)
    return jnp.concatenate(blocks, axis=1 - dim)


def block_parts(comm: LeafComm, shape: tuple[int, int], fallback: bool = False) -> tuple[slice, ...]:
    """The blocks of its unsharded dim a ``shape`` matrix's gradient is reduced in: ``BLOCKS`` or 2
    of them, the most whose reduce-scatters XLA:TPU keeps one, at their native size, of
    ``MIN_TPU_BLOCK`` bytes or more (on TPU); equal where that holds, else ``BLOCK_ALIGN`` wide but
    the last; one block (the whole dim) where none does, and the matmul is left to the reduced
    route. ``fallback``: the route from activations left the matmul, and on TPU a gradient under
    ``MIN_TPU_FALLBACK_GRADIENT`` bytes keeps the reduced route.

    Example:
      >>> import numpy as np, jshard as js
      >>> from jshard._sharding.layout import LeafLayout
      >>> from jshard._sharding.mesh import resolve_axes
      >>> from jshard._step.block_route import block_parts
      >>> from jshard._step.gather import LeafComm
      >>> layout = LeafLayout((64, 48), np.dtype("float32"), 0, 64)  # sharded on its rows
      >>> comm = LeafComm(layout, resolve_axes(js.make_mesh(), None), js.FullyShardPolicy(), 1.0)
      >>> len(block_parts(comm, (64, 48))), len(block_parts(comm, (64, 6)))  # CPU devices keep every reduce-scatter
      (4, 2)
      >>> [(p.start, p.stop) for p in block_parts(comm, (64, 3075))]  # 3075 columns split unevenly
      [(0, 1024), (1024, 2048), (2048, 3072), (3072, 3075)]
    """
    dim = comm.layout.dim
    size = shape[1 - dim]
    whole = (slice(0, size),)
    if fallback and comm.axes.tpu_mesh is not None and (
            shape[0] * shape[1] * np.dtype(comm.reduce_dtype).itemsize < MIN_TPU_FALLBACK_GRADIENT):
        return whole
    for count in (BLOCKS, 2):
        for bounds in _bounds(size, count):
            parts = tuple(slice(start, stop) for start, stop in zip(bounds[:-1], bounds[1:], strict=True))
            widths = {part.stop - part.start for part in parts}
            if all(_native(comm, (shape[0], w) if dim == 0 else (w, shape[1])) for w in widths):
                return parts
    return whole


def _bounds(size: int, count: int) -> list[list[int]]:
    """Where ``count`` blocks of a ``size`` dim may start and end: equal blocks where ``count``
    divides it, then blocks of a multiple of ``BLOCK_ALIGN`` but the last, where that makes ``count``."""
    bounds = [[j * size // count for j in range(count + 1)]] if size % count == 0 else []
    width = -(-size // (count * BLOCK_ALIGN)) * BLOCK_ALIGN
    if (count - 1) * width < size:
        bounds.append([min(j * width, size) for j in range(count + 1)])
    return bounds


def _native(comm: LeafComm, block: tuple[int, int]) -> bool:
    """Whether XLA keeps a ``block`` gradient's reduce-scatter one: on TPU, a block of at least
    ``MIN_TPU_BLOCK`` bytes whose (first) reduce-scatter compiles to one alone, at its native size."""
    axes, dim, dtype = comm.axes, comm.layout.dim, np.dtype(comm.reduce_dtype)
    if axes.tpu_mesh is None:
        return True
    if block[0] * block[1] * dtype.itemsize < MIN_TPU_BLOCK:
        return False
    phases, sizes = phases_and_sizes(axes.tpu_mesh, axes.shard, comm.scatter_phases, axes.scatter_phases, block,
                                     dtype, dim)
    return first_kept(axes.tpu_mesh, axes.shard, phases, block, sizes[0], dtype, dim)
