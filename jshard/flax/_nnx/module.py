"""``FSDPModule``: the class every sharded NNX module gets, with FSDP2's module controls.

Controls that are policy data in jshard (``FullyShardPolicy`` fields) replace the policy
in the module's unit meta; step-wide ones (gradient sync, all-reduce, reshard after
backward) are kept in its :class:`UnitState` and read by the step. Both are static
attributes: the next ``nnx.jit`` call retraces with them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from flax import nnx

from jshard._sharding.comm_hooks import AllGather, AllReduce, ReduceScatter
from jshard._sharding.fully_shard import gather_own, shard_own
from jshard._sharding.layout import pad_layers
from jshard._sharding.mesh import check_reshard_group
from jshard._sharding.step_state import Held, ShardedState, active_step
from jshard.flax._nnx.forward import gather_module, restore
from jshard.flax._nnx.graph import build_unit, own_variables, set_unit_state, sharded_modules, unit_state
from jshard.flax._nnx.step_context import current_step
from jshard.flax._paths import Path


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``; JAX dispatch is already asynchronous.

    Example:
      >>> from flax import nnx
      >>> from jshard.flax import nnx as jnnx
      >>> m = jnnx.fully_shard(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
      >>> m.unshard(async_op=True).wait()
    """

    def wait(self) -> None:
        """Nothing to wait for: the gathered values are ready when they are used.

        Example:
          >>> from jshard.flax.nnx import UnshardHandle
          >>> UnshardHandle().wait()
        """


