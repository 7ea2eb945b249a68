"""The communication hooks a :class:`~jshard.FullyShardPolicy` takes, as typed protocols.

As FSDP2's ``AllGather`` and ``ReduceScatter`` (``torch/distributed/fsdp/_fully_shard/_fsdp_api.py``),
each hook is one call the step makes in the local view (inside its ``shard_map``, where axis
names are bound) instead of its own collective. A function with the signature conforms (the
built-ins :func:`jshard.collectives.all_gather`, :func:`jshard.int8_all_gather`,
:func:`jshard.float8_all_gather`, :func:`jshard.collectives.reduce_scatter`,
:func:`jshard.collectives.all_reduce` do), and so does an object with such a ``__call__``.
``FullyShardPolicy`` checks when it is built that each hook takes these arguments.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

import jax


@runtime_checkable
class AllGather(Protocol):
    """Gathers one leaf over the shard axes: ``FullyShardPolicy(custom_all_gather=...)``.

    Called as ``hook(shard, axes, dim)`` with this device's shard (padding rows included,
    already cast to ``param_dtype``), the shard axes' names and the dim the leaf is split
    on; returns the padded leaf in the shard's dtype: ``dim`` concatenated over ``axes`` in
    device order, as :func:`jshard.collectives.all_gather` does. What goes over the wire is
    the hook's choice (:func:`jshard.int8_all_gather` sends int8 and scales).

    Example:
      >>> import jax.numpy as jnp, jshard as js
      >>> class Bfloat16Wire:  # gathers in bfloat16, returns the shard's dtype
      ...     def __call__(self, shard, axes, dim):
      ...         wire = js.collectives.all_gather(shard.astype(jnp.bfloat16), axes, dim)
      ...         return wire.astype(shard.dtype)
      >>> isinstance(Bfloat16Wire(), js.AllGather), isinstance(js.int8_all_gather, js.AllGather)
      (True, True)
      >>> policy = js.FullyShardPolicy(custom_all_gather=Bfloat16Wire())
    """

    def __call__(self, shard: jax.Array, axes: tuple[str, ...], dim: int, /) -> jax.Array:
        """The padded leaf gathered from every device's ``shard`` along ``dim`` over ``axes``."""


@runtime_checkable
class ReduceScatter(Protocol):
    """Sums a gradient over the shard axes and keeps this device's chunk:
    ``FullyShardPolicy(custom_reduce_scatter=...)``.

    Called as ``hook(grad, axes, dim)`` with this device's full gradient of one leaf (padded,
    in ``reduce_dtype``, already divided by the pre-scale), the shard axes' names and the
    dim the leaf is split on; returns this device's chunk of the sum along ``dim``, as
    :func:`jshard.collectives.reduce_scatter` does.

    Example:
      >>> import jax, jshard as js
      >>> def psum_scatter(grad, axes, dim):
      ...     return jax.lax.psum_scatter(grad, axes, scatter_dimension=dim, tiled=True)
      >>> isinstance(psum_scatter, js.ReduceScatter)
      True
      >>> policy = js.FullyShardPolicy(custom_reduce_scatter=psum_scatter)
    """

    def __call__(self, grad: jax.Array, axes: tuple[str, ...], dim: int, /) -> jax.Array:
        """This device's chunk of ``grad`` summed over ``axes``, along ``dim``."""


@runtime_checkable
class AllReduce(Protocol):
    """Sums a reduced gradient shard over the replicate axes (HSDP):
    ``FullyShardPolicy(all_reduce_hook=...)``.

    Called as ``hook(grad_shard, axes)`` after the reduce-scatter, with the replicate axes'
    names (``()`` on a mesh without them, where the built-in is the identity); returns the
    sum over ``axes``, as :func:`jshard.collectives.all_reduce` does.

    Example:
      >>> import jshard as js
      >>> def all_reduce(grad_shard, axes):
      ...     return js.collectives.all_reduce(grad_shard, axes)
      >>> isinstance(all_reduce, js.AllReduce)
      True
      >>> policy = js.FullyShardPolicy(all_reduce_hook=all_reduce)
    """

    def __call__(self, grad_shard: jax.Array, axes: tuple[str, ...], /) -> jax.Array:
        """``grad_shard`` summed over ``axes``."""


HOOKS = {"custom_all_gather": (AllGather, ("shard", "axes", "dim")),
         "custom_reduce_scatter": (ReduceScatter, ("grad", "axes", "dim")),
         "all_reduce_hook": (AllReduce, ("grad_shard", "axes"))}


def check_hook(name: str, hook: Any) -> None:
    """Raise unless ``hook`` (a policy field ``name``) is ``None`` or callable with the protocol's arguments."""
    if hook is None:
        return
    protocol, arguments = HOOKS[name]
    if not isinstance(hook, protocol):
        raise ValueError(f"`{name}` must be a js.{protocol.__name__} (a callable) or None, got {hook!r}.")
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):  # no signature to read (some builtins): called as it is
        return
    try:
        signature.bind(*arguments)
    except TypeError as e:
        raise ValueError(
            f"`{name}` must be called as hook({', '.join(arguments)}), as a js.{protocol.__name__} is, but "
            f"{getattr(hook, '__name__', type(hook).__name__)}{signature} cannot: {e}. Give it these positional "
            "arguments (more are fine if they have defaults)."
        ) from None
