"""Plan builders for the demo's transformer: ``build_<size>(mesh, config) -> (step, args)``.

``python -m jshard.report plan jshard.demo.plan:build_1b --devices 64`` plans the demo's
1B model (18 blocks of width 2048, vocabulary 32768, context 1024: about 1.04e9
parameters), sharded as the demo shards it, trained with AdamW; see [Note: plan target].
Every argument is a ``jax.ShapeDtypeStruct``: nothing is allocated. On a mesh with a
``"tp"`` axis the blocks are split Megatron-style over it, as ``--tensor-parallel`` does
in the demo.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

import jshard as js
from jshard.demo import model as T
from jshard.report import PlanConfig, abstract_result

DEFAULT = PlanConfig()


def abstract_on(tree: Any, mesh: Any, spec_of: Any = None) -> Any:
    """Abstract leaves placed on ``mesh``: ``spec_of(path, leaf)`` (default: the leaf's own spec, or replicated)."""

    def place(path, x):
        sharding = getattr(x, "sharding", None)
        spec = spec_of(path, x) if spec_of else sharding.spec if isinstance(sharding, NamedSharding) else None
        kind = getattr(sharding, "memory_kind", None)
        return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                    sharding=NamedSharding(mesh, spec or PartitionSpec(), memory_kind=kind))

    return jax.tree_util.tree_map_with_path(place, tree)


def standard_promotion(step: Any) -> Any:
    """``step`` traced under JAX's standard dtype promotion, whatever the caller's setting.

    Optax's Adam raises a float to an int32 power (its bias correction), which strict
    promotion refuses; the builders' steps should plan the same in any process.
    """

    def traced(*args):
        with jax.numpy_dtype_promotion("standard"):
            return step(*args)

    return traced


def _tensor_parallel_spec(path: Any, _: Any) -> PartitionSpec | None:
    keys = [k.key for k in path]
    if keys[0] == "blocks" and keys[1] in T.BLOCK_TP_SPECS:
        return T.BLOCK_TP_SPECS[keys[1]].get(keys[2])
    return None


def data_spec(mesh: Any) -> PartitionSpec:
    """The batch split over the data-parallel axes (every axis but ``"tp"``)."""
    return PartitionSpec(tuple(a for a in mesh.axis_names if a != "tp"))


def data_devices(mesh: Any) -> int:
    return mesh.size // dict(mesh.shape).get("tp", 1)


def build_lm(size: str, mesh: Any, config: PlanConfig) -> tuple[Any, tuple]:
    """The demo's training step on ``mesh`` for ``config`` and its abstract arguments."""
    if size not in T.SIZES:
        raise ValueError(f"Unknown demo model size {size!r}; choose one of {sorted(T.SIZES)}.")
    cfg = T.SIZES[size]
    mp = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32) if config.mixed_precision \
        else None
    offload = js.CPUOffloadPolicy() if config.offload else None
    params = abstract_on(T.abstract_params(cfg), mesh, _tensor_parallel_spec if "tp" in mesh.axis_names else None)
    params = T.shard_lm(params, mesh, mp, offload, reshard_after_forward=config.reshard_after_forward,
                        replicate_below=config.replicate_below, weight_gradients=config.weight_gradients)
    optimizer = js.shard_optimizer(optax.adamw(1e-4))
    opt_state = abstract_result(optimizer.init, params)
    tokens = jax.ShapeDtypeStruct((config.batch_per_device * data_devices(mesh), cfg.seq_len + 1), jnp.int32,
                                  sharding=NamedSharding(mesh, data_spec(mesh)))
    # "full": the demo's own per-block recompute (a custom_vjp: one re-gather per layer in
    # backward; nothing_saveable as the step's policy would gather each layer a third time).
    remat, policy = ("custom_vjp", None) if config.remat == "full" else ("none", config.remat_policy())
    step = standard_promotion(T.jshard_train_step(cfg, optimizer, remat=remat, remat_policy=policy))
    return jax.jit(step, donate_argnums=(0, 1)), (params, opt_state, tokens)


def build_tiny(mesh: Any, config: PlanConfig = DEFAULT) -> tuple[Any, tuple]:
    """The demo's ``tiny`` transformer (2 blocks of width 64)."""
    return build_lm("tiny", mesh, config)


def build_small(mesh: Any, config: PlanConfig = DEFAULT) -> tuple[Any, tuple]:
    """The demo's ``small`` transformer (4 blocks of width 128)."""
    return build_lm("small", mesh, config)


def build_medium(mesh: Any, config: PlanConfig = DEFAULT) -> tuple[Any, tuple]:
    """The demo's ``medium`` transformer (6 blocks of width 256)."""
    return build_lm("medium", mesh, config)


def build_1b(mesh: Any, config: PlanConfig = DEFAULT) -> tuple[Any, tuple]:
    """The demo's ``1b`` transformer (18 blocks of width 2048, vocabulary 32768, context 1024)."""
    return build_lm("1b", mesh, config)
