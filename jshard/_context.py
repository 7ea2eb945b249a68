"""The local view: set while jshard traces a step's ``shard_map`` body.

Inside it, :func:`jshard.unshard` all-gathers a unit's shards just in time instead of
working on global arrays. The context also says how each unit reshards after forward
(``None`` resolves to ``False`` for root units, ``True`` for the others).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from jshard._mesh import MeshAxes
from jshard._remat import REMAT_POLICY


@dataclasses.dataclass(frozen=True)
class LocalView:
    """What the step knows while tracing: its axes and each unit's resolved policy.

    ``reshard`` maps ``id(unit.meta)`` to the resolved ``reshard_after_forward``.
    ``skip_all_reduce``: gradients are not all-reduced over replicate axes (the step
    does it once, after accumulating microbatches). ``pregathered``: units already hold
    full parameters (gradient sync deferred to the end of the step). ``remat_policy``:
    the step's ``jax.checkpoint`` policy (see [Note: nested remat] in ``_remat.py``).
    """

    axes: MeshAxes
    reshard: dict[int, bool | int]
    skip_all_reduce: bool = False
    pregathered: bool = False
    remat_policy: Callable[..., Any] = REMAT_POLICY


_CURRENT: contextvars.ContextVar[LocalView | None] = contextvars.ContextVar(
    "jshard_local_view", default=None
)


def current() -> LocalView | None:
    """The local view being traced, or ``None`` in the global view."""
    return _CURRENT.get()


@contextlib.contextmanager
def local_view(view: LocalView) -> Iterator[None]:
    token = _CURRENT.set(view)
    try:
        yield
    finally:
        _CURRENT.reset(token)
