"""The NNX step context: which sharded modules hold gathered parameters right now.

Set by ``jshard.flax.nnx.value_and_grad`` while it traces the loss inside the core's
local view. Keys are ``id(module)`` of modules made inside that trace (``nnx.merge``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

from jshard.flax._nnx.graph import describe, module_at
from jshard.flax._paths import Path


@dataclasses.dataclass
class Held:
    """Gathered parameters of one module: ``kind`` is ``"forward"`` (during its call),
    ``"prefetch"`` (gathered early by another module) or ``"explicit"`` (``unshard()``);
    ``saved`` are ``(param, shard)`` pairs to put back."""

    kind: str
    saved: list[tuple[Any, Any]]


@dataclasses.dataclass
class StepContext:
    """``gathered``: ``id(module) -> Held`` for the modules holding gathered parameters."""

    root: Any
    gathered: dict[int, Held] = dataclasses.field(default_factory=dict)

    def module_at(self, path: Path, requester: Any) -> Any:
        """A prefetch target: the sharded module at ``path`` in ``requester``'s model."""
        return module_at(self.root, path, requester)


_CURRENT: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar("jshard_nnx_step", default=None)


def active_step() -> StepContext | None:
    return _CURRENT.get()


def current_step(module: Any) -> StepContext:
    step = _CURRENT.get()
    if step is None:
        raise RuntimeError(
            f"{describe(module)} was called inside a jshard step that jshard.flax.nnx did not start; "
            "use jshard.flax.nnx.value_and_grad(loss_fn)(model, batch) for NNX modules."
        )
    return step


@contextlib.contextmanager
def step_context(root: Any) -> Iterator[StepContext]:
    token = _CURRENT.set(StepContext(root))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)
