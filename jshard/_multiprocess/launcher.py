"""Run a script as P local JAX processes on CPU: ``python -m jshard.launch --nproc P script.py``.

Each process gets ``--devices-per-proc`` CPU devices and gloo collectives over
127.0.0.1, joins the job through :func:`initialize` (called for the script unless
``--no-auto-init``), and has its output prefixed with its index (``[0] ...``). If a
process fails, the launcher terminates the others and exits with that process's
code. The same script runs on a real cluster, where :func:`initialize` calls
``jax.distributed.initialize()``; see ``docs/multihost.md``.

[Note: first failure] When one process fails, the others usually fail too, often in the
same instant: a collective whose peer is gone raises ("Connection reset by peer"), and
JAX's coordination service aborts (SIGABRT) processes whose peer stopped. The launcher
names the one that caused it: first a process killed by a signal it did not send (SIGKILL
from the OOM killer, a scheduler or a person; SIGSEGV), which cannot report anything
itself; SIGABRT does not count there, since it is how JAX stops the survivors. Then the
process that reported an uncaught exception first; then the first seen to exit non-zero.
It lists every non-zero exit beside it, a signal as ``128 + signal`` with its name.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

from jshard._multiprocess import join as D
from jshard._multiprocess.preemption import PREEMPTED_EXIT
from jshard._multiprocess.watchdog import WATCHDOG_EXIT, WATCHDOG_TIMEOUT

_VALUED = {"--nproc", "--devices-per-proc", "--port", "--heartbeat-timeout", "--init-timeout", "--timeout",
           "--watchdog-timeout", "--preemption-grace"}
_GRACE_S = 5.0
_SETTLE_S = 0.3


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now.

    Example:
      >>> 0 < free_port() < 65536
      True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(i: int, nproc: int, devices: int, port: int, heartbeat_s: int, init_s: int,
               watchdog_s: float | None) -> dict[str, str]:
    env = dict(os.environ)
    if watchdog_s is not None:
        env[WATCHDOG_TIMEOUT] = str(watchdog_s)
    env.update({
        D.COORDINATOR: f"127.0.0.1:{port}",
        D.NUM_PROCESSES: str(nproc),
        D.PROCESS_ID: str(i),
        D.DEVICES_PER_PROCESS: str(devices),
        D.HEARTBEAT_TIMEOUT: env.get(D.HEARTBEAT_TIMEOUT, str(heartbeat_s)),
        D.INIT_TIMEOUT: env.get(D.INIT_TIMEOUT, str(init_s)),
        "JAX_PLATFORMS": "cpu",
        "PYTHONUNBUFFERED": "1",
    })
    return env


def _pump(stream: IO[bytes], index: int, out: IO[str], lock: threading.Lock, raised: dict[int, tuple]) -> None:
    """Copy a process's output with its ``[i]`` prefix; note when it reports an uncaught exception."""
    prefix, marker = f"[{index}] ", D.UNCAUGHT.format(process_id=index, kind="")[: -len("; ")]
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        if line.startswith(marker):
            raised.setdefault(index, (time.monotonic(), line[len(marker) :].split(";")[0]))
        with lock:
            out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            out.flush()
    stream.close()


def _stop(procs: list[subprocess.Popen], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)


