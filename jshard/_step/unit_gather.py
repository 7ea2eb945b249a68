"""Gathering a unit for compute: the one routine ``js.unshard``, ``js.scan`` and both Flax
adapters call, each supplying only where its values live.

[Note: gather for compute] Each rule of a unit's gather has one home here: a unit the step
was not given is an error (:meth:`StepState.unit`); where the step gathered every unit up
front (deferred gradient sync) the values are returned as they are; otherwise every own,
non-ignored leaf is all-gathered in ``param_dtype`` (per leaf, or through one flat buffer
with ``unit_collectives``). One layer of a stacked unit runs its gather and compute under
the step's checkpoint (:func:`per_layer`), and under jshard's own policy keeps its vectors
gathered until its backward (``_kept_vector``, [Note: loop residuals]). The guard against reading a shard is
``refuse_shard_read`` (``_sharding/local_shapes.py``, [Note: shard reads]), the forward's casts
are ``MixedPrecisionPolicy``'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jshard._sharding.step_state import NOT_IN_STEP, StepState
from jshard._sharding.torus import phases_pay_off
from jshard._sharding.unit import FSDPUnit, UnitMeta
from jshard._step.gather import LeafComm, gather_leaf, leaf_comm
from jshard._step.remat import FREE, GATHER_START, REMAT_POLICY, SAVED, loop_policy
from jshard._step.unit_collectives import gather_unit, joins_unit_buffer


def gather_for_compute(meta: UnitMeta, entries: list[Any], step: StepState, *, layer: bool = False,
                       not_in_step: str = NOT_IN_STEP) -> list[Any]:
    """``entries`` (a unit's own shards and sub-unit placeholders, in ``unit.own_entries()``
    order; ``meta`` its meta) with every own, non-ignored leaf gathered for compute (see
    [Note: gather for compute]); ``not_in_step``: the caller's message for a unit the step
    was not given.

    ``layer=True``: the entries are one layer's slices of a stacked unit (``js.scan``,
    ``nnx.scan``, ``nn.scan`` bodies).
    """
    raf = step.unit(meta, not_in_step).reshard_after_forward  # a unit of this step, or a clear error
    if step.pregathered:
        return list(entries)
    out = list(entries)
    together: dict[tuple, list[tuple[int, LeafComm, bool | int]]] = {}
    phased = phases_pay_off([math.prod(layout.padded_shape) * np.dtype(layout.dtype).itemsize for layout in meta.layouts
                             if layout is not None and layout.sharded and not layout.ignored], in_loop=layer)
    for i, layout in enumerate(meta.layouts):
        if layout is not None and not layout.ignored:
            comm = leaf_comm(layout, meta.axes, meta.policy, step, in_loop=layer, phased=phased, layer=layer)
            leaf_raf = False if _kept_vector(comm, step, layer) else raf
            if joins_unit_buffer(comm, raf):
                key = (comm.param_dtype, comm.reduce_dtype, comm.offloaded, comm.axes)  # one buffer: one collective
                together.setdefault(key, []).append((i, comm, leaf_raf))
            else:
                out[i] = gather_leaf(comm, entries[i], leaf_raf)
    for group in together.values():
        if len(group) == 1:  # nothing to share a collective with: no buffer to copy through
            (i, comm, leaf_raf), = group
            out[i] = gather_leaf(comm, entries[i], leaf_raf)
            continue
        idx = [i for i, _, _ in group]
        shards = tuple(checkpoint_name(entries[i], GATHER_START) for i in idx)
        gathered = gather_unit(tuple(c for _, c, _ in group), shards)
        for (i, _, leaf_raf), x in zip(group, gathered, strict=True):
            out[i] = checkpoint_name(x, FREE if leaf_raf else SAVED)
    return out


def _kept_vector(comm: LeafComm, step: StepState, layer: bool) -> bool:
    """Whether a gathered leaf stays gathered from a stacked layer's forward to its backward: a
    vector (a bias, a norm's scale) under jshard's own policy, whose loop checkpoints recompute the
    elementwise arithmetic that reads it ([Note: loop residuals] in ``remat.py``). Gathered on its
    own, it is gathered whole (no group copy); from a unit's flat buffer, its slice is kept."""
    return layer and step.remat_policy is REMAT_POLICY and len(comm.layout.shape) <= 1


def per_layer(step: StepState, fn: Callable[..., Any], checkpoint: Callable[..., Any] = jax.checkpoint) -> Any:
    """``fn``, one layer's gather and compute, as the step runs it: under ``checkpoint`` (the
    caller's lifted ``jax.checkpoint``: ``nnx.remat``, ``lift.checkpoint``) with the step's
    policy, so that the layer is re-gathered in its backward iteration rather than saved for
    every layer, and the user's activation policy reaches into the loop body ([Note: nested
    remat]); as it is where the step gathered every unit up front.
    """
    return fn if step.pregathered else checkpoint(fn, policy=loop_policy(step.remat_policy))


def unshard_unit(unit: FSDPUnit, step: StepState) -> Any:
    """The unit's tree with its own leaves gathered; sub-units stay units."""
    return unit.with_entries(gather_for_compute(unit.meta, unit.own_entries(), step))
