"""Joining a multi-process JAX job: under ``jshard.launch``, on a cluster, or alone.

[Note: multi-process timeouts] JAX's coordination service (started by
``jax.distributed.initialize``) is what stops a job from hanging when a process dies:
each process sends heartbeats, and once one has been silent for
``heartbeat_timeout_seconds`` the service terminates every other process with
"Terminating process because the JAX distributed service detected fatal errors".
A process that is blocked in a collective waiting for a dead peer is released only
that way. A process that raises instead would, at exit, wait up to
``shutdown_timeout_seconds`` at the shutdown barrier for peers that are themselves
blocked in a collective waiting for it; so :func:`initialize` makes an uncaught
exception exit the process at once (``exit_on_error``), and the others follow after
the heartbeat timeout. ``docs/multihost.md`` has the table of timeouts.
"""

from __future__ import annotations

import inspect
import os
import sys
import types
import warnings
from typing import Any

import jax
from jax._src import xla_bridge

from jshard._multiprocess.watchdog import CLUSTER_TIMEOUT_S, LAUNCHER_TIMEOUT_S, start_watchdog, timeout_from_env

_USED_BEFORE = (
    "jshard.launch.initialize() must run before any JAX computation or jax.devices() call: those "
    "start a one-process backend, and JAX cannot join a multi-process job afterwards. Call it first "
    "thing in the script (right after the imports)."
)

COORDINATOR = "JSHARD_COORDINATOR_ADDRESS"
NUM_PROCESSES = "JSHARD_NUM_PROCESSES"
PROCESS_ID = "JSHARD_PROCESS_ID"
DEVICES_PER_PROCESS = "JSHARD_DEVICES_PER_PROCESS"
HEARTBEAT_TIMEOUT = "JSHARD_HEARTBEAT_TIMEOUT"
INIT_TIMEOUT = "JSHARD_INIT_TIMEOUT"
SHUTDOWN_TIMEOUT = "JSHARD_SHUTDOWN_TIMEOUT"
DISTRIBUTED = "JSHARD_DISTRIBUTED"

# Environment variables that say "this process is one of several" on clusters that
# ``jax.distributed.initialize()`` detects by itself (name -> minimum value, or None: present).
_CLUSTER_MARKERS: dict[str, int | None] = {
    "JAX_COORDINATOR_ADDRESS": None,
    "SLURM_NTASKS": 2,
    "OMPI_COMM_WORLD_SIZE": 2,
    "MEGASCALE_COORDINATOR_ADDRESS": None,
}


def under_launcher() -> bool:
    """Whether this process was started by ``python -m jshard.launch``."""
    return COORDINATOR in os.environ


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"Environment variable {name}={value!r} must be an integer (seconds or a count).") from None


def _on_cluster() -> bool:
    flag = os.environ.get(DISTRIBUTED)
    if flag is not None:
        return flag not in ("", "0", "false", "False")
    for name, minimum in _CLUSTER_MARKERS.items():
        if name in os.environ and (minimum is None or (_env_int(name) or 0) >= minimum):
            return True
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return "," in hosts


def _timeouts(heartbeat: int | None, init: int | None, shutdown: int | None) -> dict[str, int]:
    chosen = {
        "heartbeat_timeout_seconds": heartbeat if heartbeat is not None else _env_int(HEARTBEAT_TIMEOUT),
        "initialization_timeout": init if init is not None else _env_int(INIT_TIMEOUT),
        "shutdown_timeout_seconds": shutdown if shutdown is not None else _env_int(SHUTDOWN_TIMEOUT),
    }
    accepted = inspect.signature(jax.distributed.initialize).parameters
    unknown = [k for k, v in chosen.items() if v is not None and k not in accepted]
    if unknown:  # the names are those of jax 0.10; another release may lack one
        warnings.warn(f"jax.distributed.initialize of jax {jax.__version__} has no {unknown}; ignoring them.",
                      stacklevel=3)
    return {k: v for k, v in chosen.items() if v is not None and k in accepted}


def _check_launcher_env() -> None:
    missing = [name for name in (NUM_PROCESSES, PROCESS_ID) if _env_int(name) is None]
    if under_launcher() and missing:
        raise ValueError(
            f"{COORDINATOR} is set but {' and '.join(missing)} not: start the processes with "
            "`python -m jshard.launch`, or set all three (and JSHARD_DEVICES_PER_PROCESS) in each process."
        )


