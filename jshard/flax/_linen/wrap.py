"""``fully_shard`` for Linen module classes, and ``shard_params``: the params split into their units."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from flax import linen as nn
from jax.sharding import Mesh

from jshard._sharding.fully_shard import fully_shard as fully_shard_tree
from jshard._sharding.mesh import make_mesh
from jshard._sharding.nested import get_in, set_in
from jshard._sharding.policies import FullyShardPolicy
from jshard._sharding.stages import stage_layers
from jshard._sharding.unit import FSDPUnit
from jshard.flax._linen import partitioned, stacked
from jshard.flax._linen.intercept import ModuleUnits, check_units, intercepting
from jshard.flax._linen.transform import Discovered, discovering, fsdp
from jshard.flax._paths import Path, scope_path


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


def _discover(call: Any, params: Any, args: tuple, kwargs: dict, units: ModuleUnits | None) -> Discovered:
    """The wrapped modules of an abstract call, then which are stacked ([Note: Linen stacking])."""
    with discovering() as first, intercepting(units):
        jax.eval_shape(lambda p: call({"params": p}, *args, **kwargs), params)
    with discovering(tuple(first.specs)) as found, intercepting(units):
        jax.eval_shape(lambda p: call({"params": stacked.box(p)}, *args, **kwargs), params)
    return found


def _units_found(found: Discovered) -> list[tuple[Path, Any, FullyShardPolicy]]:
    """``(path, mesh, policy)`` per wrapped module, deepest first; stacked ones get scan_axis=0."""
    out = []
    for path, (mesh, policy) in found.specs.items():
        if found.stacked.get(path) and policy.scan_axis is None:
            policy = dataclasses.replace(policy, scan_axis=0)
        out.append((path, make_mesh() if mesh is None else mesh, policy))
    return sorted(out, key=lambda item: -len(item[0]))


def shard_params(
    model: nn.Module, params: Any, *args: Any, method: Any = None, units: ModuleUnits | None = None, **kwargs: Any
) -> FSDPUnit:
    """Shard a Linen model's params into the units its wrapped modules define.

    Runs ``model.apply`` abstractly (``jax.eval_shape``) on the example arguments to find
    the wrapped modules and which of them are stacked (called inside ``nn.scan``: the
    params carry the axes a lifted transform removed, [Note: Linen stacking]), then
    applies :func:`jshard.fully_shard` bottom-up to their sub-trees of ``params``, the
    root last.

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
      ValueError: the root is not wrapped, a wrapped module is nested inside a stacked
        (``nn.scan``) one, or lifted transforms split a wrapped module's params other than
        along one leading axis.

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
    check_units(units)
    params, boxed = partitioned.unbox(jax.tree.map(lambda x: x, dict(params), is_leaf=partitioned.is_box))
    if isinstance(model, nn.Module):
        call = functools.partial(model.apply, method=method)
    elif callable(model) and method is None:
        call = lambda variables, *a, **k: model(variables["params"], *a, **k)  # noqa: E731
    else:
        raise TypeError(
            f"shard_params takes a Linen module or a function (params, *args) -> outputs, got "
            f"{type(model).__name__}" + (" with `method` (only for modules)" if callable(model) else "") + "."
        )
    found = _discover(call, params, args, kwargs, units)
    if () not in found.specs:
        raise ValueError(
            f"The root module {getattr(type(model), '__name__', model)} is not wrapped with "
            "jshard.flax.linen.fully_shard, so its "
            "own parameters would belong to no unit: wrap the root class too (FSDP2 shards the root last)."
        )
    planned = _units_found(found)
    params = partitioned.place(params, boxed, lambda leaf: next(m for p, m, _ in planned if leaf[: len(p)] == p))
    for path, mesh, policy in planned:
        inside = [p for p, _, pol in planned if pol.scan_axis == 0 and len(p) < len(path) and path[: len(p)] == p]
        if inside:
            raise ValueError(
                f"Linen module at `{scope_path(path)}` is wrapped with fully_shard inside the stacked (nn.scan) "
                f"module at `{scope_path(inside[0])}`: a stack is one unit; wrap only the scanned block."
            )
        tree = get_in(params, path)
        if path in found.stages:  # a jlinen.pipeline stack: its layers laid out as the mesh's stages
            tree = stage_layers(tree, mesh, found.stages[path])
        params = set_in(params, path, fully_shard_tree(tree, mesh, policy))
    return params
