"""What the installed jax does where releases differ, asked of jax itself (not of its version)."""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

ZEROS_DROP_THE_SPLIT = (
    "jax 0.12 (0.12.0.1 measured) drops an Explicit split from what `jnp.zeros_like` makes inside `jit` "
    "outside a mesh context (its creation ops ignore their out sharding there), so plain Optax's state "
    "made beside born-sharded parameters is replicated: use js.shard_optimizer (docs/born_sharded.md)")


@functools.cache
def zeros_follow_explicit_types() -> bool:
    """Whether ``jnp.zeros_like`` of a value split over an ``Explicit`` axis in its type, inside ``jit``
    and outside any mesh context, is split too (jax 0.10: yes; 0.12.0.1: no)."""
    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",), axis_types=(AxisType.Explicit,))

    def placed_and_zeros():
        x = jax.device_put(jnp.ones(jax.device_count()), NamedSharding(mesh, PartitionSpec("fsdp")))
        return x, jnp.zeros_like(x)  # x made in the program, as a born-sharded leaf is

    made = jax.jit(placed_and_zeros)()[1].sharding
    return isinstance(made, NamedSharding) and made.spec == PartitionSpec("fsdp")
