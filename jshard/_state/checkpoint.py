"""Orbax checkpoints of sharded train states that restore onto any mesh.

[Note: checkpoint format] A checkpoint step holds two Orbax items. ``state`` is the train
state as a nested dict (unit nodes removed, keys from the user's own tree: dict keys,
sequence indices, NamedTuple fields) of the stored arrays: each device writes its own
rows, nothing is gathered. ``layouts`` (JSON) records every leaf's original shape and
dtype and the placement dim it was padded along. Padding rows are zeros at the end of
that dim, so a leaf restores onto any other layout by Orbax's own pad-or-truncate
(``ArrayRestoreArgs(global_shape=..., strict=False)``): each device reads just its rows
of the target layout straight from storage; rows past the saved ones read as zeros, and
saved rows past the target are padding. A plain Orbax reader gets the same values with
``global_shape`` set to the original shape from ``layouts``. Orbax writes each step to
a temporary directory and renames it when complete, so a save that dies half-way
leaves the steps before it intact.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jshard._multiprocess.preemption import reached_preemption
from jshard._sharding.nested import KeyCollision, get_in, nest
from jshard._state.stored_leaves import StoredLeaf, as_like, stored_leaves

_FORMAT = "jshard-checkpoint-1"


def _nest(items: list[tuple[tuple[str, ...], Any]]) -> dict:
    try:
        return nest(items)
    except KeyCollision as e:
        raise ValueError(f"Checkpoint keys collide at {'/'.join(e.path)}: rename one of the colliding keys.") from None


def _describe(record: StoredLeaf) -> dict:
    layout = record.layout
    if layout is not None:
        dtype = np.dtype(layout.dtype)
    else:
        dtype = np.dtype(record.leaf.dtype if hasattr(record.leaf, "dtype") else np.asarray(record.leaf).dtype)
    return {"shape": list(record.shape), "dtype": dtype.name, "dim": None if layout is None else layout.dim}


def _saved_leaf(record: StoredLeaf) -> Any:
    return np.asarray(record.leaf) if isinstance(record.leaf, int | float | bool | np.generic) else record.leaf


def leaf_restore_args(record: StoredLeaf, dtype: Any = None) -> ocp.RestoreArgs:
    """How Orbax reads one leaf straight into ``record``'s layout (padded by pad-or-truncate), cast to ``dtype``."""
    leaf, layout, sharding = record.leaf, record.layout, record.sharding
    if sharding is None:
        return ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype)
    shape = layout.padded_shape if layout is not None else tuple(leaf.shape)
    return ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, strict=False, dtype=dtype)


def _check(saved: dict, wanted: list[StoredLeaf]) -> None:
    names = {"/".join(r.keys): r for r in wanted}
    missing = sorted(set(names) - set(saved))
    extra = sorted(set(saved) - set(names))
    if missing or extra:
        raise ValueError(
            f"The checkpoint does not hold the leaves of `like`: missing {missing[:5]}, unexpected {extra[:5]}; "
            "restore into a `like` of the same structure as the saved state."
        )
    for key, record in names.items():
        want = _describe(record)
        got = saved[key]
        if (got["shape"], got["dtype"]) != (want["shape"], want["dtype"]):
            raise ValueError(
                f"Leaf {record.name}: the checkpoint holds shape {tuple(got['shape'])} and dtype {got['dtype']}, but "
                f"`like` has shape {tuple(want['shape'])} and dtype {want['dtype']}; restore into a `like` built from "
                "the same model and optimizer (any mesh)."
            )


