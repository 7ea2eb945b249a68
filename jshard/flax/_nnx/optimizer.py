"""``shard_optimizer`` for ``nnx.Optimizer``: Optax on a sharded model's Params as on the unsharded model's."""

from __future__ import annotations

from typing import Any

import jax
import optax
from flax import nnx

from jshard._state.optimizer import shard_optimizer as shard_units_optimizer
from jshard._state.stored_leaves import strip_units
from jshard.flax._nnx.graph import build_unit, unit_leaf_paths, unit_state


def _value(x: Any) -> Any:
    return x.get_value() if isinstance(x, nnx.Variable) else x


def _flat(state: Any) -> dict[tuple, Any]:
    """The arrays of an ``nnx.State`` by path (``nnx.Optimizer`` passes Variables or arrays)."""
    return {tuple(path): _value(value) for path, value in nnx.to_flat_state(state)}


def shard_optimizer(model: Any, tx: optax.GradientTransformation, *, min_size_to_shard: int = 1024
                    ) -> optax.GradientTransformationExtraArgs:
    """``tx`` for ``nnx.Optimizer(model, ..., wrt=nnx.Param)`` on a model made by :func:`fully_shard`.

    ``nnx.Optimizer`` hands the transformation the model's stored Params (padded shards);
    this one runs ``tx`` through :func:`jshard.shard_optimizer` on the model's units, so it
    sees every parameter at its original shape: masks and labels written for the model's
    ``nnx.State`` (or callables) work, and so do transformations whose result depends on
    shapes (Adafactor, Muon), exactly as on the unsharded model. The optimizer's state has
    the structure of the unsharded model's, holding the stored (padded, sharded) arrays.

    Args:
      model: the sharded model (``fully_shard`` applied to its root).
      tx: any Optax transformation.
      min_size_to_shard: see :func:`jshard.shard_optimizer`.

    Returns:
      A transformation for ``nnx.Optimizer(model, tx, wrt=nnx.Param)``.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> from jshard.flax import nnx as jnnx
      >>> model = jnnx.fully_shard(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
      >>> no_decay_on_biases = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
      >>> tx = jnnx.shard_optimizer(model, optax.adamw(0.1, mask=no_decay_on_biases))
      >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
      >>> grad_fn = jnnx.value_and_grad(lambda m, x: jnp.mean(m(x) ** 2))
      >>> loss, grads = nnx.jit(grad_fn)(model, jnp.ones((8, 3)))
      >>> with jax.numpy_dtype_promotion("standard"):
      ...     _ = optimizer.update(model, grads)
      >>> model.kernel.get_value().shape  # still the stored shard layout
      (8, 2)
    """
    if unit_state(model) is None:
        raise ValueError(
            f"jnnx.shard_optimizer got {type(model).__name__}, which is not fully sharded: call "
            "jnnx.fully_shard on the model's root first (every Param must belong to a unit)."
        )
    template = jax.tree.structure(build_unit(model))
    paths = unit_leaf_paths(model)
    inner = shard_units_optimizer(tx, min_size_to_shard=min_size_to_shard)

    def to_units(state: Any) -> Any:
        if state is None:
            return None
        flat = _flat(state)
        missing = [".".join(map(str, p)) for p in paths if p not in flat]
        if missing or len(flat) != len(paths):
            raise ValueError(
                f"jnnx.shard_optimizer: the optimizer got Params {sorted('.'.join(map(str, p)) for p in flat)}, but "
                f"the model's units hold {['.'.join(map(str, p)) for p in paths]}; build nnx.Optimizer with "
                "wrt=nnx.Param over the same model."
            )
        return jax.tree.unflatten(template, [flat[p] for p in paths])

    def to_state(units: Any, like: Any) -> Any:
        values = dict(zip(paths, jax.tree.leaves(units), strict=True))

        def put(path, old):
            new = values[tuple(path)]
            return old.replace(new) if isinstance(old, nnx.Variable) else new

        return nnx.from_flat_state([(path, put(path, old)) for path, old in nnx.to_flat_state(like)])

    def init_fn(params: Any) -> Any:
        return strip_units(inner.init(to_units(params)))  # nnx.Optimizer keeps no pytree nodes of ours

    def update_fn(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        if params is None:
            raise ValueError("jnnx.shard_optimizer needs the parameters in update (nnx.Optimizer passes them).")
        units = to_units(params)
        stored = jax.tree.structure(jax.eval_shape(inner.init, units))
        new, state = inner.update(to_units(updates), jax.tree.unflatten(stored, jax.tree.leaves(state)), units, **extra)
        return to_state(new, updates), strip_units(state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
