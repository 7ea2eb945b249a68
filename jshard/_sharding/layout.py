"""Per-leaf layout: placement dim, padding and sharding (pure functions, no collectives).

[Note: layout] A sharded leaf is the original array padded with zeros at the end of its
placement dim ``d`` to ``N * c`` rows, ``c = ceil(shape[d] / N)``, split over the shard
axes: device ``i`` holds rows ``[i*c, (i+1)*c)`` (``torch.chunk`` plus FSDP2's padding).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jshard._sharding.mesh import MeshAxes
from jshard._sharding.model_axes import incoming_model_axes, spec_of
from jshard._sharding.policies import FullyShardPolicy


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Static facts of one leaf of a unit.

    ``dim`` is the placement dim in the stored array (``None``: replicated, for 0-d
    leaves, with ``scan_axis=0`` per-layer scalars, and leaves smaller than the policy's
    ``replicate_below``); ``padded`` its padded size.
    ``ignored`` leaves are stored untouched. ``model[d]``: the model axes that split dim
    ``d`` (``()`` for a leaf no model axis splits; see [Note: model axes]). ``layers``: for a
    stack laid out as pipeline stages (``js.stage_layers``), the model's layer count ``L``;
    ``shape[0]`` is then its ``S * K`` layer slots, the last ``S * K - L`` zero padding
    ([Note: pipeline stages]).
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    dim: int | None
    padded: int
    ignored: bool = False
    model: tuple[tuple[str, ...], ...] = ()
    layers: int | None = None

    @property
    def composed(self) -> bool:
        """Whether model axes split the placement dim too (FSDP outermost on it)."""
        return self.dim is not None and bool(self.model) and bool(self.model[self.dim])

    @property
    def sharded(self) -> bool:
        return self.dim is not None

    @property
    def padded_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.shape
        return self.shape[: self.dim] + (self.padded,) + self.shape[self.dim + 1 :]

    @property
    def unpadded_shape(self) -> tuple[int, ...]:
        """The model's shape: ``shape`` with a stage-split stack cut to its first ``layers`` slots."""
        return self.shape if self.layers is None else (self.layers,) + self.shape[1:]

    @property
    def padding(self) -> int:
        return 0 if self.dim is None else self.padded - self.shape[self.dim]


