"""``value_and_grad`` for Linen models: each wrapped module gathers its unit, found by scope path."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from flax.errors import ScopeParamShapeError

from jshard._sharding.step_state import active_step
from jshard._sharding.unit import FSDPUnit, is_unit
from jshard._step.value_and_grad import value_and_grad as core_value_and_grad
from jshard.flax._linen.intercept import ModuleUnits, check_units, intercepting
from jshard.flax._linen.transform import StepTable
from jshard.flax._paths import Path, scope_path


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
        f"The unit at `{scope_path(missing[0])}` of the params was never gathered in the step: no module "
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
    backward_prefetch: bool = True,
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
    step controls and ``backward_prefetch`` (see :func:`jshard.value_and_grad`).

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

    check_units(units)

    def inner(local: Any, batch: Any, *args: Any):
        plain, table_units = _local_table(local)
        table = StepTable(table_units)
        with active_step().adapting(table), intercepting(units):
            try:
                out = loss_fn(plain, batch, *args)
            except ScopeParamShapeError as e:  # a module read shards: name the unit nobody gathered
                raise _never_gathered(table_units, table, re.search(r'in "/([^"]*)"', str(e))) from e
        if set(table_units) - table.gathered:
            raise _never_gathered(table_units, table, None)
        return out

    return core_value_and_grad(
        inner,
        has_aux=has_aux,
        unshard_params=False,
        microbatches=microbatches,
        requires_gradient_sync=requires_gradient_sync,
        requires_all_reduce=requires_all_reduce,
        remat_policy=remat_policy,
        backward_prefetch=backward_prefetch,
    )
