"""Feeding data: each process's local batch becomes one global batch for the step."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jshard._multiprocess.agreement import same_on_all_processes
from jshard._multiprocess.watchdog import note_batch
from jshard._sharding.mesh import MeshAxes, make_mesh, resolve_axes
from jshard._sharding.policies import DataParallelMeshDims

_FIX = (
    "Every process must pass a local batch with the same tree, shapes and dtypes (the global batch "
    "is their concatenation along dim 0): make each process's data loader yield equal-sized batches "
    "(drop or pad the last partial batch) with the same features."
)


def _local_blocks(sharding: NamedSharding, axes: MeshAxes) -> int:
    """How many distinct dim-0 blocks of the global batch this process's devices hold."""
    indices = sharding.addressable_devices_indices_map((axes.data_parallel_size,))
    return len({idx[0].start for idx in indices.values()})


def _check_leaf(path: Any, x: Any, blocks: int, axes: MeshAxes) -> None:
    where = f"Batch leaf {jax.tree_util.keystr(path)} of local shape {tuple(np.shape(x))}"
    if np.ndim(x) == 0:
        raise ValueError(f"{where}: a 0-d leaf has no batch dim 0 to split; give every leaf a leading batch dim.")
    if np.shape(x)[0] % blocks:
        raise ValueError(
            f"{where}: this process holds {blocks} slice(s) of the batch over the data-parallel mesh axes "
            f"{axes.data_parallel} (size {axes.data_parallel_size}), so the local dim 0 must be a multiple "
            f"of {blocks}; pad or drop examples to a multiple of {blocks}."
        )


def global_batch(local_batch: Any, mesh: Mesh | None = None, dp_mesh_dims: DataParallelMeshDims | None = None) -> Any:
    """Turn each process's local batch into the global batch, split along dim 0 over data-parallel axes.

    The global batch is the processes' local batches concatenated along dim 0 (in the
    order of their devices on the mesh), sharded over the data-parallel axes (replicate
    and shard axes) exactly as :func:`jshard.value_and_grad` splits it, so the step
    moves no data. With several processes, the local shapes are first compared across
    processes (one small exchange through JAX's coordination service).

    Args:
      local_batch: a pytree of host arrays (numpy or jax), this process's examples on dim 0.
      mesh: the mesh of the step (default: :func:`jshard.make_mesh`).
      dp_mesh_dims: which axes are data-parallel, as in the policy (default: inferred).

    Returns:
      The pytree of global ``jax.Array`` s.

    Raises:
      ValueError: a 0-d leaf, a local dim 0 this process's devices do not divide, or
        processes that disagree on the tree, shapes or dtypes (naming the leaf and the
        shape on each process).

    Example:
      >>> import numpy as np
      >>> from jshard.batch import global_batch
      >>> batch = global_batch({"x": np.ones((16, 3), np.float32)})
      >>> batch["x"].shape, batch["x"].addressable_shards[0].data.shape  # 8 devices: 2 rows each
      ((16, 3), (2, 3))
    """
    mesh = make_mesh() if mesh is None else mesh
    axes = resolve_axes(mesh, dp_mesh_dims)
    sharding = NamedSharding(mesh, PartitionSpec(axes.data_parallel))
    leaves, treedef = jax.tree.flatten_with_path(local_batch)
    shapes = {jax.tree_util.keystr(p): f"shape {tuple(np.shape(x))} {np.result_type(x)}" for p, x in leaves}
    note_batch()  # the step watchdog: this process has its data for the step
    same_on_all_processes("global_batch", {"tree": {"structure": str(treedef)}, "batch leaf": shapes}, _FIX)
    blocks = _local_blocks(sharding, axes)
    for path, x in leaves:
        _check_leaf(path, x, blocks, axes)
    return jax.make_array_from_process_local_data(sharding, local_batch)
