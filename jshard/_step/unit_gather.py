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

[Note: stacks cast before the loop] On TPU a loop over a stacked unit (``js.scan``, ``nnx.scan``,
``nn.scan``) takes each sharded floating leaf in its compute dtype where its gradient is reduced
in that dtype too (``MixedPrecisionPolicy(param_dtype=bfloat16)``, whose ``reduce_dtype``
follows): the step casts the shard stack once, before its loss runs (:func:`cast_stacks_for_loops`,
the one place for all three loops), each iteration gathers its slice as it is,
and its backward returns the reduced gradient in that dtype (``LeafComm.shard_dtype``), so the
loop stacks the layers' gradients in bfloat16 and the cast to the leaf's float32 comes after
the loop, where XLA fuses it into what reads the gradients (the optimizer's update). The values
are bit for bit those of a cast in each iteration. Cast in the loop, the gradient stack is
float32 and lives beside the float32 parameters until the update, while XLA:TPU holds a bfloat16
copy of the stack anyway (it hoists the cast out of the loop for the default-precision
matmuls): a training step (gradients applied by SGD) of eight stacked 1536-wide tanh layers
recomputed in bfloat16 on v5p 2x2x2 peaked at 45.08 MiB against the plain GSPMD recipe's 36.10,
which casts its parameters before its loop; cast before, 35.98 (docs/benchmarks.md, "A training
step"); the same model written with ``nnx.vmap`` and ``nnx.scan`` (or ``nn.scan``) compiled to
the same 45.08 MiB while only ``js.scan`` cast its stacks. XLA:CPU casts in each iteration, so
there the stack cast before the loop is a copy more (that step 39.58 -> 44.08 MiB): other
platforms keep the cast in the loop
(:func:`_compiler_holds_cast_stacks`). Host-offloaded shards (the cast would bring the stack to
the device whole), custom all-gathers (they quantize the shard from its own dtype),
``reduce_dtype=float32`` and stacks laid out as pipeline stages (``js.pipeline`` slices a
stage's layers itself) keep it in the loop too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jshard._sharding.dtypes import is_floating
from jshard._sharding.layout import LeafLayout, memory_kind
from jshard._sharding.mesh import MeshAxes
from jshard._sharding.step_state import NOT_IN_STEP, StepState
from jshard._sharding.torus import phases_pay_off
from jshard._sharding.unit import FSDPUnit, UnitMeta, map_unit_leaves
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
            comm = leaf_comm(layout, meta.axes, meta.policy, step, in_loop=layer, phased=phased, layer=layer,
                             shard_dtype=getattr(entries[i], "dtype", None))
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


def cast_stacks_for_loops(params: Any, step: StepState) -> Any:
    """``params`` (the step's local view of its units) as the loops over stacked units take them:
    each leaf of a stacked unit that has a :func:`_loop_dtype` cast to it, the rest as they are
    ([Note: stacks cast before the loop]). The step hands its loss these, so ``js.scan``,
    ``nnx.scan`` and ``nn.scan`` all loop over the cast stacks."""
    if step.pregathered:
        return params

    def cast(meta: UnitMeta | None, layout: LeafLayout | None, x: Any) -> Any:
        dtype = None if meta is None else _loop_dtype(meta, layout)
        return x if dtype is None else x.astype(dtype)

    return map_unit_leaves(cast, params)


def _compiler_holds_cast_stacks(axes: MeshAxes) -> bool:
    """Whether the step's compiler holds a stack's cast copy through its loop anyway: XLA:TPU
    hoists the cast of a stack read by default-precision matmuls out of the loop; XLA:CPU casts
    in each iteration, where a stack cast before the loop costs its size ([Note: stacks cast
    before the loop])."""
    return axes.tpu_mesh is not None


def _loop_dtype(meta: UnitMeta, layout: LeafLayout) -> np.dtype | None:
    """The dtype a leaf enters the loop over its stack in, where it is cast before the loop: its
    compute dtype, for a sharded floating leaf of a stacked unit on a compiler that holds the cast
    stack anyway, when that dtype differs from its own and its gradient is reduced in it (``None``
    otherwise). Stacks laid out as pipeline stages (their layer axis split) slice their layers
    themselves and keep the cast in the loop."""
    policy = meta.policy
    if (policy.scan_axis != 0 or (layout.model and layout.model[0]) or layout.ignored or not layout.sharded
            or not is_floating(layout.dtype) or not _compiler_holds_cast_stacks(meta.axes)):
        return None
    mp = policy.mp_policy
    compute = mp.compute_dtype(layout.dtype)
    casts = (compute != layout.dtype and mp.gradient_dtype(layout.dtype) == compute
             and memory_kind(layout, policy) is None and policy.custom_all_gather is None)
    return compute if casts else None


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
