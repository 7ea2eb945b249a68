"""Leaves placed inside a trace (``jax.jit``, ``nnx.jit``, ``jax.eval_shape``): born sharded.

[Note: born sharded] ``fully_shard`` traced inside ``jit`` must give what the eager call
gives: the same padded layout, in the leaf's sharding, each device computing only its own
rows. Eagerly a nested ``jit(out_shardings=...)`` places the leaves; traced inside an
outer ``jit`` that nested call leaves the value's *type* unsharded (``float32[8,4]``, not
``float32[8@fsdp,4]``), so on a mesh of ``Explicit`` axes (``js.make_mesh``'s) everything
derived from the leaf in the same program (``jnp.zeros_like``, ``tx.init``, an NNX module)
is replicated. So a traced leaf is placed by what each axis type takes:
``with_sharding_constraint`` for ``Auto`` axes, ``jax.device_put`` for ``Explicit`` ones
(the split goes into the type, and the devices into the program) and for host offload.
XLA propagates the split back into the computation that makes the leaf, so a random
initialiser (JAX's partitionable threefry, ``jax.config.jax_threefry_partitionable``, on by
default) draws only the device's own rows, with the values of the unsharded draw. Two
routes cannot be split that way and raise: a leaf traced under ``jax.set_mesh`` with
``Explicit`` shard axes, whose type pins it whole on every device before ``fully_shard``
sees it, and a leaf traced inside ``shard_map`` over the shard axes (a per-device block);
and on a mesh whose model axes are ``Auto`` a traced leaf's tensor-parallel split is not in
its type, so it cannot be kept as eagerly: an error too (make those axes ``Explicit``).
On ``Explicit`` model axes the split must reach XLA the same way: a leaf computed with no
sharding and placed over them by ``jax.device_put`` (what the Linen route does with
partitioning metadata) is computed in ``1 / (N x M)`` blocks, since XLA propagates the final
placement back; a leaf whose *computing* op has an ``Explicit`` type that does not split it
over the shard axes (``out_sharding=``, ``jax.sharding.reshard``, an op on a value so typed)
is computed ``1 / M`` (or whole) per device, which placement cannot undo: an error. The
computing op is found by looking through ``device_put`` equations of the trace.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding

from jshard._sharding.model_axes import axes_of_type, only_axes


def is_traced(x: Any) -> bool:
    """Whether ``x`` is a value being traced (inside ``jit``, ``eval_shape``, ``nnx.jit``...)."""
    return isinstance(x, jax.core.Tracer)


def check_not_manual(path: Any, leaf: Any, shard_axes: tuple[str, ...], sizes: dict[str, int]) -> None:
    """Refuse a leaf traced where the shard axes are manual (inside ``shard_map``)."""
    if not is_traced(leaf):
        return
    context = jax.sharding.get_abstract_mesh()
    manual = [n for n in shard_axes
              if n in context.axis_names and context.axis_types[context.axis_names.index(n)] == AxisType.Manual]
    if manual:
        raise ValueError(
            f"Leaf {jax.tree_util.keystr(path)} of shape {tuple(leaf.shape)} is traced inside shard_map, manual "
            f"over mesh axis {manual[0]!r} (size {sizes[manual[0]]}): there each device holds its own block, "
            "which fully_shard cannot split again. Call fully_shard outside shard_map, e.g. inside "
            "jax.jit(lambda key: js.fully_shard(init(key), mesh))."
        )


def check_model_axes_visible(path: Any, leaf: Any, mesh: Any, model: tuple[tuple[str, int], ...]) -> None:
    """Refuse a traced leaf on a mesh with ``Auto`` model axes: its type cannot show a split over them.

    Eagerly a leaf placed over a model axis (tensor parallel) keeps that split; traced, only
    ``Explicit`` axes are in the value's type, so an ``Auto`` one would be dropped unnoticed.
    """
    if not is_traced(leaf):
        return
    auto = [(n, size) for n, size in model if n in axes_of_type(mesh, AxisType.Auto)]
    if auto:
        raise ValueError(
            f"Leaf {jax.tree_util.keystr(path)} of shape {tuple(leaf.shape)} is traced on a mesh whose model axis "
            f"{auto[0][0]!r} (size {auto[0][1]}) is Auto: a traced value's type does not say whether it is split "
            "over an Auto axis, so fully_shard cannot keep a tensor-parallel split there as the eager call does. "
            "Make the model axes Explicit (jax.make_mesh(..., axis_types=...)) to initialise under jit, or call "
            "fully_shard on concrete arrays."
        )


def check_computed_split(path: Any, leaf: Any, shard_axes: tuple[str, ...], sizes: dict[str, int]) -> None:
    """Refuse a leaf traced under a mesh context whose ``Explicit`` shard axes its type does not split.

    Under ``jax.set_mesh`` every op of the initialiser carries its type's sharding on the
    context's ``Explicit`` axes: a leaf made unsplit is computed whole on each device before
    ``fully_shard`` sees it, and placing it afterwards cannot undo that.
    """
    context = jax.sharding.get_abstract_mesh()
    if not is_traced(leaf) or not context.axis_names:
        return
    typed = jax.typeof(leaf).sharding
    split = {n for e in getattr(typed, "spec", ()) if e is not None for n in ((e,) if isinstance(e, str) else e)}
    pinned = [n for n in shard_axes if n in context.axis_names and n not in split
              and context.axis_types[context.axis_names.index(n)] == AxisType.Explicit]
    if pinned:
        raise ValueError(
            f"Leaf {jax.tree_util.keystr(path)} of shape {tuple(leaf.shape)} was computed whole on every device: "
            f"it was traced under `jax.set_mesh`, where mesh axis {pinned[0]!r} (size {sizes[pinned[0]]}) is "
            "Explicit and its type does not split it, so each device made all of its rows before fully_shard "
            "placed it. Trace the initialiser without the mesh context (call jax.jit(...) outside `with "
            "jax.set_mesh(...)`): XLA then computes only each device's rows; or make the leaf split over that "
            "axis where it is created (`out_sharding=` of jax.random / jnp, or Flax partitioning metadata naming it)."
        )


def _computing_type(leaf: Any) -> Any:
    """The type sharding of the op that computed ``leaf``, looking through ``jax.device_put`` placements,
    which XLA propagates back into that op; ``None`` for a value the trace did not compute (an argument).

    It reads the tracer's producing equation (``parent``, JAX's tracing internals); where that is
    missing, the leaf's own type stands for it, so a split is refused rather than missed.
    """
    x = leaf
    while True:
        eqn = getattr(x, "parent", type(x))  # a tracer without the attribute: its own type stands
        if eqn is None:
            return None
        if eqn is type(x) or getattr(eqn.primitive, "name", None) != "device_put":
            return jax.typeof(x).sharding
        x = eqn.in_tracers[[v is x.val for v in eqn.outvars].index(True)]


def check_computed_over_model_axes(path: Any, leaf: Any, shard_axes: tuple[str, ...], sizes: dict[str, int]) -> None:
    """Refuse a traced leaf computed with an ``Explicit`` type that does not split it over the shard axes.

    ``out_sharding=``, ``jax.sharding.reshard`` or any op on a value so typed puts that type
    on the computing op, which XLA keeps: each device computes its model-axis block (``1 / M``
    of the leaf), or all of it, and ``fully_shard``'s placement only slices it afterwards.
    """
    if not is_traced(leaf) or jax.sharding.get_abstract_mesh().axis_names:  # under set_mesh: check_computed_split
        return
    typed = _computing_type(leaf)
    mesh = getattr(typed, "mesh", None)
    explicit = set(axes_of_type(mesh, AxisType.Explicit)) if mesh is not None else set()
    split = {n for e in getattr(typed, "spec", ()) if e is not None for n in ((e,) if isinstance(e, str) else e)}
    if not explicit & set(shard_axes) or split & set(shard_axes):
        return
    model = sorted(split & explicit)
    m = math.prod(sizes[n] for n in model)
    block = f"1/{m}" if model else "all"
    over = f"split over model axis {model[0]!r} (size {sizes[model[0]]})" if model else "whole"
    raise ValueError(
        f"Leaf {jax.tree_util.keystr(path)} of shape {tuple(leaf.shape)} was computed {over}, not split over mesh "
        f"axis {shard_axes[0]!r} (size {sizes[shard_axes[0]]}): its type {typed.spec} comes from `out_sharding=`, "
        "`jax.sharding.reshard` or an op on a value typed so, which XLA keeps, so each device computed "
        f"{block} of it, not its 1/{m * math.prod(sizes[n] for n in shard_axes)} block. Create it without a "
        "sharding and, for a tensor-parallel split, place it with jax.device_put(x, NamedSharding(mesh, spec)) as "
        f"the last step before fully_shard (XLA then computes only each device's block), or create it split over "
        f"{shard_axes[0]!r} as well."
    )


def place_traced(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``x`` placed as ``sharding`` says, inside a trace ([Note: born sharded])."""
    mesh = sharding.mesh
    explicit = axes_of_type(mesh, AxisType.Explicit)
    auto = axes_of_type(mesh, AxisType.Auto)
    if auto:
        x = jax.lax.with_sharding_constraint(x, only_axes(sharding.with_memory_kind("device"), auto))
    if explicit:  # device_put, not reshard: it names the devices, so a jit of a key alone needs no mesh context
        x = jax.device_put(x, only_axes(sharding, explicit))
    elif sharding.memory_kind not in (None, "device"):
        x = jax.device_put(x, jax.memory.Space.Host)
    return x
