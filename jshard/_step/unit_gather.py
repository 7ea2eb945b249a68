"""The gather path of a unit in the step: its leaves' collectives per leaf or per unit."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jshard._sharding.step_state import NOT_IN_STEP, StepState
from jshard._sharding.torus import phases_pay_off
from jshard._sharding.unit import FSDPUnit, UnitMeta
from jshard._step.gather import LeafComm, gather_leaf, layer_layout, leaf_comm
from jshard._step.remat import FREE, GATHER_START, SAVED
from jshard._step.unit_collectives import gather_unit, joins_unit_buffer


def gather_entries(meta: UnitMeta, entries: list[Any], step: StepState, *, layer: bool = False,
                   not_in_step: str = NOT_IN_STEP) -> list[Any]:
    """The one gather path: ``entries`` (a unit's own shards and sub-unit placeholders, in
    ``unit.own_entries()`` order; ``meta`` its meta) with every own, non-ignored leaf
    gathered for compute.

    ``layer=True``: the entries are one layer's slices of a stacked unit (``js.scan``,
    ``nnx.scan``, ``nn.scan`` bodies). Used by :func:`jshard.unshard` in the local view,
    :func:`jshard.scan` and the NNX and Linen adapters.
    """
    raf = step.unit(meta, not_in_step).reshard_after_forward  # a unit of this step, or a clear error
    if step.pregathered:
        return list(entries)
    out = list(entries)
    together: dict[tuple, list[tuple[int, LeafComm]]] = {}
    phased = phases_pay_off([math.prod(layout.padded_shape) * np.dtype(layout.dtype).itemsize for layout in meta.layouts
                             if layout is not None and layout.sharded and not layout.ignored], in_loop=layer)
    for i, layout in enumerate(meta.layouts):
        if layout is not None and not layout.ignored:
            comm = leaf_comm(layer_layout(layout) if layer else layout, meta.axes, meta.policy, step, in_loop=layer,
                             phased=phased)
            if joins_unit_buffer(comm, raf):
                together.setdefault((comm.param_dtype, comm.reduce_dtype, comm.offloaded), []).append((i, comm))
            else:
                out[i] = gather_leaf(comm, entries[i], raf)
    for group in together.values():
        if len(group) == 1:  # nothing to share a collective with: no buffer to copy through
            (i, comm), = group
            out[i] = gather_leaf(comm, entries[i], raf)
            continue
        idx = [i for i, _ in group]
        shards = tuple(checkpoint_name(entries[i], GATHER_START) for i in idx)
        gathered = gather_unit(tuple(c for _, c in group), shards)
        for i, x in zip(idx, gathered, strict=True):
            out[i] = checkpoint_name(x, FREE if raf else SAVED)
    return out


def unshard_unit(unit: FSDPUnit, step: StepState) -> Any:
    """The unit's tree with its own leaves gathered; sub-units stay units."""
    return unit.with_entries(gather_entries(unit.meta, unit.own_entries(), step))