def _is_arraylike(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def _leaf_error(path: Any, leaf: Any, axes: MeshAxes, problem: str, fix: str) -> ValueError:
    shape = getattr(leaf, "shape", None)
    where = f"Leaf {jax.tree_util.keystr(path)}" + (f" of shape {tuple(shape)}" if shape is not None else "")
    return ValueError(
        f"{where}, sharded over mesh axis {axes.shard_entry!r} (size {axes.shard_size}): {problem}; {fix}."
    )


def default_dim(shape: tuple[int, ...], first: int, n: int, taken: frozenset[int] = frozenset()) -> int:
    """The default placement dim (``first``: 0, or 1 after a stacked layer axis).

    FSDP2's dim 0 (the first dim after the layer axis), unless more than half of the ``n``
    devices would hold only padding there (``shape[first] < n / 2``) while another dim is at
    least ``n``: then the largest such dim, the first of equal ones. A Flax conv kernel
    ``(3, 3, in, out)`` is so split on ``in`` or ``out``, not on its height (where 5/8 of every
    shard would be zeros on 8 devices); ``(7, 15)`` keeps FSDP2's dim 0. Dims in ``taken``
    (split by model axes) are passed over while another dim is free.

    Example:
      >>> from jshard._sharding.layout import default_dim
      >>> default_dim((3, 3, 64, 128), 0, 8), default_dim((7, 15), 0, 8), default_dim((4, 1, 1, 32), 1, 8)
      (3, 0, 3)
      >>> default_dim((64, 16), 0, 4, taken=frozenset({0}))  # a row-parallel weight split over "tp" on dim 0
      1
    """
    free = [d for d in range(first, len(shape)) if d not in taken] or list(range(first, len(shape)))
    if 2 * shape[free[0]] >= n:
        return free[0]
    wide = [d for d in free[1:] if shape[d] >= n]
    return max(wide, key=lambda d: (shape[d], -d)) if wide else free[0]


def leaf_layout(path: Any, leaf: Any, axes: MeshAxes, policy: FullyShardPolicy, mesh: Mesh | None = None) -> LeafLayout:
    """The layout of one leaf, or a ``ValueError`` naming the leaf and the fix.

    With ``mesh``, a leaf that arrives sharded over the mesh's model axes keeps that split
    ([Note: model axes]).
    """
    model = incoming_model_axes(leaf, mesh, axes) if mesh is not None else ()
    if policy.ignored_params is not None and policy.ignored_params(path, leaf):
        shape = tuple(getattr(leaf, "shape", ()))
        dtype = np.dtype(getattr(leaf, "dtype", np.float32))
        return LeafLayout(shape, dtype, None, 0, ignored=True, model=model)
    if not _is_arraylike(leaf):
        raise _leaf_error(
            path, leaf, axes, f"a {type(leaf).__name__} is not an array",
            "make it an array (jnp.asarray) or keep non-array values out of the tree",
        )
    shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
    stacked = policy.scan_axis is not None
    if stacked and len(shape) == 0:
        raise _leaf_error(
            path, leaf, axes, "a 0-d leaf has no stacked layer axis 0 (`scan_axis=0`)",
            "stack every leaf of the unit along axis 0, one slice per layer",
        )
    first = 1 if stacked else 0
    _check_model_split(path, leaf, axes, model)
    nothing_to_split = len(shape) <= first or 0 in shape  # 0-d, a per-layer scalar, or empty
    if nothing_to_split or (math.prod(shape[first:]) < policy.replicate_below and not any(model)):
        return LeafLayout(shape, dtype, None, 0, model=model)  # replicated: kept whole on every device
    dim = policy.shard_placement_fn(path, leaf) if policy.shard_placement_fn else None
    if dim is None:
        dim = default_dim(shape, first, axes.shard_size, frozenset(d for d, names in enumerate(model) if names))
    elif isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
        raise _leaf_error(path, leaf, axes, f"`shard_placement_fn` returned {dim!r}", "return an int dim or None")
    elif not -len(shape) <= dim < len(shape):
        raise _leaf_error(
            path, leaf, axes, f"placement dim {dim} is out of range for a {len(shape)}-d leaf",
            f"return a dim in [{-len(shape)}, {len(shape)}) from `shard_placement_fn`",
        )
    else:
        dim = int(dim) % len(shape)
        if stacked and dim == 0:
            raise _leaf_error(
                path, leaf, axes, "placement dim 0 is the stacked layer axis (`scan_axis=0`)",
                "shard another dim (1 or more)",
            )
    n = axes.shard_size * (axes.model_size(model[dim]) if model else 1)
    return LeafLayout(shape, dtype, dim, n * math.ceil(shape[dim] / n), model=model)


def _check_model_split(path: Any, leaf: Any, axes: MeshAxes, model: tuple) -> None:
    for d, names in enumerate(model):
        if names and leaf.shape[d] % axes.model_size(names):
            raise _leaf_error(
                path, leaf, axes, f"dim {d} (size {leaf.shape[d]}) arrives split over model axes {names} "
                f"(size {axes.model_size(names)}), which does not divide it",
                "split a dim the model axes divide (pad it), or leave this leaf unsplit over them",
            )


def partition_spec(layout: LeafLayout, axes: MeshAxes) -> PartitionSpec:
    """The spec of a stored leaf: its model axes, and the shard axes at the placement dim
    (outermost there: [Note: model axes])."""
    entries = list(layout.model) or [()] * len(layout.shape)
    if layout.dim is not None:
        entries[layout.dim] = axes.shard + entries[layout.dim]
    return spec_of(entries)


def manual_spec(layout: LeafLayout, axes: MeshAxes) -> PartitionSpec:
    """The stored leaf's spec over the data-parallel axes only: what the step's ``shard_map`` splits."""
    if layout.dim is None:
        return PartitionSpec()
    return PartitionSpec(*([None] * layout.dim), axes.shard_entry)


def memory_kind(layout: LeafLayout, policy: FullyShardPolicy) -> str | None:
    """Where a stored leaf lives: host memory under CPU offload for sharded leaves.

    Replicated (0-d) and ignored leaves stay on the device: they are tiny or not ours.
    """
    return policy.offload_policy.memory_kind if layout.sharded and not layout.ignored else None


def named_sharding(mesh: Mesh, layout: LeafLayout, axes: MeshAxes, policy: FullyShardPolicy):
    return NamedSharding(mesh, partition_spec(layout, axes), memory_kind=memory_kind(layout, policy))


def pad(x: jax.Array, layout: LeafLayout) -> jax.Array:
    """Zero-pad ``x`` at the end of its placement dim to the padded size."""
    if layout.padding == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[layout.dim] = (0, layout.padding)
    return jnp.pad(x, widths)


def unpad(x: jax.Array, layout: LeafLayout, dim: int | None = None) -> jax.Array:
    """Slice the padding off ``x`` (at ``dim``, default the layout's placement dim)."""
    if layout.padding == 0:
        return x
    dim = layout.dim if dim is None else dim
    return jax.lax.slice_in_dim(x, 0, layout.shape[layout.dim], axis=dim)


def unpad_layers(x: Any, layout: LeafLayout) -> Any:
    """``x`` (global view, ``layout.shape``) without a stage-split stack's padding layer slots."""
    return x if layout.layers is None else x[: layout.layers]


def pad_layers(x: Any, layout: LeafLayout) -> Any:
    """``x`` of ``layout.unpadded_shape`` zero-padded to the stack's layer slots (NumPy stays NumPy)."""
    return x if layout.layers is None else pad_layer_slots(x, layout.shape[0])


def pad_layer_slots(x: Any, slots: int) -> Any:
    """``x`` zero-padded on axis 0 to ``slots`` layers (NumPy stays NumPy)."""
    widths = [(0, slots - np.shape(x)[0])] + [(0, 0)] * (np.ndim(x) - 1)
    return np.pad(x, widths) if isinstance(x, np.ndarray) else jnp.pad(x, widths)