def _launcher_args() -> dict[str, Any]:
    devices = _env_int(DEVICES_PER_PROCESS)
    if devices is not None:  # simulated CPU devices (the launcher); else the machine's accelerators
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.config.update("jax_num_cpu_devices", devices)
    return {
        "coordinator_address": os.environ[COORDINATOR],
        "num_processes": _env_int(NUM_PROCESSES),
        "process_id": _env_int(PROCESS_ID),
    }


UNCAUGHT = "[jshard] process {process_id}: uncaught {kind}; "  # the launcher reads it to name who failed first


def _exit_at_once_on_uncaught(process_id: int) -> None:
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: types.TracebackType | None) -> None:
        previous(kind, value, tb)
        print(
            UNCAUGHT.format(process_id=process_id, kind=kind.__name__) + "exiting now instead of waiting at "
            "JAX's shutdown barrier (the other processes stop after the heartbeat timeout, or at once "
            "under jshard.launch).",
            file=sys.stderr,
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    sys.excepthook = hook


def initialize(
    *,
    distributed: bool | None = None,
    heartbeat_timeout_s: int | None = None,
    initialization_timeout_s: int | None = None,
    shutdown_timeout_s: int | None = None,
    exit_on_error: bool = True,
    watchdog_timeout_s: float | None = None,
) -> bool:
    """Join the multi-process job this process belongs to, if any; call it before any JAX work.

    - Under ``python -m jshard.launch`` (``JSHARD_COORDINATOR_ADDRESS``,
      ``JSHARD_NUM_PROCESSES``, ``JSHARD_PROCESS_ID`` set): that coordinator, count and id;
      with ``JSHARD_DEVICES_PER_PROCESS`` (the launcher sets it) that many CPU devices
      with gloo collectives, else the machine's own devices.
    - On a cluster (``distributed=True``, ``JSHARD_DISTRIBUTED=1``, or SLURM / Open MPI /
      TPU-pod / ``JAX_COORDINATOR_ADDRESS`` environment variables): plain
      ``jax.distributed.initialize()``, which detects the rest.
    - Otherwise: nothing (one process); returns ``False``.

    Calling it again after it joined is a no-op. Timeouts left ``None`` come from the
    ``JSHARD_HEARTBEAT_TIMEOUT`` / ``JSHARD_INIT_TIMEOUT`` / ``JSHARD_SHUTDOWN_TIMEOUT``
    environment variables (the launcher sets them), else JAX's defaults (100 / 300 / 300 s).

    Args:
      distributed: ``True`` forces ``jax.distributed.initialize()``; ``False`` never joins
        (outside the launcher); ``None`` decides from the environment.
      heartbeat_timeout_s: a process silent this long is dead; the others are terminated.
      initialization_timeout_s: how long to wait for every process to connect.
      shutdown_timeout_s: how long a finished process waits for the others at exit.
      exit_on_error: an uncaught exception exits the process at once (see the Note above).
      watchdog_timeout_s: the step watchdog's timeout ([Note: step watchdog]; loops mark
        their steps with :func:`jshard.launch.steps`). ``None``: ``JSHARD_WATCHDOG_TIMEOUT``,
        else 60 s under the launcher and 600 s on a cluster; ``0`` turns it off.

    Returns:
      Whether this process is part of a multi-process job.

    Raises:
      RuntimeError: JAX was already used in this process before joining.

    Example:
      >>> from jshard.launch import initialize
      >>> initialize()  # one plain process: nothing to join
      False
    """
    if jax.distributed.is_initialized():
        return True
    if not (under_launcher() or distributed or (distributed is None and _on_cluster())):
        return False
    _check_launcher_env()
    if xla_bridge.backends_are_initialized():
        raise RuntimeError(_USED_BEFORE)
    args = _launcher_args() if under_launcher() else {}
    args.update(_timeouts(heartbeat_timeout_s, initialization_timeout_s, shutdown_timeout_s))
    jax.distributed.initialize(**args)
    if exit_on_error:
        _exit_at_once_on_uncaught(jax.process_index())
    default = LAUNCHER_TIMEOUT_S if under_launcher() else CLUSTER_TIMEOUT_S
    timeout = timeout_from_env(default) if watchdog_timeout_s is None else (watchdog_timeout_s or None)
    start_watchdog(timeout)
    return True
