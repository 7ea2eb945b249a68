"""Preemption: every process learns of a SIGTERM at the same step, so all save the same checkpoint.

[Note: preemption] Schedulers preempt a job by sending SIGTERM to its processes (to one,
or through a launcher to all) and killing them a grace period later. Saving a sharded
checkpoint takes every process, at the same step: a process that saves at step 12 while
another is already in step 13 would hang or write a torn checkpoint. In a
multi-process job JAX's preemption sync manager (started by ``jax.distributed.initialize``;
its notifier catches SIGTERM) makes that agreement: ``reached_preemption_sync_point(step)``
is true on every process at one step after any process got the signal; Orbax's
``CheckpointManager.reached_preemption`` is the same call. In one process a SIGTERM
handler sets a flag. The loop then saves, waits for the save, and exits with
:data:`PREEMPTED_EXIT`; the same command resumes from the latest checkpoint.
"""

from __future__ import annotations

import signal
import threading

import jax
from jax._src import distributed
from jax.experimental import multihost_utils

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: run the same command again to resume
_requested = threading.Event()
_installed: list[bool] = []


def _install_handler() -> None:
    """SIGTERM sets the flag in a one-process run (from the main thread only, as Python requires)."""
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, lambda signum, frame: _requested.set())
    _installed.append(True)


def reached_preemption(step: int) -> bool:
    """Whether to save and stop now: true on every process at the same step once any got SIGTERM.

    Call it at every step boundary, with the step number (increasing). In a one-process
    run the first call installs the SIGTERM handler.

    Example:
      >>> from jshard.launch import reached_preemption
      >>> reached_preemption(0)
      False
    """
    if jax.process_count() > 1 and distributed.global_state.preemption_sync_manager is not None:
        return bool(multihost_utils.reached_preemption_sync_point(step))
    _install_handler()
    return _requested.is_set()
