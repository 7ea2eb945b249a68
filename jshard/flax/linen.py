"""FSDP2 for Flax Linen: wrap blocks and the root like ``nn.remat``, train with ``TrainState``.

Example:
  >>> import jax, jax.numpy as jnp, flax.linen as nn
  >>> from jshard.flax import linen as jlinen
  >>> model = jlinen.fully_shard(nn.Dense)(3)
  >>> x = jnp.ones((8, 5))
  >>> params = jlinen.shard_params(model, model.init(jax.random.key(0), x)["params"], x)
  >>> params["kernel"].shape  # 5 rows padded to the 8 devices
  (8, 3)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import jax
from flax import linen as nn
from flax.errors import ScopeParamShapeError
from jax.sharding import Mesh

from jshard._api import FullyShardPolicy
from jshard._fully_shard import fully_shard as _fully_shard_tree
from jshard._mesh import make_mesh
from jshard._step import value_and_grad as _core_value_and_grad
from jshard._unit import FSDPUnit, is_unit
from jshard.flax._linen_intercept import ModuleUnits
from jshard.flax._linen_transform import Path, StepTable, _get, _set, format_path, fsdp, planning, step_table


def fully_shard(
    target: type[nn.Module],
    *,
    mesh: Mesh | None = None,
    policy: FullyShardPolicy | None = None,
    methods: tuple[str, ...] | None = None,
) -> type[nn.Module]:
    """Make every instance of a Linen module class its own FSDP unit (a module transform).

    Like ``nn.remat(Block)``, ``fully_shard(Block)`` returns a class whose instances gather
    their own parameters when called inside :func:`value_and_grad` and reshard after
    forward per the policy; gradients are reduce-scattered per module. Wrap the blocks
    and the root (FSDP2 shards the root last), build the sharded params with
    :func:`shard_params`, and train. A wrapped module used inside ``nn.scan`` gathers one
    layer per iteration (its unit gets ``scan_axis=0``).

    Args:
      target: a Linen module class.
      mesh: the mesh (default :func:`jshard.make_mesh`).
      policy: a :class:`jshard.FullyShardPolicy` for this module's units.
      methods: the methods that gather (default ``("__call__",)``; FSDP2's
        ``register_fsdp_forward_method``).

    Returns:
      The wrapped class.

    Example:
      >>> import flax.linen as nn, jshard as js
      >>> from jshard.flax import linen as jlinen
      >>> Block = jlinen.fully_shard(nn.Dense, policy=js.FullyShardPolicy(reshard_after_forward=True))
      >>> Block.__name__
      'FsdpDense'
    """
    if not (isinstance(target, type) and issubclass(target, nn.Module)):
        raise TypeError(f"jshard.flax.linen.fully_shard takes a Linen module class, got {target!r}.")
    policy = FullyShardPolicy() if policy is None else policy
    return nn.transforms.lift_transform(fsdp, target, mesh, policy, methods=methods)


def _plan_units(plan: Any, params: dict) -> list[tuple[Path, Any, FullyShardPolicy]]:
    """``(path, mesh, policy)`` per wrapped module, deepest first; stacked ones get scan_axis=0."""
    out = []
    for path, (mesh, policy) in plan.specs.items():
        outer = jax.tree.map(lambda x: tuple(x.shape), _get(params, path))
        stacked = jax.tree.leaves(outer, is_leaf=lambda x: isinstance(x, tuple)) != jax.tree.leaves(
            plan.seen[path], is_leaf=lambda x: isinstance(x, tuple)
        )
        if stacked and policy.scan_axis is None:
            policy = dataclasses.replace(policy, scan_axis=0)
        out.append((path, make_mesh() if mesh is None else mesh, policy))
    return sorted(out, key=lambda item: -len(item[0]))


def shard_params(
    model: nn.Module, params: Any, *args: Any, method: Any = None, units: ModuleUnits | None = None, **kwargs: Any
) -> FSDPUnit:
    """Shard a Linen model's params into the units its wrapped modules define.

    Runs ``model.apply`` abstractly (``jax.eval_shape``) on the example arguments to find
    the wrapped modules, then applies :func:`jshard.fully_shard` bottom-up to their
    sub-trees of ``params``, the root last.

    Args:
      model: the Linen model (its root class wrapped with :func:`fully_shard`), or with
        ``units``, a function ``(params, *args, **kwargs)`` that runs the model (e.g.
        ``lambda p, ids: hf_model(ids, params=p)`` for a Hugging Face model).
      params: its ``params`` collection, as ``model.init`` returns it.
      *args: example arguments of the call (shapes only matter), as for ``model.init``.
      method: the method to call (default ``__call__``).
      units: a :class:`ModuleUnits` choosing the units by module class, for models whose
        code you do not change (then the root needs no wrapping).
      **kwargs: example keyword arguments.

    Returns:
      The root :class:`jshard.FSDPUnit`, indexable like ``params``; use it as
      ``TrainState.params``.

    Raises:
      ValueError: the root is not wrapped, or a wrapped module is nested inside a stacked
        (``nn.scan``) one.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> from jshard.flax import linen as jlinen
      >>> class MLP(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         return nn.Dense(1)(jlinen.fully_shard(nn.Dense)(4, name="block")(x))
      >>> model, x = jlinen.fully_shard(MLP)(), jnp.ones((8, 3))
      >>> params = jlinen.shard_params(model, model.init(jax.random.key(0), x)["params"], x)
      >>> type(params["block"]).__name__, params["block"]["kernel"].shape
      ('FSDPUnit', (8, 4))
    """
    _check_units(units)
    params = jax.tree.map(lambda x: x, dict(params))
    if isinstance(model, nn.Module):
        call = functools.partial(model.apply, method=method)
    elif callable(model) and method is None:
        call = lambda variables, *a, **k: model(variables["params"], *a, **k)  # noqa: E731
    else:
        raise TypeError(
            f"shard_params takes a Linen module or a function (params, *args) -> outputs, got "
            f"{type(model).__name__}" + (" with `method` (only for modules)" if callable(model) else "") + "."
        )
    with planning() as plan, _intercepting(units):
        jax.eval_shape(lambda p: call({"params": p}, *args, **kwargs), params)
    if () not in plan.specs:
        raise ValueError(
            f"The root module {getattr(type(model), '__name__', model)} is not wrapped with "
            "jshard.flax.linen.fully_shard, so its "
            "own parameters would belong to no unit: wrap the root class too (FSDP2 shards the root last)."
        )
    planned = _plan_units(plan, params)
    for path, mesh, policy in planned:
        inside = [p for p, _, pol in planned if pol.scan_axis == 0 and len(p) < len(path) and path[: len(p)] == p]
        if inside:
            raise ValueError(
                f"Linen module at `{format_path(path)}` is wrapped with fully_shard inside the stacked (nn.scan) "
                f"module at `{format_path(inside[0])}`: a stack is one unit; wrap only the scanned block."
            )
        params = _set(params, path, _fully_shard_tree(_get(params, path), mesh, policy))
    return params


def _check_units(units: Any) -> None:
    if units is not None and not isinstance(units, ModuleUnits):
        raise TypeError(
            f"`units` must be a jshard.flax.linen.ModuleUnits, got {type(units).__name__}; pass "
            "units=jshard.flax.linen.ModuleUnits(LayerClass)."
        )


def _intercepting(units: ModuleUnits | None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if units is None else units.intercept()


def _local_table(local: Any) -> tuple[Any, dict[Path, FSDPUnit]]:
    """The plain params tree of local shards, and every unit by its path."""
    units: dict[Path, FSDPUnit] = {}

    def plain(x: Any, path: Path) -> Any:
        if is_unit(x):
            units[path] = x
            x = x.tree
        if isinstance(x, dict):
            return {k: plain(v, (*path, k)) for k, v in x.items()}
        return x

    return plain(local, ()), units


def _never_gathered(units: dict[Path, FSDPUnit], table: StepTable, scope: Any) -> ValueError:
    missing = sorted(set(units) - table.gathered)
    if scope is not None:
        where = tuple(p for p in scope.group(1).split("/") if p)
        missing = sorted((p for p in missing if where[: len(p)] == p), key=len, reverse=True) or missing
    return ValueError(
        f"The unit at `{format_path(missing[0])}` of the params was never gathered in the step: no module "
        "wrapped with jshard.flax.linen.fully_shard owns it, so its modules would read shards. Build the "
        "params with jshard.flax.linen.shard_params, or use js.value_and_grad(loss_fn) (it gathers every "
        "unit up front) for models you cannot wrap."
    )


def value_and_grad(
    loss_fn: Callable[..., Any],
    *,
    has_aux: bool = False,
    microbatches: int = 1,
    requires_gradient_sync: bool = True,
    requires_all_reduce: bool = True,
    units: ModuleUnits | None = None,
    remat_policy: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    """The FSDP step for Linen models whose modules are wrapped with :func:`fully_shard`.

    ``loss_fn(params, batch, *args)`` calls ``model.apply({"params": params}, ...)`` and
    returns the mean loss over the batch it sees. The returned ``grad_fn(sharded, batch,
    *args)`` runs it inside :func:`jshard.value_and_grad` with ``params`` holding this
    device's shards in the usual nested dict; each wrapped module gathers its own when
    called. Returns ``(loss or (loss, aux), grads)`` with the layout of ``sharded``, ready
    for ``TrainState.apply_gradients``. ``units``: the :class:`ModuleUnits` the params were
    sharded with, for models whose code you do not change. ``remat_policy``: activation
    checkpointing, as in :func:`jshard.value_and_grad`. The other arguments are FSDP2's
    step controls (see :func:`jshard.value_and_grad`).

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> from jshard.flax import linen as jlinen
      >>> model = jlinen.fully_shard(nn.Dense)(2)
      >>> x = jnp.ones((8, 3))
      >>> params = jlinen.shard_params(model, model.init(jax.random.key(0), x)["params"], x)
      >>> loss_fn = lambda p, x: jnp.mean(model.apply({"params": p}, x) ** 2)
      >>> loss, grads = jax.jit(jlinen.value_and_grad(loss_fn))(params, x)
      >>> grads["kernel"].shape
      (8, 2)
    """

    _check_units(units)

    def inner(local: Any, batch: Any, *args: Any):
        plain, table_units = _local_table(local)
        with step_table(StepTable(table_units)) as table, _intercepting(units):
            try:
                out = loss_fn(plain, batch, *args)
            except ScopeParamShapeError as e:  # a module read shards: name the unit nobody gathered
                raise _never_gathered(table_units, table, re.search(r'in "/([^"]*)"', str(e))) from e
        if set(table_units) - table.gathered:
            raise _never_gathered(table_units, table, None)
        return out

    return _core_value_and_grad(
        inner,
        has_aux=has_aux,
        unshard_params=False,
        microbatches=microbatches,
        requires_gradient_sync=requires_gradient_sync,
        requires_all_reduce=requires_all_reduce,
        remat_policy=remat_policy,
    )


__all__ = ["ModuleUnits", "fully_shard", "shard_params", "value_and_grad"]
