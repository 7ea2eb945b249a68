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

from jshard.flax._nnx.graph import describe, sharded_modules, unit_state


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

    def module_by_uid(self, uid: int, requester: Any) -> Any:
        for _, module in sharded_modules(self.root):
            if unit_state(module).uid == uid:
                return module
        raise ValueError(
            f"{describe(requester)} prefetches a module that is not part of the model in this step; "
            "pass modules of the same model to set_modules_to_forward_prefetch."
        )


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