def _stop_all(procs: list[subprocess.Popen]) -> None:
    _stop(procs, signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    _stop(procs, signal.SIGKILL)
    for p in procs:
        p.wait()


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def _describe_exit(rc: int) -> str:
    """``exit code 1``, or ``exit code 137 (SIGKILL)`` for a process a signal killed (``rc`` -9)."""
    return f"exit code {_exit_code(rc)}" + (f" ({_describe_signal(-rc)})" if rc < 0 else "")


def _describe_signal(signum: int) -> str:
    return signal.Signals(signum).name if signum in _SIGNALS else f"signal {signum}"


_SIGNALS = {s.value for s in signal.Signals}


def _first_failure(procs: list[subprocess.Popen], raised: dict[int, tuple], ended: dict[int, float]) -> tuple[int, str]:
    """``(index, why)`` of the process whose failure ended the job ([Note: first failure])."""
    time.sleep(_SETTLE_S)  # let the pumps read what the failed processes printed last
    _note_exits(procs, ended)
    killed = [i for i, p in enumerate(procs) if p.poll() is not None and p.poll() < 0 and -p.poll() != signal.SIGABRT]
    if killed:
        first = min(killed, key=lambda i: (ended[i], i))
        return first, f"killed by {_describe_signal(-procs[first].poll())}, which the launcher did not send"
    if raised:
        first = min(raised, key=lambda i: raised[i][0])
        try:  # it is exiting: its hook calls os._exit(1)
            procs[first].wait(timeout=_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        return first, f"uncaught {raised[first][1]}, reported first"
    first = min((i for i, p in enumerate(procs) if p.poll()), key=lambda i: (ended[i], i))
    return first, ""


def _note_exits(procs: list[subprocess.Popen], ended: dict[int, float]) -> None:
    """When each process was first seen to have exited (the order in which they failed)."""
    now = time.monotonic()
    for i, p in enumerate(procs):
        if p.poll() is not None:
            ended.setdefault(i, now)


def _exits(procs: list[subprocess.Popen], raised: dict[int, tuple]) -> str:
    """Every non-zero exit so far, ``process 0: exit code 1 (uncaught E); process 1: exit code 137 (SIGKILL)``."""
    return "; ".join(f"process {i}: {_describe_exit(p.poll())}" + (f" (uncaught {raised[i][1]})" if i in raised else "")
                     for i, p in enumerate(procs) if p.poll())


def _watch(procs: list[subprocess.Popen], timeout_s: float | None, say, raised: dict[int, tuple],
           terminated: dict[str, float], grace_s: float) -> int:
    start, ended = time.monotonic(), {}
    while True:
        _note_exits(procs, ended)
        codes = [p.poll() for p in procs]
        if terminated and (all(c is not None for c in codes) or time.monotonic() > terminated["at"] + grace_s):
            return _after_sigterm(procs, codes, say, time.monotonic() - terminated["at"], grace_s)
        if not terminated and any(c not in (None, 0, PREEMPTED_EXIT) for c in codes):
            i, why = _first_failure(procs, raised, ended)
            rc = procs[i].poll() or 1  # a reporter still exiting (its hook calls os._exit(1))
            if rc == WATCHDOG_EXIT:
                say(f"the step watchdog stopped the job (exit {WATCHDOG_EXIT}; its diagnosis is above) after "
                    f"{time.monotonic() - start:.1f} s.")
                return WATCHDOG_EXIT
            others = sum(q.poll() is None for q in procs)
            say(f"process {i} failed first" + (f" ({why})" if why else "") + f": {_describe_exit(rc)} after "
                f"{time.monotonic() - start:.1f} s; terminating the other {others} running process(es).")
            say(f"non-zero exits: {_exits(procs, raised)}.")
            return _exit_code(rc)
        if all(c is not None for c in codes):
            return PREEMPTED_EXIT if PREEMPTED_EXIT in codes else 0
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            say(f"the job ran past --timeout {timeout_s:g} s; terminating every process.")
            return 124
        time.sleep(0.05)


def _after_sigterm(procs: list[subprocess.Popen], codes: list, say, waited: float, grace_s: float) -> int:
    """The launcher got SIGTERM and forwarded it: the job's code once every process stopped (or the grace ran out)."""
    if any(c is None for c in codes):
        say(f"SIGTERM: {sum(c is None for c in codes)} process(es) still running after the {grace_s:g} s grace; "
            "killing them.")
        return 128 + signal.SIGTERM
    if all(c == PREEMPTED_EXIT for c in codes):
        say(f"SIGTERM: every process saved and stopped (exit {PREEMPTED_EXIT}) {waited:.1f} s after it; "
            "run the same command to resume.")
        return PREEMPTED_EXIT
    say(f"SIGTERM: processes stopped with codes {[_exit_code(c) for c in codes]}.")
    return next((_exit_code(c) for c in codes if c), 0)


def launch(
    target: Sequence[str],
    *,
    nproc: int,
    devices_per_proc: int = 1,
    port: int | None = None,
    heartbeat_timeout_s: int = 20,
    init_timeout_s: int = 120,
    timeout_s: float | None = None,
    auto_init: bool = True,
    out: IO[str] | None = None,
    watchdog_timeout_s: float | None = None,
    preemption_grace_s: float = 60.0,
) -> int:
    """Start ``nproc`` local processes running ``target`` and wait for them.

    Args:
      target: ``["script.py", *args]`` or ``["-m", "module", *args]``.
      nproc: number of processes.
      devices_per_proc: CPU devices per process (``jax_num_cpu_devices``).
      port: coordinator port on 127.0.0.1 (default: a free one).
      heartbeat_timeout_s: a process silent this long is dead and the others are
        terminated by JAX (``JSHARD_HEARTBEAT_TIMEOUT``; an existing value wins).
      init_timeout_s: how long processes wait for each other to connect.
      timeout_s: terminate every process after this long and return 124.
      auto_init: call :func:`initialize` before running ``target``; with ``False`` the
        script must call it first thing.
      out: where prefixed output goes (default: ``sys.stdout``).
      watchdog_timeout_s: the step watchdog's timeout in every process
        (``JSHARD_WATCHDOG_TIMEOUT``; default 60 s, ``0`` off; [Note: step watchdog]).
      preemption_grace_s: on SIGTERM the launcher forwards it to every process and
        waits this long for them to save and stop ([Note: preemption]), then kills them.

    Returns:
      0 if every process succeeded, else the failing process's exit code
      (``128 + signal`` when it was killed by a signal), 124 on timeout, 70 when the
      watchdog stopped the job, 75 when every process saved and stopped after SIGTERM.

    Example:
      >>> from jshard.launch import launch
      >>> launch(["train.py", "--steps", "10"], nproc=2, devices_per_proc=4)  # doctest: +SKIP
      0
    """
    if nproc < 1 or devices_per_proc < 1:
        raise ValueError(f"`nproc` and `devices_per_proc` must be at least 1, got {nproc} and {devices_per_proc}.")
    if not target or (target[0] == "-m" and len(target) < 2):
        raise ValueError("Nothing to run: pass a script path (or `-m module`) and its arguments.")
    out = sys.stdout if out is None else out
    port = free_port() if port is None else port
    prefix = [sys.executable, "-u", "-m", "jshard._multiprocess.child"] if auto_init else [sys.executable, "-u"]
    lock = threading.Lock()

    def say(msg: str) -> None:
        with lock:
            print(f"[launch] {msg}", file=sys.stderr, flush=True)

    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    raised: dict[int, tuple] = {}
    terminated: dict[str, float] = {}
    restore = _forward_sigterm(procs, terminated, say)
    try:
        for i in range(nproc):
            env = _child_env(i, nproc, devices_per_proc, port, heartbeat_timeout_s, init_timeout_s,
                             watchdog_timeout_s)
            p = subprocess.Popen([*prefix, *target], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT)
            procs.append(p)
            pumps.append(threading.Thread(target=_pump, args=(p.stdout, i, out, lock, raised), daemon=True))
            pumps[-1].start()
        return _watch(procs, timeout_s, say, raised, terminated, preemption_grace_s)
    except KeyboardInterrupt:
        say("interrupted; terminating every process.")
        return 130
    finally:
        _stop_all(procs)
        for t in pumps:
            t.join(timeout=_GRACE_S)
        restore()


def _forward_sigterm(procs: list[subprocess.Popen], terminated: dict[str, float], say):
    """SIGTERM to the launcher goes to every process, which may save before stopping; returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, frame):
        if not terminated:
            terminated["at"] = time.monotonic()
            say("SIGTERM: forwarding it to every process (they may save a checkpoint and stop).")
            _stop(procs, signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, previous)


def split_command_line(argv: list[str]) -> tuple[list[str], list[str]]:
    """Launcher options, then the target (the script or ``-m module``) and its arguments."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return argv[:i], argv[i + 1 :]
        if arg == "-m" or not arg.startswith("-"):
            break
        i += 2 if arg in _VALUED else 1
    return argv[:i], argv[i:]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jshard.launch",
        usage="%(prog)s --nproc P [--devices-per-proc D] [options] (script.py | -m module) [args ...]",
        description="Run a JAX script as P local CPU processes joined by jax.distributed (gloo over 127.0.0.1).",
    )
    parser.add_argument("--nproc", type=int, required=True, help="number of processes")
    parser.add_argument("--devices-per-proc", type=int, default=1, help="CPU devices per process")
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    parser.add_argument("--heartbeat-timeout", type=int, default=20,
                        help="seconds of silence after which a process is dead (default 20)")
    parser.add_argument("--init-timeout", type=int, default=120,
                        help="seconds to wait for every process to connect (default 120)")
    parser.add_argument("--timeout", type=float, default=None, help="terminate the job after this many seconds")
    parser.add_argument("--watchdog-timeout", type=float, default=None,
                        help="seconds a process may stay behind the others before the job stops (default 60; 0: off)")
    parser.add_argument("--preemption-grace", type=float, default=60.0,
                        help="after SIGTERM, seconds the processes get to save and stop (default 60)")
    parser.add_argument("--no-auto-init", action="store_true",
                        help="do not call jshard.launch.initialize() before the script (it must call it)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``python -m jshard.launch --nproc P [--devices-per-proc D] script.py [args]``.

    Example:
      >>> from jshard.launch import main
      >>> main(["--nproc", "2", "--devices-per-proc", "4", "train.py"])  # doctest: +SKIP
      0
    """
    own, target = split_command_line(list(sys.argv[1:] if argv is None else argv))
    parser = _parser()
    args = parser.parse_args(own)
    if not target:
        parser.error("missing the script to run (script.py or -m module)")
    return launch(
        target, nproc=args.nproc, devices_per_proc=args.devices_per_proc, port=args.port,
        heartbeat_timeout_s=args.heartbeat_timeout, init_timeout_s=args.init_timeout,
        timeout_s=args.timeout, auto_init=not args.no_auto_init, watchdog_timeout_s=args.watchdog_timeout,
        preemption_grace_s=args.preemption_grace,
    )
