"""Weight gradients reduced a block at a time: the matmuls that read a gathered matrix.

[Note: weight gradient blocks] FSDP's reduction receives the whole gradient ``x^T dy`` a
device formed from its rows, a ``[K, N]`` buffer, and reduce-scatters it (for an unrolled unit
on a v5p slice in two phases, a quarter-size buffer beside it). With
``FullyShardPolicy(weight_gradients="in_blocks")`` a marked matrix's matmul ``x @ w`` (found as
``weight_route.py`` finds them) becomes :func:`blocked_matmul`, whose backward forms the
gradient ``BLOCKS`` blocks at a time along the matrix's unsharded dim and reduce-scatters each
block (the gradients' rule: torus phases and XLA:TPU's native sizes) before the next block's
matmul runs, so the whole gradient never exists; bytes and FLOPs are the reduction's. Forward
gathers the shard and multiplies; backward gathers it again for ``dx`` (the gathered matrix is
not kept between them). Two limits, measured on the v5p 2x2x2 training-step sweep: a matrix
whose blocks XLA:TPU would all-reduce (small ones, a latency choice: a transformer's 256 x 64
float32 blocks) keeps the reduced route (:func:`block_count`), and so does every matrix of a
recomputed piece (a layer or segment under a ``remat_policy``), where the recomputed forward's
gather, then the block route's own in backward, would gather it three times a step: 1.5x the
analytic bytes (``weight_route.route_whole``). Left open: in the sweep's unrolled 8x256
transformer XLA:TPU all-reduces the blocked gradients (28.22 MiB a step where the reduced route
sends 0.22) though each block alone stays a reduce-scatter. Measured by hand first:
``benchmarks/weight_gradient_route.py``'s ``chunks`` route, docs/benchmarks.md "Weight gradients
reduced a block at a time".
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jshard._sharding.compiler_probe import compiled_scatter
from jshard._sharding.scatter_padding import phases_and_sizes
from jshard._sharding.torus import phase_groups
from jshard._step import collectives as C
from jshard._step.gather import LeafComm, reduce_summed, scatter_native

BLOCKS = 4  # blocks of the unsharded dim, where it divides and XLA keeps them native (else 2)
# Smaller blocks XLA:TPU all-reduced in a step though one alone compiled to a reduce-scatter (a
# transformer's [256, 64] and [128, 32] float32 blocks, v5p 2x2x2); [512, 128] ones stayed native.
MIN_TPU_BLOCK = 256 << 10


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def blocked_matmul(comm: LeafComm, precision: Any, preferred: Any, x: jax.Array, shard: jax.Array) -> jax.Array:
    """``x @ gather(shard)``, its weight gradient reduced a block at a time (see the Note);
    ``precision`` and ``preferred`` are the matmul's own."""
    return _fwd(comm, precision, preferred, x, shard)[0]


def _gathered(comm: LeafComm, shard: jax.Array) -> jax.Array:
    return C.all_gather(shard.astype(comm.param_dtype), comm.axes.shard, comm.layout.dim,
                        phases=comm.axes.gather_phases)


def _dot(a, b, contract, precision=None, preferred=None):
    return jax.lax.dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=preferred)


def _ordered(value: jax.Array, after: jax.Array) -> jax.Array:
    return jax.lax.optimization_barrier((value, after))[0]


def _fwd(comm, precision, preferred, x, shard):
    return _dot(x, _gathered(comm, shard), ((x.ndim - 1,), (0,)), precision, preferred), (x, shard)


def _bwd(comm, precision, preferred, residuals, dy):
    x, shard = residuals
    rows, rows_dy = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    w = _gathered(comm, _ordered(shard, dy))  # gathered again once the cotangent arrives
    dx = _dot(rows_dy, w, ((1,), (1,)), precision, preferred)
    return dx.reshape(x.shape).astype(x.dtype), reduce_summed(comm, _reduced_in_blocks(comm, rows, rows_dy))


blocked_matmul.defvjp(_fwd, _bwd)


def _reduced_in_blocks(comm: LeafComm, rows: jax.Array, rows_dy: jax.Array) -> jax.Array:
    """This device's shard of ``rows^T rows_dy`` summed over the shard axes, formed and
    reduce-scattered a block of the matrix's unsharded dim at a time, in ``reduce_dtype``."""
    dim = comm.layout.dim
    size = (rows.shape[1], rows_dy.shape[1])[1 - dim]
    count = block_count(comm, (rows.shape[1], rows_dy.shape[1]))
    blocks, done = [], None
    for j in range(count):
        part = slice(j * size // count, (j + 1) * size // count)
        a, b = (rows, rows_dy[:, part]) if dim == 0 else (rows[:, part], rows_dy)
        if done is not None:  # this block's matmul after the last block's reduction
            a, b = (a, _ordered(b, done)) if dim == 0 else (_ordered(a, done), b)
        done = scatter_native(comm, _dot(a, b, ((0,), (0,))).astype(comm.reduce_dtype), dim)
        blocks.append(done)
    return jnp.concatenate(blocks, axis=1 - dim)


def block_count(comm: LeafComm, shape: tuple[int, int]) -> int:
    """How many blocks a ``shape`` matrix's gradient is reduced in: ``BLOCKS`` or 2, the most that
    divide its unsharded dim and whose reduce-scatter XLA:TPU keeps one (it all-reduces small
    ones: a transformer's 256 x 64 float32 blocks on a v5p 2x2x2, twice the bytes); 1 where
    none does, and the matmul is left to the reduced route.

    Example:
      >>> import numpy as np, jshard as js
      >>> from jshard._sharding.layout import LeafLayout
      >>> from jshard._sharding.mesh import resolve_axes
      >>> from jshard._step.block_route import block_count
      >>> from jshard._step.gather import LeafComm
      >>> layout = LeafLayout((64, 48), np.dtype("float32"), 0, 64)  # sharded on its rows
      >>> comm = LeafComm(layout, resolve_axes(js.make_mesh(), None), js.FullyShardPolicy(), 1.0)
      >>> block_count(comm, (64, 48)), block_count(comm, (64, 6))  # CPU devices keep every reduce-scatter
      (4, 2)
    """
    dim = comm.layout.dim
    size = shape[1 - dim]
    for count in (BLOCKS, 2):
        block = (shape[0], size // count) if dim == 0 else (size // count, shape[1])
        if size % count == 0 and _native(comm, block):
            return count
    return 1


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
    groups = tuple(map(tuple, phase_groups(phases, 0))) if phases else None
    padded = tuple(sizes[0] if d == dim else n for d, n in enumerate(block))
    return compiled_scatter(axes.tpu_mesh, axes.shard, groups, padded, dtype.name, dim)[0] == "reduce-scatter"
