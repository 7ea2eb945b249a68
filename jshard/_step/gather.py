"""Local-view unshard: gather a unit's shards just in time; reduce their gradients.

Gathered values are tagged with ``checkpoint_name``: ``FREE`` for units that reshard
after forward, ``SAVED`` for the others and for the group copies of
``reshard_after_forward=k``; see [Note: remat policy] in ``remat.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jshard._sharding.dtypes import is_floating
from jshard._sharding.layout import LeafLayout, memory_kind, pad
from jshard._sharding.mesh import MeshAxes
from jshard._sharding.policies import FullyShardPolicy
from jshard._sharding.scatter_padding import phases_and_sizes
from jshard._sharding.step_axes import leaf_view
from jshard._sharding.step_state import StepState
from jshard._sharding.torus import unit_phases
from jshard._step import collectives as C
from jshard._step.model_manual import interleave_model, model_manual, model_piece
from jshard._step.offload import to_device, to_host
from jshard._step.remat import FREE, GATHER_START, SAVED, custom_gather, depend, mark_routable, unpad_gathered


@dataclasses.dataclass(frozen=True)
class LeafComm:
    """Static facts one leaf's gather and reduction need (hashable: a custom_vjp arg)."""

    layout: LeafLayout
    axes: MeshAxes
    policy: FullyShardPolicy
    divide_factor: float
    skip_all_reduce: bool = False
    in_loop: bool = False  # one layer of a stack in a loop body, which orders its gathers itself
    scatter_phases: tuple[int, ...] = ()  # the reduce-scatter's torus phases ([Note: torus phases])
    shard_dtype: np.dtype | None = None  # the shard's, where not the leaf's (a stack cast before its loop)

    @property
    def param_dtype(self) -> np.dtype:
        return self.policy.mp_policy.compute_dtype(self.layout.dtype)

    @property
    def offloaded(self) -> bool:
        return memory_kind(self.layout, self.policy) is not None

    @property
    def reduce_dtype(self) -> np.dtype:
        return self.policy.mp_policy.gradient_dtype(self.layout.dtype)

    @property
    def gradient_dtype(self) -> np.dtype:
        """The dtype the reduced gradient is returned in: the shard's."""
        return np.dtype(self.layout.dtype if self.shard_dtype is None else self.shard_dtype)

    @property
    def routable(self) -> bool:
        """Whether the matmuls and row lookups that read this leaf gathered may form its gradient
        their own way (``FullyShardPolicy(weight_gradients=...)``: from gathered activations,
        [Note: weight gradient route] in ``weight_route.py`` and [Note: row lookup route] in
        ``lookup_route.py``, or in blocks, [Note: weight gradient blocks] in ``block_route.py``):
        a matrix sharded whole on one of its two dims, without padding, model axes, offload or
        custom collectives (a matmul routed from activations needs it freed after forward too)."""
        layout, policy = self.layout, self.policy
        return (bool(policy.gradient_routes) and len(layout.shape) == 2 and layout.sharded
                and layout.padded == layout.shape[layout.dim] and not self.axes.model and not self.offloaded
                and policy.custom_all_gather is None and policy.custom_reduce_scatter is None)


def gather_cast(comm: LeafComm, shard: jax.Array) -> jax.Array:
    """The leaf gathered from ``shard`` for compute: on the device, in ``param_dtype``."""
    x = to_device(shard, comm.offloaded).astype(comm.param_dtype)
    if not comm.layout.sharded:
        return x
    return model_manual(comm.layout, comm.axes, lambda v: _all_gather(comm, v), gathered_in=False, gathered_out=True)(x)


def _all_gather(comm: LeafComm, x: jax.Array) -> jax.Array:
    axes, dim = comm.axes, comm.layout.dim
    if comm.policy.custom_all_gather is None:
        full = C.all_gather(x, axes.shard, dim, phases=axes.gather_phases)
    else:
        full = custom_gather(comm.policy.custom_all_gather, x, axes.shard, dim)
    return _unpad(comm, interleave_model(full, comm.layout, axes))


def _unpad(comm: LeafComm, full: jax.Array) -> jax.Array:
    layout = comm.layout
    return unpad_gathered(full, layout.dim, layout.shape[layout.dim])


