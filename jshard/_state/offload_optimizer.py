"""``offload_optimizer``: an Optax update on host-resident (offloaded) state, on host or device.

See [Note: offload] in ``jshard/_step/offload.py``.
"""

from __future__ import annotations

import inspect
from typing import Any, Literal

import jax
import optax
from jax.experimental.compute_on import compute_on

from jshard._step.offload import to_device, to_host


def _on_host_compute(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` computed on the host; outputs stay in their inputs' memory spaces.

    jax 0.10 and 0.11 take ``compute_on`` as a context manager; later releases as a
    function transform that needs the outputs' memory spaces.
    """
    if "out_memory_spaces" in inspect.signature(compute_on).parameters:
        spaces = jax.tree.map(lambda x: jax.typeof(x).memory_space, tuple(args[:2]))  # (updates, state) out
        return compute_on(fn, compute_type="device_host", out_memory_spaces=spaces)(*args)
    with compute_on("device_host"):
        return jax.jit(fn)(*args)


def _on_host(x: jax.Array) -> bool:
    return jax.typeof(x).memory_space == jax.memory.Space.Host


def offload_optimizer(tx: optax.GradientTransformation, compute: Literal["host", "device"] = "host"):
    """Run an Optax update on host-resident (offloaded) state, on the host or the device.

    ``"host"`` computes the update with ``compute_on("device_host")``: no device memory
    is used, but the host's compute is slower. ``"device"`` moves gradients, state and
    parameters to the device, updates there and moves the new state and the updates back:
    fast compute, at the cost of bus traffic and device memory for one copy of the state.
    Call the update inside ``jax.jit``.

    Args:
      tx: any Optax gradient transformation.
      compute: ``"host"`` or ``"device"``.

    Returns:
      A ``GradientTransformation`` with the same state.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jshard as js
      >>> policy = js.FullyShardPolicy(offload_policy=js.CPUOffloadPolicy())
      >>> params = js.fully_shard({"w": jnp.ones((8, 2))}, policy=policy)
      >>> tx = js.offload_optimizer(optax.sgd(0.1), compute="host")
      >>> state = tx.init(params)
      >>> updates, state = jax.jit(tx.update)(params, state, params)
      >>> updates["w"].sharding.memory_kind
      'pinned_host'
    """
    if compute not in ("host", "device"):
        raise ValueError(f"`compute` must be 'host' or 'device', got {compute!r}.")

    def update(updates: Any, state: Any, params: Any = None):
        if compute == "host":
            return _on_host_compute(tx.update, updates, state, params)
        on_host = jax.tree.map(_on_host, (updates, state))
        moved = jax.tree.map(lambda x: to_device(x, _on_host(x)), (updates, state, params))
        return jax.tree.map(to_host, tx.update(*moved), on_host)

    return optax.GradientTransformation(tx.init, update)
