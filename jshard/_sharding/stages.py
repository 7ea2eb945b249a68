"""A stack of ``L`` layers laid out as ``S`` pipeline stages of ``K = ceil(L / S)`` layers each.

[Note: pipeline stages] Stage ``s`` holds layers ``[s * K, (s + 1) * K)`` of the stack,
which is zero-padded at its end to ``S * K`` layers and split over the ``stage`` mesh axis
on its layer axis 0; ``js.fully_shard`` then keeps that split as a model axis of the unit
and adds the FSDP split over the stage's data-parallel axes on another dim. The padding
layers are identities in :func:`jshard.pipeline` (masked by their index, ``>= L``), so their
gradient is exactly zero and, under Optax's usual transforms, they stay zero. Their cost:
the last stage runs ``S * K - L`` masked layers per microbatch, and every stage's schedule
step takes ``K`` layers, so the step's layer compute is ``S * K / L`` of an even split.
``L`` travels with the data: ``stage_layers`` returns a :class:`StagedLayers` holding it,
``js.fully_shard`` records it in each leaf's ``LeafLayout.layers``, and from there
``js.pipeline`` reads it and the global view (``js.unshard``, ``js.reshard``, state dicts,
checkpoints) shows only the ``L`` layers, so a stack restores onto any stage count.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jshard._sharding.layout import pad_layer_slots


@jax.tree_util.register_pytree_node_class
class StagedLayers:
    """A stack laid out as pipeline stages by :func:`stage_layers`: the padded tree and its layer count.

    A pytree node (``jax.tree.map`` reaches the stored leaves); index it like the tree.
    ``tree``: every leaf ``(S * K, ...)``; ``layers``: the model's ``L``.
    """

    __slots__ = ("tree", "layers")

    def __init__(self, tree: Any, layers: int):
        self.tree, self.layers = tree, layers

    def __getitem__(self, key: Any) -> Any:
        return self.tree[key]

    def tree_flatten(self) -> tuple[tuple[Any], int]:
        return (self.tree,), self.layers

    @classmethod
    def tree_unflatten(cls, layers: int, children: tuple[Any]) -> StagedLayers:
        return cls(children[0], layers)


def stage_size(layers: int, stages: int) -> int:
    """``K``, the layers each stage holds: ``ceil(layers / stages)``.

    Example:
      >>> from jshard._sharding.stages import stage_size
      >>> stage_size(5, 2), stage_size(7, 4), stage_size(8, 4)
      (3, 2, 2)
    """
    return math.ceil(layers / stages)


def _layer_count(stack: Any, axis: str, stages: int) -> int:
    counts = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(stack)[0]:
        if getattr(leaf, "ndim", 0) == 0:
            raise ValueError(
                f"Leaf {jax.tree_util.keystr(path)} of shape {tuple(getattr(leaf, 'shape', ()))} has no layer "
                f"axis 0 to split over mesh axis {axis!r} (size {stages}); stack every leaf along axis 0, "
                "one slice per layer."
            )
        counts.add(leaf.shape[0])
    if len(counts) != 1:
        raise ValueError(f"The stack's leaves have different layer counts on axis 0: {sorted(counts)}; "
                         "stack every leaf along axis 0, one slice per layer.")
    return counts.pop()


def _stage_sharding(leaf: Any, mesh: Mesh, axis: str) -> NamedSharding:
    """``axis`` on the layer dim, and the split of the other dims the leaf arrives with on ``mesh``
    (a tensor-parallel split over ``"tp"`` is kept)."""
    incoming = getattr(leaf, "sharding", None)
    rest = ()
    if isinstance(incoming, NamedSharding) and dict(incoming.mesh.shape) == dict(mesh.shape):
        rest = tuple(incoming.spec)[1:]
    return NamedSharding(mesh, PartitionSpec(axis, *rest))


def stage_layers(stack: Any, mesh: Mesh, axis: str = "stage") -> StagedLayers:
    """A stack of ``L`` layers (every leaf ``(L, ...)``) laid out as the mesh's pipeline stages.

    Each leaf is zero-padded on axis 0 to ``S * ceil(L / S)`` layers (``S`` the size of
    ``axis``) and placed split over ``axis`` on that dim (keeping the split of its other dims
    it arrives with on ``mesh``, e.g. over ``"tp"``), ready for ``js.fully_shard(...,
    policy=js.FullyShardPolicy(scan_axis=0, dp_mesh_dims=...))`` over the stage's
    data-parallel axes ([Note: pipeline stages]), which records ``L`` in the unit: ``js.unshard``
    of the unit gives the ``L`` layers back.

    Args:
      stack: a pytree of arrays (or ``jax.ShapeDtypeStruct`` for planning) stacked along axis 0,
        one slice per layer.
      mesh: the mesh with the ``axis`` of stages.
      axis: the stage axis.

    Returns:
      A ``StagedLayers``: the tree with every leaf ``(S * K, ...)``, placed
      ``NamedSharding(mesh, P(axis, ...))``, and ``L``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, jshard as js
      >>> mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(2, 4), ("stage", "fsdp"))
      >>> staged = js.stage_layers({"w": jnp.ones((5, 3, 3))}, mesh)
      >>> staged["w"].shape, staged["w"].sharding.spec, float(staged["w"][5].sum()), staged.layers
      ((6, 3, 3), P('stage',), 0.0, 5)
    """
    if axis not in mesh.shape:
        raise ValueError(f"The mesh {dict(mesh.shape)} has no axis {axis!r} for pipeline stages; "
                         f"build it with one, e.g. Mesh(devices.reshape(S, F), ({axis!r}, 'fsdp')).")
    stages = mesh.shape[axis]
    layers = _layer_count(stack, axis, stages)
    padded = stages * stage_size(layers, stages)

    def place(x):
        sharding = _stage_sharding(x, mesh, axis)
        if isinstance(x, jax.ShapeDtypeStruct):  # planning: the abstract stack, placed the same way
            return jax.ShapeDtypeStruct((padded,) + x.shape[1:], x.dtype, sharding=sharding)
        x = pad_layer_slots(jnp.asarray(x), padded)
        return jax.device_put(x, sharding)

    return StagedLayers(jax.tree.map(place, stack), layers)
