"""Which view code runs in: the global view, or the local view of a step being traced.

[Note: views] Outside a step (the global view) a unit's leaves are global padded arrays.
While :func:`jshard.value_and_grad` traces its ``shard_map`` body (the local view) they
are this device's shards, and :func:`jshard.unshard` all-gathers them just in time
instead. The context says which, and carries what the step decided for all its units.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from jshard._sharding.mesh import MeshAxes


@dataclasses.dataclass(frozen=True)
class LocalView:
    """What the step knows while tracing: its axes and its step-wide modes.

    ``remat_policy``: the step's ``jax.checkpoint`` policy (see [Note: nested remat]).
    ``skip_all_reduce``: gradients are not all-reduced over replicate axes (the step
    does it once, after accumulating microbatches). ``pregathered``: units already hold
    full parameters (gradient sync deferred to the end of the step). How each unit
    reshards after forward travels in its meta (``UnitMeta.step_reshard``).
    """

    axes: MeshAxes
    remat_policy: Callable[..., Any]
    skip_all_reduce: bool = False
    pregathered: bool = False


_CURRENT: contextvars.ContextVar[LocalView | None] = contextvars.ContextVar(
    "jshard_local_view", default=None
)


def current_view() -> LocalView | None:
    """The local view being traced, or ``None`` in the global view."""
    return _CURRENT.get()


@contextlib.contextmanager
def local_view(view: LocalView) -> Iterator[None]:
    token = _CURRENT.set(view)
    try:
        yield
    finally:
        _CURRENT.reset(token)
