"""One all-gather and one reduce-scatter for all the leaves of a unit (FSDP2's copy-in / copy-out).

[Note: unit collectives] The leaves of a unit that gather alike (same shard axes, no
custom hook, no model axes) go through one flat buffer: each device concatenates its
shards, flattened, into one vector; one ``all_gather`` (untiled) gives ``(N, S)``; each
leaf is its columns ``[offset, offset + size)`` of that, moved back to its placement dim.
In backward each gradient is cut into its ``N`` chunks along its placement dim, the
chunks laid side by side into ``(N, S)``, and one ``psum_scatter`` over dim 0 leaves each
device its own row: its shards of every leaf, in order. Both follow the TPU torus in phases
where the leaves' own collectives would ([Note: torus phases]). Leaves of the unit that do not
qualify keep their own collectives.

On TPU both work on whole tiles of ``TPU_TILE`` elements, the tile XLA:TPU lays a
one-dimensional buffer out in. Each device's vector is padded to a whole number of tiles
before the gather: XLA:TPU compiles a gather whose shard is not a multiple of 128 elements
as an *all-reduce* of the zero-filled gathered buffer (libtpu 0.0.42, v5p, bf16 / f32 / u8:
``[98592]`` shards become an all-reduce of ``[788736]``, ``[98304]`` and ``[98560]`` stay
all-gathers), twice the bytes. The reduce-scatter reshapes the buffer into tiles for
[Note: scatter padding].
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jshard._sharding.dtypes import is_floating
from jshard._sharding.layout import pad
from jshard._step import collectives as C
from jshard._step.gather import LeafComm, scatter_native
from jshard._step.offload import to_device, to_host
from jshard._step.remat import pack, unpad_gathered

TPU_TILE = 1024  # elements of a one-dimensional buffer's tile on XLA:TPU ([Note: unit collectives])


def joins_unit_buffer(comm: LeafComm, reshard_after_forward: bool | int) -> bool:
    """Whether a leaf's collectives go through its unit's flat buffer: the unit asks for it
    (``FullyShardPolicy(unit_collectives=True)``), and the leaf is a sharded floating leaf
    with no custom collective, on a mesh without model axes, under a bool
    ``reshard_after_forward`` (an int keeps group copies per leaf)."""
    policy = comm.policy
    return (policy.unit_collectives and comm.layout.sharded and is_floating(comm.layout.dtype)
            and not comm.axes.model and isinstance(reshard_after_forward, bool)
            and policy.custom_all_gather is None and policy.custom_reduce_scatter is None)


def _rows(comm: LeafComm) -> tuple[int, int, int]:
    """The shard as ``(before, rows, after)``: the dims before the placement dim, its local
    size, the dims after."""
    layout, n = comm.layout, comm.axes.shard_size
    shape = layout.padded_shape
    d = layout.dim
    return math.prod(shape[:d]), shape[d] // n, math.prod(shape[d + 1 :])


def _gather(comms: Sequence[LeafComm], shards: Sequence[jax.Array]) -> list[jax.Array]:
    comm0 = comms[0]
    vectors = [to_device(s, c.offloaded).astype(c.param_dtype).ravel() for c, s in zip(comms, shards, strict=True)]
    if comm0.axes.tpu_mesh is not None:  # whole tiles, packed too (the policy saves no copy of the shards)
        vectors.append(jnp.zeros(-sum(v.shape[0] for v in vectors) % TPU_TILE, vectors[0].dtype))
    flat = pack(vectors)
    full = C.all_gather(flat[None], comm0.axes.shard, 0, phases=comm0.axes.gather_phases)  # (N, S): one collective
    n, out, offset = full.shape[0], [], 0
    for c in comms:
        a, r, b = _rows(c)
        piece = full[:, offset : offset + a * r * b].reshape(n, a, r, b)
        offset += a * r * b
        leaf = jnp.moveaxis(piece, 0, 1).reshape(c.layout.padded_shape)
        out.append(unpad_gathered(leaf, c.layout.dim, c.layout.shape[c.layout.dim]))
    return out


def _reduce(comms: Sequence[LeafComm], grads: Sequence[jax.Array]) -> list[jax.Array]:
    comm0 = comms[0]
    n = comm0.axes.shard_size
    pre, post = C.divide_factors(comm0.divide_factor, comm0.reduce_dtype, comm0.policy.force_sum_reduction_for_comms)
    pieces = []
    for c, g in zip(comms, grads, strict=True):
        a, r, b = _rows(c)
        g = pad(g.astype(c.reduce_dtype), c.layout).reshape(a, n, r, b)
        pieces.append(jnp.moveaxis(g, 1, 0).reshape(n, a * r * b))
    flat = jnp.concatenate(pieces, axis=1)
    if pre != 1:
        flat = flat / pre
    mine = _scatter_rows(comm0, flat)  # (S,): one collective (a phase each)
    if not comm0.skip_all_reduce:
        mine = (comm0.policy.all_reduce_hook or C.all_reduce)(mine, comm0.axes.replicate)
    mine = mine / post
    out, offset = [], 0
    for c in comms:
        a, r, b = _rows(c)
        shape = c.layout.padded_shape
        shard = mine[offset : offset + a * r * b].reshape(shape[: c.layout.dim] + (r,) + shape[c.layout.dim + 1 :])
        offset += a * r * b
        out.append(to_host(shard.astype(c.gradient_dtype), c.offloaded))
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def gather_unit(comms: tuple[LeafComm, ...], shards: tuple[jax.Array, ...]) -> list[jax.Array]:
    """All-gather the leaves ``comms`` describe in one collective; their gradients are
    reduce-scattered in one collective too (see [Note: unit collectives])."""
    return _gather(comms, shards)


def _fwd(comms, shards):
    return _gather(comms, shards), None


def _bwd(comms, _, grads):
    return (tuple(_reduce(comms, grads)),)


gather_unit.defvjp(_fwd, _bwd)


def _scatter_rows(comm0: LeafComm, flat: jax.Array) -> jax.Array:
    """Reduce-scatter the ``(N, S)`` buffer to this device's row, as ``(N * S / 1024, 1024)`` tiles
    where XLA:TPU is asked which size it scatters natively ([Note: scatter padding]: it makes
    a large buffer an all-reduce otherwise, and asks nothing of a one-dimensional one)."""
    if comm0.axes.tpu_mesh is None:
        return scatter_native(comm0, flat, 0)[0]
    n, size = flat.shape
    rows = -(-size // TPU_TILE)
    tiles = jnp.pad(flat, ((0, 0), (0, rows * TPU_TILE - size))).reshape(n * rows, TPU_TILE)
    return scatter_native(comm0, tiles, 0).reshape(-1)[:size]

