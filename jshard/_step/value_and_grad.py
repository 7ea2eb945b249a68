"""``value_and_grad``: the FSDP step as one ``shard_map`` over the data-parallel mesh."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jshard._sharding.dtypes import is_floating
from jshard._sharding.layout import memory_kind, named_sharding
from jshard._sharding.mesh import MeshAxes
from jshard._sharding.model_axes import axes_of_type, only_axes
from jshard._sharding.step_axes import batch_axes, check_leaf, leaf_view, step_spec
from jshard._sharding.step_state import IdentityMap, StepState, UnitStep, stepping
from jshard._sharding.unit import FSDPUnit, all_units, is_unit, map_unit_leaves, one_mesh
from jshard._step import collectives as C
from jshard._step.gather import gather_leaf, leaf_comm, reduce_gradient
from jshard._step.model_manual import manual_over_model_axes, model_manual
from jshard._step.offload import to_device, to_host
from jshard._step.remat import REMAT_POLICY
from jshard._step.remat import remat_policy as remat_policy_of
from jshard._step.residual_rounding import without_residual_rounding
from jshard._step.segments import segmented
from jshard._step.unit_gather import cast_stacks_for_loops, unshard_unit


def _check_units(sharded: Any) -> tuple[list[tuple[FSDPUnit, bool]], MeshAxes]:
    units = all_units(sharded)
    if not units:
        raise ValueError(
            "The grad function got no FSDPUnit in `sharded`: pass the output of js.fully_shard."
        )
    mesh = one_mesh(units, "Units of one step")
    axes = batch_axes(mesh, [unit.meta.axes for unit, _ in units])
    paths = iter(jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(sharded)[0])

    def check(meta, layout, x):
        path = next(paths)
        if layout is None:
            raise ValueError(
                f"Leaf {path} of shape {getattr(x, 'shape', None)} in `sharded` belongs to no unit: "
                "apply js.fully_shard to the root of the parameters (it keeps existing units)."
            )
        check_leaf(path, layout, meta.axes, axes)

    map_unit_leaves(check, sharded)
    return units, axes


def _unit_steps(units: list[tuple[FSDPUnit, bool]]) -> IdentityMap[Any, UnitStep]:
    """How each unit takes part in the step, by the identity of its meta ([Note: step state])."""
    steps: IdentityMap[Any, UnitStep] = IdentityMap()
    for unit, root in units:
        steps.setdefault(unit.meta, UnitStep(unit.meta.policy.resolved_reshard_after_forward(root), root))
    return steps


def _batch_specs(batch: Any, axes: MeshAxes, microbatches: int) -> Any:
    needed = axes.data_parallel_size * microbatches

    def spec(path, x):
        n = x.shape[0] if getattr(x, "ndim", 0) else None
        if n is None or n % needed:
            raise ValueError(
                f"{f'Batch leaf {jax.tree_util.keystr(path)}' if path else 'The batch'} of shape "
                f"{tuple(getattr(x, 'shape', ()))}: "
                f"dim 0 is split over the data-parallel mesh axes {axes.data_parallel} (size "
                f"{axes.data_parallel_size}) into {microbatches} microbatch(es), so it must be a "
                f"multiple of {needed}; pad or drop examples to a multiple of {needed}."
            )
        return PartitionSpec(axes.data_parallel)

    return jax.tree_util.tree_map_with_path(spec, batch)


def _param_specs(sharded: Any, axes: MeshAxes) -> Any:
    return map_unit_leaves(lambda meta, layout, x: step_spec(layout, meta.axes, axes), sharded)


def _param_shardings(sharded: Any) -> Any:
    return map_unit_leaves(lambda meta, layout, x: named_sharding(meta.mesh, layout, meta.axes, meta.policy), sharded)


def _trainable(layout) -> bool:
    return not layout.ignored and is_floating(layout.dtype)


def _zeros_like(meta, layout, p) -> jax.Array:
    return to_host(jnp.zeros(p.shape, p.dtype), memory_kind(layout, meta.policy) is not None)


def _zero_untrainable(params: Any, grads: Any) -> Any:
    def fix(meta, layout, p, g):
        return g if _trainable(layout) else _zeros_like(meta, layout, p)

    return map_unit_leaves(fix, params, grads)


def _reduce_aux(aux: Any, axes: tuple[str, ...]) -> Any:
    def reduce(x):
        x = jnp.asarray(x)
        return jax.lax.pmean(x, axes) if jnp.issubdtype(x.dtype, jnp.inexact) else jax.lax.psum(x, axes)

    return jax.tree.map(reduce, aux)


def _over_devices(axes: MeshAxes, loss: Any, aux: Any) -> tuple[Any, Any]:
    """The loss averaged over the data-parallel devices; floating aux averaged, the rest summed
    (on a mesh with model axes, in a region manual over them too: see ``model_manual.py``)."""

    def reduce(values):
        loss, aux = values
        return jax.lax.pmean(loss, axes.data_parallel), _reduce_aux(aux, axes.data_parallel)

    return manual_over_model_axes(reduce, axes)((loss, aux)) if axes.model else reduce((loss, aux))


def _unshard_all(params: Any, step: StepState) -> Any:
    """Gather every unit (recursively) into full parameters."""

    def full(x):
        if not is_unit(x):
            return x
        return jax.tree.map(full, unshard_unit(x, step), is_leaf=is_unit)

    return jax.tree.map(full, params, is_leaf=is_unit)


def _gather_for_deferred_sync(params: Any, step: StepState) -> Any:
    """Every unit with full, cast leaves (the step reduces their gradients at the end)."""

    def gather(meta, layout, x):
        if layout.ignored:
            return x
        return gather_leaf(leaf_comm(layout, meta.axes, meta.policy, step), x, False)

    return map_unit_leaves(gather, params)


def _reduce_deferred(params: Any, full_grads: Any, step: StepState) -> Any:
    def reduce(meta, layout, p, g):
        if not _trainable(layout):
            return _zeros_like(meta, layout, p)
        return reduce_gradient(leaf_comm(layout, meta.axes, meta.policy, step), g)

    return map_unit_leaves(reduce, params, full_grads)


def value_and_grad(
    loss_fn: Callable[..., Any],
    *,
    has_aux: bool = False,
    unshard_params: bool = True,
    microbatches: int = 1,
    requires_gradient_sync: bool = True,
    requires_all_reduce: bool = True,
    remat_policy: Callable[..., Any] | None = None,
    backward_prefetch: bool = True,
) -> Callable[..., Any]:
    """The FSDP training step's loss and gradient, computed in the local view.

    ``loss_fn(params, batch, *args)`` returns the mean loss over the batch it sees (and
    aux when ``has_aux``). The returned ``grad_fn(sharded, batch, *args)`` runs it in a
    ``shard_map`` over the units' mesh, with ``batch`` split along dim 0 over every
    data-parallel device (of every unit: units may shard over different axes of the mesh,
    see docs/parallelism.md "Experts on their own axes"), and returns ``(loss or (loss, aux), grads)``: the mean loss
    over the global batch and its gradient, with exactly the layout of ``sharded``
    (padding rows zero), ready for ``optax``. Floating aux leaves are averaged over
    devices and microbatches, others summed. Ignored and integer leaves get zeros.

    Args:
      loss_fn: the loss on one device's batch.
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      unshard_params: ``True``: ``loss_fn`` gets full parameters (every unit gathered
        at the start). ``False``: it gets units and calls :func:`jshard.unshard` (or
        :func:`jshard.scan`) right before it needs each one.
      microbatches: split each device's batch into this many microbatches, accumulated
        in a ``lax.scan`` (gradient accumulation inside one step).
      requires_gradient_sync: ``True``: reduce-scatter per microbatch; ``False``:
        gather once, accumulate full local gradients, reduce once per step (FSDP2's
        ``set_requires_gradient_sync(False)``; holds every unit gathered).
      requires_all_reduce: ``False``: with HSDP, all-reduce over replicate axes once
        per step instead of per microbatch (FSDP2's ``set_requires_all_reduce``).
      remat_policy: a ``jax.checkpoint`` policy for activations, combined with
        jshard's (e.g. ``jax.checkpoint_policies.nothing_saveable`` recomputes each
        layer of a ``js.scan`` in its backward iteration). Pass it here: a
        ``jax.checkpoint`` inside ``loss_fn`` is overridden by the step's own (JAX applies
        the outermost checkpoint's policy to everything inside it).
      backward_prefetch: ``True``: in backward, an unrolled unit is re-gathered while the
        unit after it computes its backward, so the gather can overlap that compute
        (FSDP's prefetch). ``False``: only once that unit's backward is done and its
        gradients reduced: backward holds no prefetched unit beside a full gradient, and
        nothing overlaps the re-gather (FSDP1's ``BACKWARD_POST``; docs/benchmarks.md
        measures both on XLA:TPU). A ``js.scan`` stack's layers are XLA's loop either way.

    Returns:
      ``grad_fn(sharded, batch, *args)``; it works under ``jax.jit``.

    Example:
      >>> import jax, jax.numpy as jnp, jshard as js
      >>> params = js.fully_shard({"w": jnp.ones((3, 5))})
      >>> def loss_fn(p, batch):
      ...     return jnp.mean((batch["x"] @ p["w"]) ** 2)
      >>> loss, grads = jax.jit(js.value_and_grad(loss_fn))(params, {"x": jnp.ones((16, 3))})
      >>> float(loss), grads["w"].shape
      (9.0, (8, 5))
    """
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"`microbatches` must be a positive int, got {microbatches!r}.")
    if not isinstance(backward_prefetch, bool):
        raise ValueError(f"`backward_prefetch` must be a bool, got {backward_prefetch!r}.")

    def grad_fn(sharded: Any, batch: Any, *args: Any):
        units, axes = _check_units(sharded)
        root_policy = units[0][0].meta.policy
        step = StepState(
            axes=axes,
            remat_policy=remat_policy_of(remat_policy),
            units=_unit_steps(units),
            skip_all_reduce=not requires_all_reduce and requires_gradient_sync,
            pregathered=not requires_gradient_sync,
        )
        body = functools.partial(
            _local_step, loss_fn, step, root_policy.mp_policy, has_aux, unshard_params, microbatches, backward_prefetch
        )
        mesh = units[0][0].meta.mesh
        param_specs = _param_specs(sharded, axes)
        in_specs = (param_specs, _batch_specs(batch, axes, microbatches), (PartitionSpec(),) * len(args))
        out_specs = ((PartitionSpec(), PartitionSpec()) if has_aux else PartitionSpec(), param_specs)
        manual = {"axis_names": set(axes.data_parallel)} if axes.model else {}  # model axes: GSPMD's or explicit
        fn = jax.shard_map(
            lambda p, b, a: body(p, b, *a), mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False, **manual
        )
        shardings = (_param_shardings(sharded), *_named(mesh, in_specs[1:]))
        out, grads = fn(*jax.device_put((sharded, batch, args), shardings))
        if axes.model:  # the shard_map's out_specs name the data-parallel axes only: place the model axes too
            grads = jax.tree.map(_place_model_axes, grads, shardings[0])
        return out, grads

    return grad_fn


def _place_model_axes(g: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``g`` placed over the Auto axes as ``sharding`` says (Explicit ones are in its type already)."""
    return jax.lax.with_sharding_constraint(g, only_axes(sharding, axes_of_type(sharding.mesh, AxisType.Auto)))


def _named(mesh, specs: Any) -> Any:
    """Shardings for the step's data arguments (placing them is needed for Explicit axes)."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def _split_microbatches(batch: Any, m: int) -> Any:
    return jax.tree.map(lambda x: x.reshape((m, x.shape[0] // m) + x.shape[1:]), batch)


def _local_step(loss_fn, step, mp, has_aux, unshard_params, microbatches, backward_prefetch, params, batch, *args):
    with stepping(step):
        batch = mp.cast_inputs(batch)

        def loss_of(p, mb):
            out = loss_fn(_unshard_all(p, step) if unshard_params else cast_stacks_for_loops(p, step), mb, *args)
            loss, aux = out if has_aux else (out, None)
            return mp.cast_outputs(jnp.asarray(loss)), aux

        if step.pregathered:
            fulls = _gather_for_deferred_sync(params, step)
            loss, aux, full_grads = _accumulate(loss_of, fulls, batch, microbatches)
            grads = _reduce_deferred(params, full_grads, step)
        else:
            remat = segmented(loss_of, step.remat_policy, len(jax.tree.leaves(params)), backward_prefetch)
            loss, aux, grads = _accumulate(remat, params, batch, microbatches,
                                           plain_residuals=step.remat_policy is REMAT_POLICY)
        if step.skip_all_reduce:
            grads = _all_reduce_replicas(params, grads, step)
        loss, aux = _over_devices(step.axes, loss, aux)
    return ((loss, aux) if has_aux else loss), grads


def _accumulate(loss_of, params, batch, microbatches, plain_residuals=False):
    """Loss, aux and gradients over the microbatches; ``plain_residuals``: the step's checkpoint is
    jshard's own, whose residuals are stored as plain differentiation's ([Note: residual rounding])."""
    raw_grad_of = jax.value_and_grad(loss_of, has_aux=True, allow_int=True)

    def grad_of(p, mb):
        out, grads = raw_grad_of(p, mb)
        return out, _zero_untrainable(p, grads)
    if plain_residuals:
        grad_of = without_residual_rounding(grad_of)
    if microbatches == 1:
        (loss, aux), grads = grad_of(params, batch)
        return loss, aux, grads

    def step(acc, mb):
        (loss, aux), grads = grad_of(params, mb)
        return jax.tree.map(jnp.add, acc, (loss, grads)), aux

    zero = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), params)
    mb0 = jax.tree.map(lambda x: x[0], _split_microbatches(batch, microbatches))
    loss_shape = jax.eval_shape(lambda: grad_of(params, mb0)[0][0])
    init = (jnp.zeros(loss_shape.shape, loss_shape.dtype), zero)
    (loss, grads), auxs = jax.lax.scan(step, init, _split_microbatches(batch, microbatches))
    scale = 1.0 / microbatches
    grads = jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
    aux = jax.tree.map(lambda a: a.mean(0) if jnp.issubdtype(a.dtype, jnp.inexact) else a.sum(0), auxs)
    return loss * scale, aux, grads


def _all_reduce_replicas(params: Any, grads: Any, step: StepState) -> Any:
    def reduce(meta, layout, p, g):
        if not _trainable(layout):
            return g
        hook = meta.policy.all_reduce_hook or C.all_reduce
        offloaded = memory_kind(layout, meta.policy) is not None  # reduced on device, kept on host
        view, axes = leaf_view(layout, meta.axes, step.axes)
        reduce_over_replicas = model_manual(view, axes, lambda v: hook(v, axes.replicate), False, False)
        return to_host(reduce_over_replicas(to_device(g, offloaded)), offloaded)

    return map_unit_leaves(reduce, params, grads)
