"""``value_and_grad`` for sharded NNX modules, built on :func:`jshard.value_and_grad`.

The module's units go to the core step as ``sharded`` (``unshard_params=False``); inside
its ``shard_map`` the module is rebuilt (``nnx.merge``) with the local shards in its
Params, and every sharded module gathers its own parameters when it is called. Other
state (``nnx.Rngs`` counters, batch statistics) goes in replicated and its updates come
back through the step's aux: floating leaves averaged over devices, the others taken
from the first device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jshard._sharding.step_state import active_step
from jshard._step.value_and_grad import value_and_grad as core_value_and_grad
from jshard.flax._nnx.graph import build_unit, describe, sharded_modules, unit_leaf_paths, unit_state
from jshard.flax._nnx.step_context import NnxStep
from jshard.flax._paths import Path, attribute_path


def _state_paths(state: Any) -> list[Path]:
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    return [tuple(k.key for k in keys if isinstance(k, jax.tree_util.DictKey)) for keys, _ in flat]


def _with_values(state: Any, paths: list[Path], by_path: dict[Path, Any]) -> Any:
    return jax.tree.unflatten(jax.tree.structure(state), [by_path[p] for p in paths])


def _step_flags(module: Any) -> dict[str, Any]:
    """The step-wide controls, which every sharded module of the step must agree on."""
    modules = sharded_modules(module)
    names = ("requires_gradient_sync", "requires_all_reduce", "reshard_after_backward")
    root = unit_state(module)
    for _, m in modules:
        state = unit_state(m)
        if state.unsharded:
            raise RuntimeError(
                f"{describe(m)} holds gathered parameters (unshard() was called outside the step); "
                "call reshard() on it, or jshard.flax.nnx.reshard(model), before training."
            )
        for name in names:
            if getattr(state, name) != getattr(root, name):
                raise ValueError(
                    f"{describe(m)} has {name}={getattr(state, name)} but the root has {getattr(root, name)}: "
                    f"in jshard it applies to the whole step; call set_{name}(...) on the root (recurse=True)."
                )
    return {
        "requires_gradient_sync": root.requires_gradient_sync and root.reshard_after_backward,
        "requires_all_reduce": root.requires_all_reduce,
    }


def _check_covered(module: Any, unit_paths: list[Path], param_paths: list[Path]) -> None:
    missing = sorted(set(param_paths) - set(unit_paths), key=str)
    if missing:
        raise ValueError(
            f"Param `{attribute_path(missing[0])}` of {describe(module)} belongs to no unit (it was added after "
            "fully_shard); every nnx.Param must be sharded: add parameters before calling fully_shard."
        )


def _encode_rest(rest: Any) -> Any:
    """Make non-Param state survive the step's aux reduction (mean of floats, sum of others)."""
    axes = active_step().axes.data_parallel
    first = jax.lax.axis_index(axes) == 0

    def encode(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return x
        return jnp.where(first, x, jnp.zeros_like(x))

    return jax.tree.map(encode, rest)


def _decode_rest(encoded: Any, like: Any) -> Any:
    def decode(x, ref):
        if jax.dtypes.issubdtype(ref.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(x, impl=jax.random.key_impl(ref))
        return x.astype(ref.dtype)

    return jax.tree.map(decode, encoded, like)


def value_and_grad(
    loss_fn: Callable[..., Any],
    *,
    has_aux: bool = False,
    microbatches: int = 1,
    remat_policy: Callable[..., Any] | None = None,
    backward_prefetch: bool = True,
) -> Callable[..., Any]:
    """The FSDP step's loss and gradient for a sharded NNX module (like ``nnx.value_and_grad``).

    ``loss_fn(model, batch, *args)`` returns the mean loss over the batch it sees (and aux
    when ``has_aux``). The returned ``grad_fn(model, batch, *args)`` runs it inside
    :func:`jshard.value_and_grad` with ``batch`` split over the data-parallel devices;
    each sharded module gathers its own parameters when called. It returns
    ``(loss or (loss, aux), grads)``: the global-batch mean loss and its gradient as an
    ``nnx.State`` of Params with exactly the sharded layout of ``nnx.state(model,
    nnx.Param)``, ready for ``nnx.Optimizer.update(model, grads)``. Updates of other state
    (``nnx.Rngs``, batch statistics) are written back to ``model`` when
    ``microbatches == 1`` (with microbatches that state is read-only in the step). The
    modules' ``set_requires_gradient_sync`` / ``set_requires_all_reduce`` /
    ``set_reshard_after_backward`` apply to the whole step.

    Args:
      loss_fn: the loss on one device's batch, taking the model first.
      has_aux: ``loss_fn`` returns ``(loss, aux)``; aux floats are averaged over devices.
      microbatches: gradient accumulation inside the step (see :func:`jshard.value_and_grad`).
      remat_policy: a ``jax.checkpoint`` policy for activations, combined with jshard's
        (see :func:`jshard.value_and_grad`).
      backward_prefetch: re-gather a unit in backward while the next one computes (``True``)
        or once its gradients are reduced (see :func:`jshard.value_and_grad`).

    Returns:
      ``grad_fn(model, batch, *args)``; use it under ``nnx.jit`` (or ``jax.jit`` with
      ``nnx.split`` / ``nnx.merge``).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> from jshard.flax import nnx as jnnx
      >>> model = jnnx.fully_shard(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
      >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      >>> @nnx.jit
      ... def train_step(model, optimizer, x):
      ...     loss, grads = jnnx.value_and_grad(lambda m, x: jnp.mean(m(x) ** 2))(model, x)
      ...     optimizer.update(model, grads)
      ...     return loss
      >>> bool(train_step(model, optimizer, jnp.ones((8, 3))) > train_step(model, optimizer, jnp.ones((8, 3))))
      True
    """

    def grad_fn(module: Any, batch: Any, *args: Any):
        if unit_state(module) is None:
            raise ValueError(
                f"The step got {type(module).__name__}, which is not fully sharded: call "
                "jshard.flax.nnx.fully_shard on its blocks, then on the root, before training."
            )
        flags = _step_flags(module)
        units = build_unit(module)
        unit_paths = unit_leaf_paths(module)
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        param_paths = _state_paths(params)
        _check_covered(module, unit_paths, param_paths)
        keep_rest = microbatches == 1

        def inner(local_units, local_batch, local_rest, *local_args):
            by_path = dict(zip(unit_paths, jax.tree.leaves(local_units), strict=True))
            fresh_rest = jax.tree.map(lambda x: x, local_rest)  # Variables of this trace, so the model can update them
            model = nnx.merge(graphdef, _with_values(params, param_paths, by_path), fresh_rest)
            with active_step().adapting(NnxStep(model)):
                out = loss_fn(model, local_batch, *local_args)
            loss, aux = out if has_aux else (out, None)
            new_rest = _encode_rest(nnx.state(model, nnx.Not(nnx.Param))) if keep_rest else None
            return loss, (aux, new_rest)

        core = core_value_and_grad(inner, has_aux=True, unshard_params=False, microbatches=microbatches,
                                   remat_policy=remat_policy, backward_prefetch=backward_prefetch, **flags)
        (loss, (aux, new_rest)), unit_grads = core(units, batch, rest, *args)
        grads = _with_values(params, param_paths, dict(zip(unit_paths, jax.tree.leaves(unit_grads), strict=True)))
        if keep_rest and jax.tree.leaves(rest):
            nnx.update(module, _decode_rest(new_rest, rest))
        return ((loss, aux) if has_aux else loss), grads

    return grad_fn
