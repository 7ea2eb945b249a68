"""The NNX adapter's part of the step state: the model merged inside the step.

``jshard.flax.nnx.value_and_grad`` rebuilds the model (``nnx.merge``) inside the core step
and records it as the step's ``adapter`` ([Note: step state]); what each module holds
gathered is the step's ``held`` map, keyed by the module objects made in that trace.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jshard._sharding.step_state import StepState, active_step
from jshard.flax._nnx.graph import describe, module_at
from jshard.flax._paths import Path

NOT_IN_STEP = (
    "{module} was called in a step that it is not part of: pass the model that contains it to the "
    "grad function (do not close over sharded modules)."
)


@dataclasses.dataclass(frozen=True, eq=False)
class NnxStep:
    """The model merged in the step, where prefetch targets are looked up; ``pipeline_loss``:
    a 1F1B pipeline's ``loss`` is being traced, where no module may gather ([Note: NNX pipeline])."""

    root: Any
    pipeline_loss: bool = False

    def module_at(self, path: Path, requester: Any) -> Any:
        """A prefetch target: the sharded module at ``path`` in ``requester``'s model."""
        return module_at(self.root, path, requester)


def nnx_step() -> StepState | None:
    """The active step when ``jshard.flax.nnx`` started it, else ``None``."""
    step = active_step()
    return step if step is not None and isinstance(step.adapter, NnxStep) else None


def current_step(module: Any) -> StepState:
    """The active NNX step, or a clear error for a step ``jshard.flax.nnx`` did not start."""
    step = nnx_step()
    if step is None:
        raise RuntimeError(
            f"{describe(module)} was called inside a jshard step that jshard.flax.nnx did not start; "
            "use jshard.flax.nnx.value_and_grad(loss_fn)(model, batch) for NNX modules."
        )
    return step