class FSDPModule(nnx.Module):
    """Mixin of every module that ``jshard.flax.nnx.fully_shard`` sharded (FSDP2's ``FSDPModule``).

    Example:
      >>> import jshard as js
      >>> from flax import nnx
      >>> from jshard.flax import nnx as jnnx
      >>> model = jnnx.fully_shard(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
      >>> isinstance(model, jnnx.FSDPModule), type(model).__name__
      (True, 'FSDPLinear')
    """

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this module's own parameters and keep them gathered until :meth:`reshard`.

        Outside the step the Params become full, replicated arrays (for evaluation or
        export; calls then run unchanged). Inside the step the gather happens now and
        later calls of the module use it instead of gathering again.

        Example:
          >>> import jax.numpy as jnp
          >>> from flax import nnx
          >>> from jshard.flax import nnx as jnnx
          >>> model = jnnx.fully_shard(nnx.Linear(3, 5, rngs=nnx.Rngs(0)))
          >>> model.kernel.get_value().shape  # padded to the 8 devices
          (8, 5)
          >>> _ = model.unshard()
          >>> model(jnp.ones((2, 3))).shape
          (2, 5)
          >>> model.reshard(); model.kernel.get_value().shape
          (8, 5)
        """
        if active_step() is None:
            _unshard_global(self)
        else:
            step = current_step(self)
            if self not in step.held:
                step.held[self] = Held(ShardedState.UNSHARDED, gather_module(self, step))
            else:
                step.held[self].state = ShardedState.UNSHARDED
        return UnshardHandle() if async_op else None

    def reshard(self) -> None:
        """Put this module's shards back (the inverse of :meth:`unshard`).

        Example:
          >>> from flax import nnx
          >>> from jshard.flax import nnx as jnnx
          >>> m = jnnx.fully_shard(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
          >>> _ = m.unshard(); m.reshard(); m.kernel.get_value().shape
          (8, 2)
        """
        if active_step() is None:
            _reshard_global(self)
            return
        held = current_step(self).held.pop(self, None)
        if held is not None:
            restore(held.saved)

    def set_reshard_after_forward(self, reshard_after_forward: bool | int, recurse: bool = True) -> None:
        """Free gathered parameters after forward (``True``) or keep them for backward.

        Updates ``FullyShardPolicy.reshard_after_forward`` of this module's unit (and of
        every sharded module below it when ``recurse``).

        Example:
          >>> from flax import nnx
          >>> from jshard.flax import nnx as jnnx
          >>> model = jnnx.fully_shard(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
          >>> model.set_reshard_after_forward(False); model.policy.reshard_after_forward
          False
        """
        for module in _targets(self, recurse):
            _update_policy(module, reshard_after_forward=reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False``: gather once per step and keep the parameters over all microbatches.

        In JAX the gradient of a value gathered once is reduced once, so this selects the
        step's gather-once mode (the same as ``set_requires_gradient_sync(False)``). It is
        a property of the whole step: set it on the root.

        Example:
          >>> from flax import nnx
          >>> from jshard.flax import nnx as jnnx
          >>> m = jnnx.fully_shard(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
          >>> m.set_reshard_after_backward(False); m.fsdp_state.reshard_after_backward
          False
        """
        for module in _targets(self, recurse):
            _update_state(module, reshard_after_backward=_as_bool("reshard_after_backward", reshard_after_backward))

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: accumulate unsharded gradients over microbatches, reduce once per step.

        Example:
          >>> from flax import nnx
          >>> from jshard.flax import nnx as jnnx
          >>> m = jnnx.fully_shard(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
          >>> m.set_requires_gradient_sync(False); m.fsdp_state.requires_gradient_sync
          False
        """
        for module in _targets(self, recurse):
            _update_state(module, requires_gradient_sync=_as_bool("requires_gradient_sync", requires_gradient_sync))

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """``False``: with HSDP, all-reduce over replicas once per step, not per microbatch.

        Example:
          >>> from flax import nnx
          >>> from jshard.flax import nnx as jnnx
          >>> m = jnnx.fully_shard(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
          >>> m.set_requires_all_reduce(False); m.fsdp_state.requires_all_reduce
          False
        """
        for module in _targets(self, recurse):
            _update_state(module, requires_all_reduce=_as_bool("requires_all_reduce", requires_all_reduce))

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's reduced gradients by ``factor`` instead of the device count.

        Example:
          >>> from flax import nnx
          >>> from jshard.flax import nnx as jnnx
          >>> m = jnnx.fully_shard(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
          >>> m.set_gradient_divide_factor(16.0); m.policy.gradient_divide_factor
          16.0
        """
        _update_policy(self, gradient_divide_factor=factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Split the division around the summing collective (pre- and post-scale).

        Example:
          >>> from flax import nnx
          >>> from jshard.flax import nnx as jnnx
          >>> m = jnnx.fully_shard(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
          >>> m.set_force_sum_reduction_for_comms(True); m.policy.force_sum_reduction_for_comms
          True
        """
        _update_policy(self, force_sum_reduction_for_comms=enable)

    def set_custom_all_gather(self, comm: AllGather) -> None:
        """Replace this unit's all-gather: a :class:`jshard.AllGather`, ``comm(shard, axis_names, dim) -> full``.

        Example:
          >>> from flax import nnx
          >>> from jshard.flax import nnx as jnnx
          >>> m = jnnx.fully_shard(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
          >>> import jshard as js
          >>> m.set_custom_all_gather(js.int8_all_gather); m.policy.custom_all_gather is js.int8_all_gather
          True
        """
        _update_policy(self, custom_all_gather=comm)

    def set_custom_reduce_scatter(self, comm: ReduceScatter) -> None:
        """Replace this unit's reduce-scatter: a :class:`jshard.ReduceScatter`, ``comm(grad, axes, dim) -> shard``.

        Example:
          >>> from flax import nnx
          >>> from jshard.flax import nnx as jnnx
          >>> m = jnnx.fully_shard(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
          >>> import jshard as js
          >>> m.set_custom_reduce_scatter(js.collectives.reduce_scatter)
          >>> m.policy.custom_reduce_scatter is js.collectives.reduce_scatter
          True
        """
        _update_policy(self, custom_reduce_scatter=comm)

    def set_all_reduce_hook(self, hook: AllReduce, *, stream: Any = None) -> None:
        """Replace the all-reduce over replicate axes: a :class:`jshard.AllReduce`, ``hook(grad_shard, axes)``.

        Example:
          >>> from flax import nnx
          >>> from jshard.flax import nnx as jnnx
          >>> m = jnnx.fully_shard(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
          >>> m.set_all_reduce_hook(lambda g, axes: g); m.policy.all_reduce_hook is not None
          True
        """
        if stream is not None:
            raise ValueError("`stream` is not applicable in JAX (XLA schedules collectives); pass only `hook`.")
        _update_policy(self, all_reduce_hook=hook)

    def set_modules_to_forward_prefetch(self, modules: Sequence[FSDPModule]) -> None:
        """Gather ``modules`` when this module's forward starts (after its own gather).

        The targets are kept as their paths in the model (so the model's graphdef does not
        depend on which objects they were): pass sub-modules of the model this one belongs
        to, after :func:`fully_shard` was applied to its root.

        Example:
          >>> from flax import nnx
          >>> from jshard.flax import nnx as jnnx
          >>> class Two(nnx.Module):
          ...     def __init__(self, rngs):
          ...         self.blocks = nnx.List([nnx.Linear(2, 2, rngs=rngs) for _ in range(2)])
          >>> model = Two(nnx.Rngs(0))
          >>> for block in model.blocks:
          ...     _ = jnnx.fully_shard(block)
          >>> model = jnnx.fully_shard(model)
          >>> model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1]])
          >>> model.blocks[0].fsdp_state.forward_prefetch
          (('blocks', 1),)
        """
        _update_state(self, forward_prefetch=_paths(modules))

    def set_modules_to_backward_prefetch(self, modules: Sequence[FSDPModule]) -> None:
        """Record the modules to re-gather during this module's backward (a scheduling hint).

        JAX places backward re-gathers itself (remat) and XLA schedules them; see
        ``docs/flax.md``. The list is validated and kept in ``backward_prefetch``.

        Example:
          >>> from flax import nnx
          >>> from jshard.flax import nnx as jnnx
          >>> model = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), nnx.Linear(2, 2, rngs=nnx.Rngs(1)))
          >>> for layer in model.layers:
          ...     _ = jnnx.fully_shard(layer)
          >>> model = jnnx.fully_shard(model)
          >>> model.layers[1].set_modules_to_backward_prefetch([model.layers[0]])
          >>> model.layers[1].fsdp_state.backward_prefetch
          (('layers', 0),)
        """
        _update_state(self, backward_prefetch=_paths(modules))

    @property
    def policy(self):
        """This module's unit policy (a :class:`jshard.FullyShardPolicy`).

        Example:
          >>> from flax import nnx
          >>> from jshard.flax import nnx as jnnx
          >>> m = jnnx.fully_shard(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
          >>> m.policy.reshard_after_forward is None
          True
        """
        return unit_state(self).meta.policy

    @property
    def fsdp_state(self):
        """The static FSDP facts of this module, read-only (unit meta, step controls, prefetch lists).

        Example:
          >>> from flax import nnx
          >>> from jshard.flax import nnx as jnnx
          >>> m = jnnx.fully_shard(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
          >>> m.fsdp_state.requires_gradient_sync, m.fsdp_state.name
          (True, '')
        """
        return unit_state(self)


def _as_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be a bool, got {value!r}.")
    return value


def _targets(module: Any, recurse: bool) -> list[Any]:
    return [m for _, m in sharded_modules(module)] if recurse else [module]


def _update_state(module: Any, **changes: Any) -> None:
    set_unit_state(module, dataclasses.replace(unit_state(module), **changes))


def _update_policy(module: Any, **changes: Any) -> None:
    state = unit_state(module)
    policy = dataclasses.replace(state.meta.policy, **changes)
    check_reshard_group(state.meta.axes, policy)
    _update_state(module, meta=dataclasses.replace(state.meta, policy=policy))


def _paths(modules: Sequence[Any]) -> tuple[Path, ...]:
    """The paths of prefetch targets in their model (see ``UnitState``)."""
    out = []
    for i, m in enumerate(modules):
        if unit_state(m) is None:
            raise ValueError(
                f"modules[{i}] ({type(m).__name__}) is not fully sharded: pass modules returned by "
                "jshard.flax.nnx.fully_shard."
            )
        if not unit_state(m).path:
            raise ValueError(
                f"modules[{i}] ({type(m).__name__}) is the outermost sharded module of its model, so it has no path "
                "in a model to be found by: pass sub-modules, after jshard.flax.nnx.fully_shard was applied to the "
                "model's root."
            )
        out.append(unit_state(m).path)
    return tuple(out)


def _set_own_values(module: Any, values: list[Any]) -> None:
    """Write a unit's own entries (gathered or sharded) into the module's Params (sub-units skipped)."""
    state = unit_state(module)
    for (_, is_sub), param, value in zip(state.entries, own_variables(module), values, strict=True):
        if not is_sub:
            param.set_value(value)


def _unshard_global(module: Any) -> None:
    """The module's own Params gathered in place (the core's global gather of its unit)."""
    if unit_state(module).unsharded:
        return
    _set_own_values(module, gather_own(build_unit(module)))
    _update_state(module, unsharded=True)


def _reshard_global(module: Any) -> None:
    """The module's own Params sharded again in place (the core's placement of its unit's leaves)."""
    state = unit_state(module)
    if not state.unsharded:
        return
    full = [x if layout is None or layout.ignored else pad_layers(x, layout)  # a staged stack's L layers to its slots
            for x, layout in zip(build_unit(module).own_entries(), state.meta.layouts, strict=True)]
    _set_own_values(module, shard_own(state.meta, full))
    _update_state(module, unsharded=False)
