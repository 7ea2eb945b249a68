"""The state of one training step: the one object a step creates and passes down.

[Note: step state] Outside a step (the global view) a unit's leaves are global padded
arrays. While :func:`jshard.value_and_grad` traces its ``shard_map`` body (the local view)
they are this device's shards, and gathering them is the step's business. Everything that
lives for that one step is held by one :class:`StepState`, created by the step and passed
down as an argument: which units take part and how each reshards after forward
(:class:`UnitStep`, keyed by the identity of the unit's meta, which travels as the unit's
aux data through every trace), the step-wide modes, what is gathered right now
(:class:`Held`, with a :class:`ShardedState`), and the adapter's own index of where its
values live (the NNX model merged in the step, the Linen units by scope path). Units keep
only their static facts (``UnitMeta``); a unit whose meta the step does not hold was not
passed to it.

The user's code between the step and jshard (``js.unshard(unit)``, ``js.scan``, an NNX
module's ``__call__``, a Linen ``apply``) has no argument to carry the state, so the step
makes it *active* for the duration of the trace (:func:`stepping`), and those entry points
read it with :func:`active_step`. That is the one context variable of the step.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any, Generic, TypeVar

from jshard._sharding.mesh import MeshAxes

K = TypeVar("K")
V = TypeVar("V")


class IdentityMap(MutableMapping, Generic[K, V]):
    """A dict keyed by object identity that keeps its keys alive (Flax's ``RefMap``).

    Example:
      >>> from jshard._sharding.step_state import IdentityMap
      >>> a, b = [1], [1]  # equal, not the same object
      >>> m = IdentityMap(); m[a] = "a"
      >>> a in m, b in m, m[a]
      (True, False, 'a')
    """

    def __init__(self) -> None:
        self._items: dict[int, tuple[K, V]] = {}

    def __getitem__(self, key: K) -> V:
        return self._items[id(key)][1]

    def __setitem__(self, key: K, value: V) -> None:
        self._items[id(key)] = (key, value)

    def __delitem__(self, key: K) -> None:
        del self._items[id(key)]

    def __iter__(self) -> Iterator[K]:
        return (key for key, _ in self._items.values())

    def __len__(self) -> int:
        return len(self._items)


class ShardedState(enum.Enum):
    """Where a unit's parameters are, inside the step (FSDP2's ``ShardedState``).

    ``SHARDED``: the unit holds this device's shards. ``PREFETCHED``: gathered ahead of its
    forward by the unit before it. ``FORWARD``: gathered for its own forward, which is running.
    ``UNSHARDED``: gathered by an explicit ``unshard()``, kept until ``reshard()``.
    """

    SHARDED = "sharded"
    PREFETCHED = "prefetched"
    FORWARD = "forward"
    UNSHARDED = "unsharded"


@dataclasses.dataclass
class Held:
    """Gathered parameters of one unit: its :class:`ShardedState` and what to put back
    (``(holder, shard)`` pairs an adapter restores on reshard)."""

    state: ShardedState
    saved: list[tuple[Any, Any]]


@dataclasses.dataclass(frozen=True)
class UnitStep:
    """How one unit takes part in the step: ``reshard_after_forward`` resolved (``None`` in
    the policy: ``False`` for a root, ``True`` otherwise) and whether it is a root."""

    reshard_after_forward: bool | int
    root: bool


NOT_IN_STEP = (
    "js.unshard got a unit that was not passed to this step (units must be part of the `sharded` "
    "argument of the grad function, not closed over); pass it in `sharded`."
)


@dataclasses.dataclass(eq=False)
class StepState:
    """What one step knows while it traces (see [Note: step state]).

    ``units``: the step's units by the identity of their metas. ``remat_policy``: the
    step's ``jax.checkpoint`` policy (see [Note: nested remat]). ``skip_all_reduce``:
    gradients are not all-reduced over replicate axes (the step does it once, after
    accumulating microbatches). ``pregathered``: units already hold full parameters
    (gradient sync deferred to the end of the step). ``held``: what is gathered right now,
    keyed by whatever holds the values (an NNX module, a Linen scope path). ``adapter``:
    the Flax adapter's index of where its values live, ``None`` for the core step.
    """

    axes: MeshAxes
    remat_policy: Callable[..., Any]
    units: IdentityMap[Any, UnitStep]
    skip_all_reduce: bool = False
    pregathered: bool = False
    held: IdentityMap[Any, Held] = dataclasses.field(default_factory=IdentityMap)
    adapter: Any = None

    def unit(self, meta: Any, not_in_step: str = NOT_IN_STEP) -> UnitStep:
        """How the unit with ``meta`` takes part, or ``ValueError(not_in_step)`` for a unit
        the step was not given (closed over by the loss, or part of another model)."""
        found = self.units.get(meta)
        if found is None:
            raise ValueError(not_in_step)
        return found

    @contextlib.contextmanager
    def adapting(self, adapter: Any) -> Iterator[StepState]:
        """Record the adapter's index of its values while its loss is traced."""
        previous, self.adapter = self.adapter, adapter
        try:
            yield self
        finally:
            self.adapter = previous

    @property
    def holds_shards(self) -> bool:
        """Whether the step's units hold shards (not full parameters gathered up front), so
        that a leaf read from one without gathering is a shard, not the parameter."""
        return not self.pregathered


_ACTIVE: contextvars.ContextVar[StepState | None] = contextvars.ContextVar("jshard_step", default=None)


def active_step() -> StepState | None:
    """The step being traced, or ``None`` in the global view."""
    return _ACTIVE.get()


@contextlib.contextmanager
def stepping(state: StepState) -> Iterator[StepState]:
    """Make ``state`` the active step while the user's loss is traced."""
    token = _ACTIVE.set(state)
    try:
        yield state
    finally:
        _ACTIVE.reset(token)
