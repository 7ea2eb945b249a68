"""What the installed jax and libtpu do where releases differ: asked of jax where it can say, else read
from the version of libtpu, whose XLA:TPU the TPU tests' figures were measured with."""

import functools
import importlib.metadata

import jax
import jax.numpy as jnp
import pytest
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


def libtpu_version() -> str:
    """The installed libtpu's version ("" where it is absent)."""
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return ""


# The libtpu the XLA:TPU figures pinned by the TPU tests were measured with (jax 0.10.2's).
MEASURED_LIBTPU = "0.0.42.1"


def on_other_libtpu() -> bool:
    """Whether another libtpu than :data:`MEASURED_LIBTPU` is installed (jax 0.12.0.1 brings 0.0.50.1)."""
    return libtpu_version() != MEASURED_LIBTPU


def other_libtpu_reason(what: str) -> str:
    """Why a figure of :data:`MEASURED_LIBTPU` is not met here; ``what``: how the installed libtpu differs."""
    return f"measured on libtpu {MEASURED_LIBTPU}; libtpu {libtpu_version()}: {what}"


def other_libtpu(what: str) -> pytest.MarkDecorator:
    """An expected failure :func:`on_other_libtpu`: the XLA:TPU figure the test pins is that compiler's;
    ``what``: how the other differs, as measured. Not strict: a case that holds there too passes."""
    return pytest.mark.xfail(on_other_libtpu(), strict=False, reason=other_libtpu_reason(what))
