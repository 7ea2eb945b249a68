"""What a plan compiles: the user's ``build(mesh, config)`` and the configuration it reads.

[Note: plan target] A plan needs the user's step and abstract arguments for a mesh that
exists only in a planning process, so the user hands over a *builder*, not arrays:
``build(mesh)`` or ``build(mesh, config)`` returns ``(step, args)``, where ``args`` is a
tuple of ``jax.ShapeDtypeStruct`` trees (``jax.eval_shape``, ``nnx.eval_shape``,
``js.fully_shard`` of abstract leaves: nothing allocated). The planning subprocess
imports the builder by name (``"pkg.module:build"``), so it must be importable: a
function defined at module level, not in ``__main__`` or a notebook cell. The frontier
search varies the :class:`PlanConfig` fields; a builder that takes no ``config`` can
only be planned as it is. A step whose arguments hold no :class:`jshard.FSDPUnit` (an NNX
model's ``nnx.State``) returns ``(step, args, params)`` with the unit tree for the
analytic figures (``jnnx.units(model)``).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from jshard._sharding.platform_defaults import platform_layout, unset
from jshard._sharding.policies import WEIGHT_GRADIENTS

REMATS = ("default", "full", "dots")


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """The training configuration a builder reads (what the frontier search varies).

    Attributes:
      batch_per_device: sequences (examples) per data-parallel device per step.
      reshard_after_forward: FSDP's ``reshard_after_forward`` for the units.
      remat: ``"default"`` (jshard's: gathered parameters freed, activations saved),
        ``"full"`` (``nothing_saveable``: every layer recomputed in backward) or
        ``"dots"`` (``dots_with_no_batch_dims_saveable``: matmul outputs kept).
      mixed_precision: bf16 parameters for compute and all-gather, fp32 reduction.
      offload: parameters, gradients and optimizer state in pinned host memory.
      replicate_below: ``FullyShardPolicy(replicate_below=...)`` for the units: leaves under
        this many elements (biases, norm scales) kept whole on every device; ``0`` shards every
        leaf; ``None`` (default): the target's choice ([Note: platform defaults]).
      weight_gradients: ``FullyShardPolicy(weight_gradients=...)`` for the units:
        ``"reduced"`` (FSDP2's), ``"from_activations"`` (a matmul of a unit's matrix run on the
        shard with its activations exchanged where that sends less: small global batches;
        docs/planning.md; plan both), ``"in_blocks"`` (its gradient formed and reduce-scattered
        a block at a time), ``"from_activations+in_blocks"`` (the first, else the second) or
        ``None`` (default): the target's choice. A plan records the values it compiled
        (:meth:`for_devices`).

    Example:
      >>> from jshard.report import PlanConfig
      >>> PlanConfig(batch_per_device=4, remat="full").remat_policy().__name__
      'nothing_saveable'
    """

    batch_per_device: int = 1
    reshard_after_forward: bool = True
    remat: str = "default"
    mixed_precision: bool = False
    offload: bool = False
    replicate_below: int | None = None
    weight_gradients: str | None = None

    def __post_init__(self):
        if isinstance(self.batch_per_device, bool) or not isinstance(self.batch_per_device, int) \
                or self.batch_per_device < 1:
            raise ValueError(f"PlanConfig.batch_per_device must be a positive int, got {self.batch_per_device!r}.")
        if self.remat not in REMATS:
            raise ValueError(f"PlanConfig.remat must be one of {REMATS}, got {self.remat!r}.")
        for name in ("reshard_after_forward", "mixed_precision", "offload"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PlanConfig.{name} must be a bool, got {getattr(self, name)!r}.")
        below = self.replicate_below
        if below is not None and (isinstance(below, bool) or not isinstance(below, int) or below < 0):
            raise ValueError(f"PlanConfig.replicate_below must be a non-negative int (a number of elements) or None, "
                             f"got {below!r}; 0 shards every leaf.")
        if self.weight_gradients not in (None, *WEIGHT_GRADIENTS):
            raise ValueError(f"PlanConfig.weight_gradients must be one of {WEIGHT_GRADIENTS} or None, "
                             f"got {self.weight_gradients!r}.")

    def for_devices(self, device_kind: str) -> PlanConfig:
        """This configuration with the settings it leaves ``None`` chosen for ``device_kind`` as
        ``fully_shard`` chooses them ([Note: platform defaults]).

        Example:
          >>> from jshard.report import PlanConfig
          >>> PlanConfig().for_devices("TPU v5").weight_gradients
          'from_activations+in_blocks'
        """
        return dataclasses.replace(self, **unset(self, platform_layout(device_kind)))

    def remat_policy(self) -> Callable[..., Any] | None:
        """The ``remat_policy`` to hand ``js.value_and_grad`` (``None`` for jshard's default)."""
        import jax

        return {"default": None, "full": jax.checkpoint_policies.nothing_saveable,
                "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}[self.remat]

    def describe(self) -> str:
        """A short line: ``batch 4/device, raf, remat full, fp32, on device``."""
        return (f"batch {self.batch_per_device}/device, "
                + ("raf" if self.reshard_after_forward else "no raf") + f", remat {self.remat}, "
                + ("bf16/fp32" if self.mixed_precision else "fp32") + ", "
                + ("offload" if self.offload else "on device")
                + (f", leaves under {self.replicate_below} whole" if self.replicate_below else "")
                + {None: "", "reduced": "", "from_activations": ", weight gradients from activations",
                   "in_blocks": ", weight gradients in blocks",
                   "from_activations+in_blocks": ", weight gradients from activations, else in blocks",
                   }[self.weight_gradients])


def abstract_result(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` as ``jax.ShapeDtypeStruct`` leaves with the shardings the compiler gives them.

    For a builder's abstract optimizer state: ``jax.eval_shape`` keeps shardings only on
    Explicit mesh axes, so on an Auto (tensor-parallel) mesh it would hand back replicated
    leaves; compiling ``fn`` (an initialiser: cheap) gives every output's real sharding.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jshard as js
      >>> from jshard.report import abstract_result
      >>> params = js.fully_shard({"w": jax.ShapeDtypeStruct((16, 4), jnp.float32)})
      >>> state = abstract_result(js.shard_optimizer(optax.adam(1e-3)).init, params)
      >>> state[0].mu["w"].shape, tuple(state[0].mu["w"].sharding.spec)
      ((16, 4), ('fsdp', None))
    """
    import jax

    shapes = jax.eval_shape(fn, *args)
    shardings = jax.jit(fn).lower(*args).compile().output_shardings
    return jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                        shapes, shardings)


def load_build(spec: str) -> Callable[..., Any]:
    """The builder named ``"pkg.module:attr"`` (a dotted attribute path after the colon)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"A plan target is 'pkg.module:build', got {spec!r}.")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"Cannot import {module_name!r} for plan target {spec!r}: {err}. "
                         "Run from the folder that holds it, or put it on PYTHONPATH.") from err
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"Plan target {spec!r}: {module_name} has no attribute {attr!r}.")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"Plan target {spec!r} is a {type(target).__name__}, not a function build(mesh, config).")
    return target


def spec_of(build: Callable[..., Any] | str) -> str:
    """``"pkg.module:qualname"`` for an importable builder (see [Note: plan target])."""
    if isinstance(build, str):
        return build
    module, name = getattr(build, "__module__", None), getattr(build, "__qualname__", "")
    if not module or module == "__main__" or "<" in name:
        raise ValueError(
            f"Cannot plan {build!r} in a subprocess: it is defined in {module or 'no module'} as {name!r}, which a "
            "planning process cannot import. Define build at module level in an importable file and pass it, "
            "or its name 'pkg.module:build'."
        )
    return f"{module}:{name}"


def takes_config(build: Callable[..., Any]) -> bool:
    """Whether ``build`` accepts a second argument (the :class:`PlanConfig`)."""
    try:
        params = list(inspect.signature(build).parameters.values())
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


def call_build(build: Callable[..., Any], mesh: Any, config: PlanConfig) -> tuple[Callable[..., Any], tuple, Any]:
    """``(step, args, params)`` from the builder, checked (``params`` ``None`` unless it returned them)."""
    out = build(mesh, config) if takes_config(build) else build(mesh)
    if not (isinstance(out, tuple) and len(out) in (2, 3) and callable(out[0])
            and isinstance(out[1], (tuple, list))):
        raise ValueError(
            "A plan builder returns (step, args) or (step, args, params): a function, the tuple of its abstract "
            f"arguments and optionally the FSDPUnit tree among them; {getattr(build, '__qualname__', build)} "
            f"returned {type(out).__name__}" + (f" of length {len(out)}" if isinstance(out, tuple) else "") + "."
        )
    return out[0], tuple(out[1]), (out[2] if len(out) == 3 else None)
