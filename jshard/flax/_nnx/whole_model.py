"""Every sharded module of a model gathered (for evaluation or export), or sharded again."""

from __future__ import annotations

from typing import Any

from jshard.flax._nnx.graph import build_unit, sharded_modules, unit_state


def unshard(module: Any) -> Any:
    """Gather every sharded module in ``module``'s graph (outside the step), for evaluation.

    Calls then run like the unsharded model; call :func:`reshard` before training again.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jshard.flax import nnx as jnnx
      >>> model = jnnx.fully_shard(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
      >>> jnnx.unshard(model)(jnp.ones((1, 3))).shape
      (1, 2)
      >>> jnnx.reshard(model).kernel.get_value().shape
      (8, 2)
    """
    for _, m in sharded_modules(module):
        m.unshard()
    return module


def reshard(module: Any) -> Any:
    """Put back the shards of every sharded module in ``module``'s graph (see :func:`unshard`).

    Example:
      >>> from flax import nnx
      >>> from jshard.flax import nnx as jnnx
      >>> model = jnnx.reshard(jnnx.unshard(jnnx.fully_shard(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))))
      >>> model.kernel.get_value().shape
      (8, 2)
    """
    for _, m in sharded_modules(module):
        m.reshard()
    return module


def units(module: Any) -> Any:
    """The model's parameters as the :class:`jshard.FSDPUnit` tree its sharded modules make.

    What the core sees: for :func:`jshard.report.step_report` (``params=``) and planning
    builders of NNX models, whose steps take ``nnx.State`` rather than units.

    Example:
      >>> from flax import nnx
      >>> from jshard.flax import nnx as jnnx
      >>> tree = jnnx.units(jnnx.fully_shard(nnx.Linear(3, 2, rngs=nnx.Rngs(0))))
      >>> type(tree).__name__, tree["kernel"].shape
      ('FSDPUnit', (8, 2))
    """
    if unit_state(module) is None:
        raise ValueError(f"jnnx.units got {type(module).__name__}, which is not fully sharded: call "
                         "jnnx.fully_shard on its blocks, then on the root.")
    return build_unit(module)
