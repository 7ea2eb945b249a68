"""Memory-kind moves for CPU offload, inside ``jit``.

[Note: offload] With ``CPUOffloadPolicy`` a unit's shards, their gradients and (through
Optax's ``tree_map``) the optimizer state live in host memory. Inside the step each
shard moves to the device right before its gather (inside the scan body for stacked
layers, so one layer at a time), and each reduced gradient moves back to host in its
own backward. The optimizer update (``offload_optimizer``) then runs either on the host (no device memory, host
compute) or on the device (fast compute, the state and gradients cross the bus).
"""

from __future__ import annotations

import jax


def to_device(x: jax.Array, offloaded: bool) -> jax.Array:
    """``x`` in device memory, if its unit is offloaded (inside ``jit``)."""
    return jax.device_put(x, jax.memory.Space.Device) if offloaded else x


def to_host(x: jax.Array, offloaded: bool) -> jax.Array:
    """``x`` in host memory, if its unit is offloaded (inside ``jit``)."""
    return jax.device_put(x, jax.memory.Space.Host) if offloaded else x