def reduce_gradient(comm: LeafComm, g: jax.Array) -> jax.Array:
    """The gradient of a gathered leaf, reduced to this device's shard.

    Cast to ``reduce_dtype``, reduce-scatter over the shard axes (all-reduce for a
    replicated leaf), all-reduce over replicate axes, divide, cast to the shard's dtype.
    """
    g = g.astype(comm.reduce_dtype)
    g = model_manual(comm.layout, comm.axes, lambda v: _reduce(comm, v, _over_shard_axes), gathered_in=True,
                     gathered_out=False)(g)
    return to_host(g, comm.offloaded)


def reduce_summed(comm: LeafComm, g: jax.Array) -> jax.Array:
    """This device's shard of a gathered leaf's gradient, ``g``, already summed over the shard
    axes (formed from gathered activations: [Note: weight gradient route]), finished as
    :func:`reduce_gradient` finishes a reduce-scatter: cast to ``reduce_dtype``, all-reduced over
    replicate axes, divided, cast to the shard's dtype."""
    return to_host(_reduce(comm, g.astype(comm.reduce_dtype), lambda _, v: v), comm.offloaded)


def _reduce(comm: LeafComm, g: jax.Array, over_shard: Callable[[LeafComm, jax.Array], jax.Array]) -> jax.Array:
    """``g`` divided by the pre-factor, summed over the shard axes by ``over_shard``, all-reduced
    over replicate axes, divided by the post-factor, cast to the shard's dtype."""
    pre, post = C.divide_factors(comm.divide_factor, g.dtype, comm.policy.force_sum_reduction_for_comms)
    g = over_shard(comm, g / pre if pre != 1 else g)
    if not comm.skip_all_reduce:
        g = (comm.policy.all_reduce_hook or C.all_reduce)(g, comm.axes.replicate)
    return (g / post).astype(comm.gradient_dtype)


def _over_shard_axes(comm: LeafComm, g: jax.Array) -> jax.Array:
    """``g`` reduce-scattered over the shard axes (all-reduced for a replicated leaf)."""
    layout, policy = comm.layout, comm.policy
    if not layout.sharded:
        return C.all_reduce(g, comm.axes.shard)
    piece = model_piece(pad(g, layout), layout, comm.axes)
    if policy.custom_reduce_scatter is not None:
        return policy.custom_reduce_scatter(piece, comm.axes.shard, layout.dim)
    return scatter_native(comm, piece, layout.dim)


