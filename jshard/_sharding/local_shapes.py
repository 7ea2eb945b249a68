"""A leaf's shapes inside a step, and the one rule that refuses reading a shard as the parameter.

[Note: shard reads] Inside the step a unit's leaves hold this device's shards until they are
gathered. A leaf read where the parameter is expected while it holds a shard (``unit["w"]`` in
the core, an NNX Param read outside its module's forward) is refused by one routine,
:func:`refuse_shard_read`, which decides and builds the error with the facts (the parameter's
shape, the shard's, the padded shape, the mesh axis and its size); each caller only words the
message. A shard is told apart by its shape against the leaf's layout, which travels with it
(the unit's meta, an NNX Param's metadata): this device's stored shard as the step sees it
([Note: step axes]), and one layer of it for a stack (``scan_axis=0``). A leaf whose shard
has its full shape (nothing to split) cannot be told apart and is not refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jshard._sharding.layout import LeafLayout
from jshard._sharding.mesh import MeshAxes
from jshard._sharding.step_axes import leaf_view
from jshard._sharding.step_state import StepState

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class LocalShapes:
    """A leaf's shapes as a step sees them: ``full``, the parameter's; ``shard``, this device's
    stored shard (``full`` where the leaf is not split); ``stacked``: a stack of layers on axis
    0 (``FullyShardPolicy(scan_axis=0)``), one layer of which has these shapes less axis 0.

    Example:
      >>> import jax.numpy as jnp, jshard as js
      >>> unit = js.fully_shard({"w": jnp.ones((4, 12, 3))}, policy=js.FullyShardPolicy(scan_axis=0))
      >>> shapes = local_shapes(unit.meta.layouts[0], unit.meta.axes, 0, unit.meta.axes)
      >>> shapes.shard, shapes.before_gather(holds_shards=True, layer=True), shapes.shard_reads
      ((4, 2, 3), (2, 3), ((2, 3), (4, 2, 3)))
    """

    full: Shape
    shard: Shape
    stacked: bool

    def before_gather(self, holds_shards: bool, layer: bool) -> Shape:
        """The shape the leaf holds in the step until it is gathered: its shard where the step
        holds shards (else the parameter, gathered up front), one layer's with ``layer``."""
        shape = self.shard if holds_shards else self.full
        return shape[1:] if layer else shape

    @property
    def shard_reads(self) -> tuple[Shape, ...]:
        """The shapes that are a shard, not the parameter: the stored shard's and, for a stack,
        one layer's, where they differ from the full ones."""
        pairs = [(self.shard, self.full)] + ([(self.shard[1:], self.full[1:])] if self.stacked else [])
        return tuple(sorted({shard for shard, full in pairs if shard != full}))


def local_shapes(layout: LeafLayout, axes: MeshAxes, scan_axis: int | None, step_axes: MeshAxes) -> LocalShapes:
    """The shapes of a leaf (``layout`` in a unit over ``axes``) in a step manual over
    ``step_axes``: a dim split over a model axis the step is manual over holds this device's
    block (an expert unit's local experts, [Note: step axes])."""
    view, view_axes = leaf_view(layout, axes, step_axes)
    shard = list(view.padded_shape)
    if view.dim is not None:
        shard[view.dim] //= view_axes.shard_size
    return LocalShapes(view.shape, tuple(shard), scan_axis == 0)


def refuse_shard_read(value: Any, layout: LeafLayout, axes: MeshAxes, scan_axis: int | None, step: StepState | None,
                      message: str, **names: Any) -> None:
    """Raise ``RuntimeError`` when ``value``, read where the parameter is expected, is the
    leaf's shard inside ``step`` ([Note: shard reads]). ``message`` words it, with the facts
    ``{shape}`` (the parameter's), ``{local}`` (the shard's), ``{padded}``, ``{axis}`` and ``{n}``
    (the mesh axis and its size), and the caller's ``names`` (the leaf's).

    Example:
      >>> import jax.numpy as jnp, jshard as js
      >>> unit = js.fully_shard({"w": jnp.ones((12, 3))})
      >>> refuse_shard_read(jnp.ones((2, 3)), unit.meta.layouts[0], unit.meta.axes, None, None,
      ...                   "{leaf}: never read outside a step", leaf="w")  # no step: nothing to refuse
    """
    if step is None or not step.holds_shards or not hasattr(value, "shape"):
        return
    local = tuple(value.shape)
    if local in local_shapes(layout, axes, scan_axis, step.axes).shard_reads:
        raise RuntimeError(message.format(shape=layout.shape, local=local, padded=layout.padded_shape,
                                          axis=axes.shard_entry, n=axes.shard_size, **names))