class CheckpointManager:
    """Save sharded train states with Orbax and restore them onto any mesh.

    A thin layer over ``orbax.checkpoint.CheckpointManager`` (one directory per step):
    ``save`` writes each device's own shards (no gather), with each leaf's original
    shape; ``restore`` reads straight into the layouts of ``like``, which may live on
    another mesh (other device count, FSDP or HSDP, other placement dims). A save that
    dies half-way leaves the earlier steps restorable.

    Args:
      directory: where the steps go (created if missing).
      max_to_keep: keep only this many most recent steps (``None``: all).
      async_save: ``save`` returns once the arrays are copied off the devices and
        writes in the background; call :meth:`wait_until_finished` before reading.

    Example:
      >>> import tempfile, jax.numpy as jnp, jshard as js
      >>> from jshard.checkpoint import CheckpointManager
      >>> state = {"params": js.fully_shard({"w": jnp.arange(10.0)}), "step": 3}
      >>> with CheckpointManager(tempfile.mkdtemp()) as ckpt:
      ...     ckpt.save(3, state)
      ...     like = {"params": js.fully_shard({"w": jnp.zeros(10)}, js.make_mesh(replicate=2)), "step": 0}
      ...     restored = ckpt.restore(like)
      >>> restored["params"]["w"].shape, float(restored["params"]["w"].sum()), int(restored["step"])
      ((12,), 45.0, 3)
    """

    def __init__(self, directory: Any, *, max_to_keep: int | None = None, async_save: bool = False):
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(directory, options=options)

    def save(self, step: int, state: Any) -> None:
        """Save ``state`` (any tree of units, arrays and scalars) as ``step``."""
        recs = stored_leaves(state)
        arrays = _nest([(r.keys, _saved_leaf(r)) for r in recs])
        layouts = {"format": _FORMAT, "leaves": {"/".join(r.keys): _describe(r) for r in recs}}
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(arrays),
                                                          layouts=ocp.args.JsonSave(layouts)))

    def restore(self, like: Any, step: int | None = None) -> Any:
        """Restore a step (default: the latest) into the units, layouts and shardings of ``like``.

        Args:
          like: a tree like the saved state, on the target mesh: concrete, or abstract
            (``fully_shard`` of ``jax.ShapeDtypeStruct`` leaves, ``jax.eval_shape`` of
            an optimizer's ``init``).
          step: the step to restore; ``None`` for the latest.

        Returns:
          A tree like ``like`` with the saved values: padded with zeros, sharded.

        Raises:
          FileNotFoundError: no finished step in the directory, or not this step.
          ValueError: ``like`` has other leaves, shapes or dtypes than the checkpoint.
        """
        self._manager.wait_until_finished()
        step = self._manager.latest_step() if step is None else step
        if step is None or step not in self._manager.all_steps():
            raise FileNotFoundError(
                f"No finished checkpoint step {'' if step is None else step} in {self._manager.directory} "
                f"(steps: {list(self._manager.all_steps())}); save one first or pass an existing step."
            )
        saved = self._manager.restore(step, args=ocp.args.Composite(layouts=ocp.args.JsonRestore()))["layouts"]
        recs = stored_leaves(like)
        _check(saved["leaves"], recs)
        restore_args = _nest([(r.keys, leaf_restore_args(r)) for r in recs])
        out = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(restore_args=restore_args)))["state"]
        leaves = [as_like(r.leaf, get_in(out, r.keys)) for r in recs]
        return jax.tree.unflatten(jax.tree.structure(like), leaves)

    def reached_preemption(self, step: int) -> bool:
        """Whether to save and stop at ``step``: true on every process at the same step once any
        process (or the launcher) got SIGTERM ([Note: preemption]; Orbax's method of this name).

        The loop saves ``step``, waits, and exits with ``jshard.launch.PREEMPTED_EXIT``::

            if ckpt.reached_preemption(step):
                ckpt.save(step, state)
                ckpt.wait_until_finished()
                sys.exit(PREEMPTED_EXIT)
        """
        return reached_preemption(step)

    def latest_step(self) -> int | None:
        """The newest finished step (``None`` when there is none)."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every finished step, oldest first."""
        return sorted(self._manager.all_steps())

    def wait_until_finished(self) -> None:
        """Block until an asynchronous save has finished writing."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release the manager."""
        self._manager.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