def scatter_native(comm: LeafComm, g: jax.Array, dim: int) -> jax.Array:
    """``g`` summed over the leaf's shard axes, this device's chunk of ``dim`` kept: in the leaf's
    torus phases at the sizes XLA:TPU scatters natively, ``dim`` most major on TPU ([Note: scatter
    padding]; a gradient, a block of one, or a routed matmul's partial sums)."""
    phases, sizes = phases_and_sizes(comm.axes.tpu_mesh, comm.axes.shard, comm.scatter_phases,
                                     comm.axes.scatter_phases, g.shape, g.dtype, dim)
    return C.reduce_scatter(g, comm.axes.shard, dim, phases, sizes, dim_major=comm.axes.tpu_mesh is not None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def gather_shard(comm: LeafComm, shard: jax.Array) -> jax.Array:
    """All-gather a shard in ``param_dtype``; its gradient is :func:`reduce_gradient`."""
    return gather_cast(comm, shard)


def _gather_fwd(comm, shard):
    return gather_cast(comm, shard), None


def _gather_bwd(comm, _, g):
    return (reduce_gradient(comm, g),)


gather_shard.defvjp(_gather_fwd, _gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def gather_from_group_copy(comm: LeafComm, shard: jax.Array, group_copy: jax.Array) -> jax.Array:
    """Gather the full leaf from the copies held by groups of ``k`` devices.

    Device ``i`` of group ``i // k`` holds rows ``[(i//k)*k*c, (i//k+1)*k*c)``; gathering
    across devices with the same ``i % k`` concatenates the groups' copies in order.
    The gather depends on ``shard`` through a zero, so that where the step replaces the
    shard in backward the re-gather is ordered there too ([Note: unrolled units]).
    """
    return _gather_across_groups(comm, shard, group_copy)


def _gather_across_groups(comm: LeafComm, shard: jax.Array, group_copy: jax.Array) -> jax.Array:
    if not comm.in_loop:  # the dependence costs a transient group copy (+0.13 MiB measured on jax 0.12)
        group_copy = depend(group_copy, [shard])

    def across(copy):
        full = C.all_gather(copy, comm.axes.shard, comm.layout.dim, _across_groups(comm))
        return _unpad(comm, interleave_model(full, comm.layout, comm.axes))

    return model_manual(comm.layout, comm.axes, across, gathered_in=False, gathered_out=True)(group_copy)


def _from_group_fwd(comm, shard, group_copy):
    return _gather_across_groups(comm, shard, group_copy), group_copy.shape


def _from_group_bwd(comm, group_shape, g):
    return reduce_gradient(comm, g), jnp.zeros(group_shape, comm.param_dtype)


gather_from_group_copy.defvjp(_from_group_fwd, _from_group_bwd)


def _group_size(comm: LeafComm) -> int:
    return int(comm.policy.reshard_after_forward)


def _within_groups(comm: LeafComm) -> list[list[int]]:
    n, k = comm.axes.shard_size, _group_size(comm)
    return [list(range(g * k, (g + 1) * k)) for g in range(n // k)]


def _across_groups(comm: LeafComm) -> list[list[int]]:
    n, k = comm.axes.shard_size, _group_size(comm)
    return [list(range(r, n, k)) for r in range(k)]


def gather_leaf(comm: LeafComm, shard: jax.Array, reshard_after_forward: bool | int) -> jax.Array:
    """Gather one leaf for compute, tagged for the remat policy (see the Note above).

    A shard that is gathered is named :data:`GATHER_START` first: the step cuts unrolled code
    into segments there and orders it after the previous unit (see [Note: unrolled units] in
    ``segments.py``). A leaf kept whole (``replicate_below``, nothing to split) is not: nothing is
    gathered, and ordering it too made XLA:TPU run every other forward gather synchronously
    (docs/benchmarks.md, "What jshard sends, and when its gathers run").
    """
    if comm.layout.sharded:
        shard = checkpoint_name(shard, GATHER_START)
    if not is_floating(comm.layout.dtype):
        return jax.lax.stop_gradient(gather_cast(comm, shard))
    raf = reshard_after_forward
    if isinstance(raf, bool) or not comm.layout.sharded:
        full = checkpoint_name(gather_shard(comm, shard), FREE if raf else SAVED)
        return mark_routable(full, shard, comm, freed=raf) if comm.routable else full
    x = to_device(jax.lax.stop_gradient(shard), comm.offloaded).astype(comm.param_dtype)
    def gather_within(v):
        return C.all_gather(v, comm.axes.shard, comm.layout.dim, _within_groups(comm))

    group_copy = model_manual(comm.layout, comm.axes, gather_within, gathered_in=False, gathered_out=False)(x)
    group_copy = checkpoint_name(group_copy, SAVED)
    return checkpoint_name(gather_from_group_copy(comm, shard, group_copy), FREE)


def leaf_comm(
    layout: LeafLayout, axes: MeshAxes, policy: FullyShardPolicy, step: StepState, in_loop: bool = False,
    phased: bool = True, layer: bool = False, shard_dtype: np.dtype | None = None,
) -> LeafComm:
    """The leaf as the step sees it ([Note: step axes]), divided by the step's whole batch split;
    ``phased``: reduce in the mesh's torus phases, where it has them ([Note: torus phases]);
    ``layer``: one layer's slice of the stacked leaf, viewed before the layer axis is sliced off
    (a pipeline stage's layers arrive split over ``stage`` on that axis, which is then no
    replicate axis of theirs); ``shard_dtype``: the shard's dtype where it is not the leaf's."""
    layout, axes = leaf_view(layout, axes, step.axes)
    if layer:
        layout = layer_layout(layout)
    factor = policy.gradient_divide_factor or step.axes.data_parallel_size
    phases = unit_phases(axes.scatter_phases, in_loop) if phased else ()
    shard_dtype = None if shard_dtype is None or np.dtype(shard_dtype) == layout.dtype else np.dtype(shard_dtype)
    return LeafComm(layout, axes, policy, float(factor), step.skip_all_reduce, in_loop, phases, shard_dtype)


def layer_layout(layout: LeafLayout) -> LeafLayout:
    """The layout of one layer's slice of a leaf stacked along axis 0."""
    dim = None if layout.dim is None else layout.dim - 1
    return dataclasses.replace(layout, shape=layout.shape[1:], dim=dim, model=layout.model[1:], layers=None)

