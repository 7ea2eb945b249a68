"""The analytic figures of docs/design.md "Performance model", from units' static facts.

Per unit leaf: ``P`` padded elements, ``N`` devices on the shard axes, ``R`` on the
replicate axes, ``b_s`` / ``b_c`` / ``b_r`` bytes per element of the shard dtype,
``param_dtype`` and ``reduce_dtype``. Per device and step (ring model):

- all-gather ``P·b_c·(N−1)/N`` in forward, again in backward when the unit reshards
  after forward (``reshard_after_forward=k``: backward gathers ``P·b_c·(1−k/N)``);
- reduce-scatter ``P·b_r·(N−1)/N``; HSDP all-reduce ``2·(P/N)·b_r·(R−1)/R``;
- a replicated leaf (0-d, or a per-layer scalar) is all-reduced over the shard axes.

Padding is counted (it is gathered and reduced too), so these are the exact figures a
step should reach; ``params`` (Ψ) is also given without padding. The backward
re-gather is an upper bound: XLA drops the re-gather of a leaf whose value backward
does not need (an added bias), so a measured/analytic all-gather ratio a little below 1
is expected. A matrix whose matmuls or row lookups are routed (``weight_gradients=
"from_activations"``) sends activations instead, fewer elements than these figures ([Note: weight
gradient route], [Note: row lookup route]); they are not modelled, so the figures bound such a
step from above.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from jshard._sharding.dtypes import is_floating
from jshard._sharding.layout import LeafLayout, memory_kind
from jshard._sharding.unit import FSDPUnit, all_units

HOST_KINDS = ("pinned_host", "unpinned_host")


@dataclasses.dataclass(frozen=True)
class Analytic:
    """Analytic per-device figures of a step (bytes; collective bytes are sent per step).

    ``params``: Ψ, trainable elements without padding; ``padded_params`` with it.
    ``state_bytes``: every argument leaf that sits in a unit (parameters and optimizer
    state), per device; ``other_argument_bytes``: the rest (batch, step counters), from
    the compiled input shardings. ``argument_bytes`` / ``host_argument_bytes``: what
    ``memory_analysis()`` should report as device / host arguments. ``grad_bytes``: one
    sharded gradient tree; ``gathered_unit_bytes``: the largest unit (one layer of a
    stack) gathered in ``param_dtype``. ``unit_shard_sizes``: the distinct shard sizes of the
    units, largest first (several where units shard over different axes: experts).
    """

    devices: int
    shard_size: int
    replicate_size: int
    params: int
    padded_params: int
    param_bytes: int
    state_bytes: int
    other_argument_bytes: int
    argument_bytes: int
    host_argument_bytes: int
    grad_bytes: int
    gathered_unit_bytes: int
    all_gather: float
    reduce_scatter: float
    all_reduce: float
    unit_shard_sizes: tuple[int, ...] = ()


def _itemsize(dtype: Any) -> int:
    return np.dtype(dtype).itemsize


def _leaf_dtypes(layout: LeafLayout, policy) -> tuple[np.dtype, np.dtype]:
    mp = policy.mp_policy
    return mp.compute_dtype(layout.dtype), mp.gradient_dtype(layout.dtype)


def _model_parts(layout: LeafLayout, axes: Any, gathered: bool = False) -> int:
    """How many model-axis blocks a device's copy of the leaf is one of (1 without model axes);
    ``gathered``: of the gathered leaf, whose composed placement dim is whole."""
    dims = [names for d, names in enumerate(layout.model) if not (gathered and layout.composed and d == layout.dim)]
    return math.prod(axes.model_size(names) for names in dims)


def _leaf_traffic(layout: LeafLayout, unit: FSDPUnit, raf: bool | int) -> tuple[float, float, float]:
    """(all-gather, reduce-scatter, all-reduce) bytes per device per microbatch for one leaf, over
    the data-parallel axes (a model-split leaf moves its own model-axis block only)."""
    n, r = unit.meta.axes.shard_size, unit.meta.axes.replicate_size
    b_c, b_r = (_itemsize(d) for d in _leaf_dtypes(layout, unit.meta.policy))
    trainable = is_floating(layout.dtype)
    parts = _model_parts(layout, unit.meta.axes)
    if not layout.sharded:
        size = math.prod(layout.shape) / parts
        return 0.0, 0.0, (2.0 * size * b_r * ((n - 1) / n + (r - 1) / r) if trainable else 0.0)
    padded = math.prod(layout.padded_shape) / parts
    gather = padded * b_c * (n - 1) / n
    if raf is True:
        gather *= 2
    elif raf is not False:
        gather += padded * b_c * (1 - int(raf) / n)
    if not trainable:
        return gather, 0.0, 0.0
    return gather, padded * b_r * (n - 1) / n, 2.0 * (padded / n) * b_r * (r - 1) / r


def _gathered_bytes(unit: FSDPUnit) -> int:
    """Bytes of the unit gathered in ``param_dtype`` (one layer of a stacked unit)."""
    stacked = unit.meta.policy.scan_axis == 0
    total = 0
    for layout in unit.meta.layouts:
        if layout is None or layout.ignored:
            continue
        shape = layout.shape[1:] if stacked else layout.shape
        parts = _model_parts(layout, unit.meta.axes, gathered=True)
        total += math.prod(shape) // parts * _itemsize(_leaf_dtypes(layout, unit.meta.policy)[0])
    return total


def _state_bytes(args: Any) -> tuple[int, int, set[int]]:
    """Per-device (device, host) bytes of every leaf inside a unit in ``args``; their ids.

    A sharded leaf holds ``padded elements / N`` per device, a replicated one all of it; a
    leaf split over model axes of total size ``M`` a further ``1 / M``.
    """
    device = host = 0
    seen: set[int] = set()
    for unit, _ in all_units(args):
        for layout, x in zip(unit.meta.layouts, unit.own_entries(), strict=True):
            if layout is None:
                continue
            seen.add(id(x))
            nbytes = math.prod(x.shape) * _itemsize(x.dtype)
            parts = (unit.meta.axes.shard_size if layout.sharded else 1) * _model_parts(layout, unit.meta.axes)
            nbytes = nbytes // parts
            if memory_kind(layout, unit.meta.policy) in HOST_KINDS:
                host += nbytes
            else:
                device += nbytes
    return device, host, seen


def _shard_bytes(x: Any, sharding: Any) -> int:
    shape = sharding.shard_shape(tuple(x.shape)) if hasattr(sharding, "shard_shape") else x.shape
    return math.prod(shape) * _itemsize(x.dtype)


def analytic(params: Any, args: Any, input_shardings: Any, microbatches: int = 1) -> Analytic:
    """The analytic figures for a step over ``params`` called with ``args``.

    Args:
      params: the sharded parameters (a tree of :class:`jshard.FSDPUnit`).
      args: every argument of the step (parameters, optimizer state, batch, ...).
      input_shardings: the compiled step's input shardings, a tree like ``args``.
      microbatches: gradient accumulation steps inside the step (collectives repeat).
    """
    units = all_units(params)
    if not units:
        raise ValueError("The report found no FSDPUnit in `params`: pass the output of js.fully_shard.")
    axes = units[0][0].meta.axes
    gather = scatter = reduce = 0.0
    psi = padded_psi = param_bytes = 0
    for unit, root in units:
        raf = unit.meta.policy.resolved_reshard_after_forward(root)
        for layout in unit.meta.layouts:
            if layout is None or layout.ignored:
                continue
            g, s, r = _leaf_traffic(layout, unit, raf)
            gather, scatter, reduce = gather + g, scatter + s, reduce + r
            if is_floating(layout.dtype):
                psi += math.prod(layout.shape)
                padded_psi += math.prod(layout.padded_shape)
            n = (unit.meta.axes.shard_size if layout.sharded else 1) * _model_parts(layout, unit.meta.axes)
            param_bytes += math.prod(layout.padded_shape) * _itemsize(layout.dtype) // n
    device, host, in_units = _state_bytes(args)
    state, other = device + host, 0
    for x, sharding in zip(jax.tree.leaves(args), jax.tree.leaves(input_shardings), strict=True):
        if id(x) in in_units:
            continue
        nbytes = _shard_bytes(x, sharding)
        other += nbytes
        if getattr(sharding, "memory_kind", None) in HOST_KINDS:
            host += nbytes
        else:
            device += nbytes
    return Analytic(
        devices=axes.data_parallel_size,
        shard_size=axes.shard_size,
        replicate_size=axes.replicate_size,
        params=psi,
        padded_params=padded_psi,
        param_bytes=param_bytes,
        state_bytes=state,
        other_argument_bytes=other,
        argument_bytes=device,
        host_argument_bytes=host,
        grad_bytes=param_bytes,
        gathered_unit_bytes=max(_gathered_bytes(u) for u, _ in units),
        all_gather=gather * microbatches,
        reduce_scatter=scatter * microbatches,
        unit_shard_sizes=tuple(sorted({u.meta.axes.shard_size for u, _ in units}, reverse=True)),
        all_reduce=reduce * microbatches,
    )
