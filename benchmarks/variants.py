"""The three training steps compared on one model and one mesh.

- ``replicated``: data parallel, parameters and optimizer state on every device; ``jit``
  all-reduces the gradients.
- ``gspmd``: the FSDP recipe a JAX user writes by hand: every parameter annotated with a
  ``NamedSharding`` over ``'fsdp'`` on dim 0 of each layer weight (dim 1 of a stacked
  leaf), layers under ``lax.scan`` with ``jax.checkpoint``, and ``jit`` (GSPMD) inserts
  the collectives.
- ``gspmd_constrained`` (full runs only): the same recipe with each block's input and
  output constrained to batch sharding (``with_sharding_constraint``), which a careful
  user adds when GSPMD reshards activations instead of gathering parameters.
- ``jshard``: ``js.fully_shard`` with ``FullyShardPolicy(scan_axis=0)`` for the stack
  inside a root unit, ``js.scan`` and ``js.value_and_grad(unshard_params=False)``.
- ``jshard_unit`` (full runs only): the same with ``unit_collectives=True``: one
  all-gather and one reduce-scatter per layer (and for the root unit) through a flat buffer.

All of them run the same loss (``jshard/demo/model.py``) and the same AdamW update,
on the same devices and global batch. Given abstract inputs (``model_inputs(...,
abstract=True)``), :func:`prepare` places nothing: its arguments are ``jax.ShapeDtypeStruct``
leaves with their shardings, to compile for devices this process cannot run on (a TPU
topology's, compile only). Each block is recomputed in backward: with
``jax.checkpoint`` under ``lax.scan``, and with a ``custom_vjp`` under ``js.scan``, whose
remat policy would override a ``jax.checkpoint`` in its body (see
``recompute_in_backward``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import jshard as js
from jshard.demo import model as T
from jshard.report import abstract_result

VARIANTS = ("replicated", "gspmd", "jshard")
EXTRA_VARIANTS = ("gspmd_constrained", "jshard_unit")


@dataclasses.dataclass
class Prepared:
    """A jitted step and the arguments it is run with."""

    step: Callable[..., Any]
    args: tuple[Any, ...]


def _gspmd_spec(path: Any, x: Any) -> PartitionSpec:
    """Dim 0 of each layer's weight: dim 1 of a stacked leaf, dim 0 of the others."""
    stacked = any(getattr(k, "key", None) == "blocks" for k in path)
    if stacked:
        return PartitionSpec(None, "fsdp") if x.ndim >= 2 else PartitionSpec()
    return PartitionSpec("fsdp") if x.ndim >= 1 else PartitionSpec()


def _abstract(tree: Any) -> bool:
    return all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def _place(tree: Any, shardings: Any) -> Any:
    """``tree`` on ``shardings``: put there, or, abstract, given them."""
    if _abstract(tree):
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
    return jax.device_put(tree, shardings)


def _with_shardings(tree: Any, specs: Any, mesh: Any) -> tuple[Any, Any]:
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, PartitionSpec))
    return _place(tree, shardings), shardings


def _batch_sharded_blocks(mesh: Any) -> T.RunBlocks:
    """``lax.scan`` over blocks with each block's input and output constrained to batch sharding."""
    batch = NamedSharding(mesh, PartitionSpec("fsdp"))

    def run(body, h, blocks):
        def constrained(h, layer):
            out, y = body(jax.lax.with_sharding_constraint(h, batch), layer)
            return jax.lax.with_sharding_constraint(out, batch), y

        return jax.lax.scan(constrained, h, blocks)

    return run


def _plain(config, params, tokens, devices, optimizer, sharded: bool, constrained: bool = False) -> Prepared:
    mesh = jax.make_mesh((len(devices),), ("fsdp",), devices=devices, axis_types=(AxisType.Auto,))
    if sharded:
        specs = jax.tree_util.tree_map_with_path(_gspmd_spec, params)
    else:
        specs = jax.tree.map(lambda x: PartitionSpec(), params)
    params, param_sh = _with_shardings(params, specs, mesh)
    opt_state = T.init_opt_state(optimizer, params, mesh)
    opt_sh = jax.tree.map(lambda x: x.sharding, opt_state)
    tokens_sh = NamedSharding(mesh, PartitionSpec("fsdp"))
    run_blocks = _batch_sharded_blocks(mesh) if constrained else T.lax_scan_blocks
    step = jax.jit(
        T.plain_train_step(config, optimizer, run_blocks),
        in_shardings=(param_sh, opt_sh, tokens_sh),
        out_shardings=(param_sh, opt_sh, NamedSharding(mesh, PartitionSpec())),
    )
    return Prepared(step, (params, opt_state, _place(tokens, tokens_sh)))


def _jshard(config, params, tokens, devices, optimizer, unit_collectives: bool = False) -> Prepared:
    mesh = js.make_mesh(devices=devices)
    sharded = T.shard_lm(params, mesh, unit_collectives=unit_collectives)
    optimizer = js.shard_optimizer(optimizer)
    opt_state = abstract_result(optimizer.init, sharded) if _abstract(params) else optimizer.init(sharded)
    tokens = _place(tokens, NamedSharding(mesh, PartitionSpec("fsdp")))
    return Prepared(jax.jit(T.jshard_train_step(config, optimizer)), (sharded, opt_state, tokens))


def model_inputs(config: T.TransformerConfig, batch: int, seed: int = 0,
                 abstract: bool = False) -> tuple[Any, jax.Array]:
    """Initial parameters and one batch of tokens, the same for every variant; ``abstract``:
    their shapes and dtypes only (``jax.ShapeDtypeStruct``), nothing allocated."""
    if abstract:
        return T.abstract_params(config), jax.ShapeDtypeStruct((batch, config.seq_len + 1), jnp.int32)
    key_params, key_tokens = jax.random.split(jax.random.key(seed))
    params = jax.jit(functools.partial(T.init_params, config))(key_params)
    tokens = jax.random.randint(key_tokens, (batch, config.seq_len + 1), 0, config.vocab, jnp.int32)
    return params, tokens


def prepare(variant: str, config: T.TransformerConfig, devices: list[Any], params: Any, tokens: jax.Array) -> Prepared:
    """The jitted step of ``variant`` and its arguments, placed on ``devices`` (abstract inputs:
    abstract arguments with their shardings, for ``step.lower(*args).compile()``)."""
    optimizer = optax.adamw(1e-3)
    if variant in ("jshard", "jshard_unit"):
        return _jshard(config, params, tokens, devices, optimizer, unit_collectives=variant == "jshard_unit")
    if variant in ("replicated", "gspmd", "gspmd_constrained"):
        return _plain(config, params, tokens, devices, optimizer, sharded=variant != "replicated",
                      constrained=variant == "gspmd_constrained")
    raise ValueError(f"Unknown variant {variant!r}; choose one of {VARIANTS + EXTRA_VARIANTS}.")
