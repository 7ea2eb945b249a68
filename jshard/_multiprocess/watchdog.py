"""The step watchdog: a process that stays alive but stops making progress is named, and the job ends.

[Note: step watchdog] JAX's heartbeats prove a process is alive, not that it is
working: a process stuck in its data loader or a deadlock keeps heartbeating while the
others wait in a collective for it until the job's time limit. So each process
publishes where its training loop is (the step it last entered and left, marked by
:func:`steps`, and the global batches it has built, counted by ``js.global_batch``) in
JAX's coordination service, and a daemon thread in every process
reads all of them once a second. A process is *behind* when another one has got
further (entered a later step, built the batch it is still loading, or left the step it
is still in) and it has not caught up within the timeout, counted from when this process first saw the other get there:
local clocks only, so hosts' clocks need not agree. The timeout is armed once every
process has entered its second step (or built its second global batch, for loops that do
not use :func:`steps`), so the first step's compilation never trips it.
The first process to see it publishes the verdict (who is behind), and every process
adopts it at its next poll, so their own clocks need not agree on when. Then every
process prints one diagnosis (who is behind, each process's last entered and left step,
and the lagging process's Python stack, which it publishes itself: its watchdog thread
runs while its main thread sleeps or waits) and exits with :data:`WATCHDOG_EXIT` once
every process has printed its own (at most ``_PRINTED_WAIT_S`` later): the coordination
service lives in process 0, and JAX terminates the other processes as soon as it exits,
which cut off a slower process's diagnosis on a busy machine before; process 0 leaves
last, once the others have said they are leaving. Processes that are
all inside the same step are not behind one another; a step that is slow everywhere is
not a hang this can name.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import jax
from jax._src import distributed

WATCHDOG_TIMEOUT = "JSHARD_WATCHDOG_TIMEOUT"
WATCHDOG_EXIT = 70
LAUNCHER_TIMEOUT_S = 60.0
CLUSTER_TIMEOUT_S = 600.0
_POLL_S = 1.0
_STACK_WAIT_S = 5.0
_PRINTED_WAIT_S = 10.0
_LEAVE_LAST_S = 0.2
_PREFIX = "jshard/watchdog"
T = TypeVar("T")


class _Progress:
    """This process's place in the loop (steps entered and left), published on every change."""

    def __init__(self) -> None:
        self.entered, self.left, self.loading, self.count, self.batches = -1, -1, False, 0, 0
        self.lock = threading.Lock()

    def publish(self) -> None:
        client = distributed.global_state.client
        if client is not None:
            value = json.dumps({"entered": self.entered, "left": self.left, "loading": self.loading,
                                "count": self.count, "batches": self.batches})
            client.key_value_set(f"{_PREFIX}/progress/{jax.process_index()}", value, allow_overwrite=True)

    def mark(self, **changes: Any) -> None:
        with self.lock:
            for name, value in changes.items():
                setattr(self, name, value)
            self.publish()


class _Thread:
    """This process's watchdog thread and what tells it to stop."""

    def __init__(self, timeout_s: float) -> None:
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=_watch, args=(timeout_s, self.stopping), name="jshard-watchdog",
                                       daemon=True)


_progress = _Progress()
_started: list[_Thread] = []


def steps(iterable: Iterable[T], start: int = 0) -> Iterator[T]:
    """Iterate over ``iterable`` (the training loop's batches or steps), telling the watchdog where the loop is.

    Fetching the next item (data loading) counts as between steps; the loop body as
    inside step ``start + i``. Outside a multi-process job it only iterates.

    Example:
      >>> from jshard.launch import steps
      >>> [step for step in steps(range(3))]
      [0, 1, 2]
    """
    step = start
    iterator = iter(iterable)
    while True:
        _progress.mark(loading=True)
        try:
            item = next(iterator)
        except StopIteration:
            _progress.mark(loading=False)
            return
        _progress.mark(entered=step, loading=False, count=_progress.count + 1)
        yield item
        _progress.mark(left=step)
        step += 1


def note_batch() -> None:
    """One more global batch built (``js.global_batch`` calls it): progress inside a step, so a
    process stuck in its data loading is behind one that already has its batch."""
    if _started:
        _progress.mark(batches=_progress.batches + 1)


def _rank(record: dict[str, Any]) -> tuple[int, int, bool]:
    """Progress, ordered: the step entered, the global batches built, whether it left the step."""
    return record["entered"], record["batches"], record["left"] == record["entered"]


def _where(pid: int, record: dict[str, Any]) -> str:
    built = f"; {record['batches']} global batches built"
    if record["entered"] < 0:
        return f"process {pid}: no step marked (jshard.launch.steps){built}"
    if record["left"] == record["entered"]:
        doing = f"loading the data of step {record['left'] + 1}" if record["loading"] else "between steps"
        return f"process {pid}: last entered step {record['entered']}, left it ({doing}){built}"
    return (f"process {pid}: last entered step {record['entered']} (still inside it), last left "
            f"{record['left']}{built}")


def _stack_of_main_thread() -> str:
    frame = sys._current_frames().get(threading.main_thread().ident)
    return "".join(traceback.format_stack(frame)) if frame is not None else "(no main thread)"


def _diagnosis(behind: int, records: dict[int, dict[str, Any]], waited: float, timeout_s: float) -> str:
    lines = [f"[jshard] watchdog: process {behind} is behind: the others got further {waited:.1f} s ago and it has "
             f"not caught up within the watchdog timeout ({timeout_s:g} s; {WATCHDOG_TIMEOUT} sets it)."]
    lines += [f"  {_where(pid, records[pid])}" for pid in sorted(records)]
    return "\n".join(lines)


def _verdict(client, records: dict[int, dict[str, Any]], ranks: dict[int, tuple], first_seen: dict[tuple, float],
             timeout_s: float) -> dict[str, Any] | None:
    """The verdict another process published, else this process's own once someone stayed behind too long."""
    published = client.key_value_dir_get(f"{_PREFIX}/verdict/")
    if published:
        return json.loads(published[0][1])
    if min(max(r["count"], r["batches"]) for r in records.values()) < 2:
        return None  # not armed: some process has not reached its second step or batch (compilation)
    lowest = min(ranks.values())
    ahead = [first_seen[r] for r in ranks.values() if r > lowest]
    waited = time.monotonic() - min(ahead) if ahead else 0.0
    if waited <= timeout_s:
        return None
    verdict = {"behind": min(pid for pid, r in ranks.items() if r == lowest), "waited": waited}
    client.key_value_set(f"{_PREFIX}/verdict/{jax.process_index()}", json.dumps(verdict), allow_overwrite=True)
    return verdict


def _stack_of(client, behind: int) -> str:
    """The lagging process's stack: this one's, published for the others, or the one it published."""
    if behind == jax.process_index():
        stack = _stack_of_main_thread()
        client.key_value_set(f"{_PREFIX}/stack/{behind}", stack, allow_overwrite=True)
        return stack
    try:
        return client.blocking_key_value_get(f"{_PREFIX}/stack/{behind}", int(_STACK_WAIT_S * 1000))
    except Exception:
        return "(it did not publish its stack)\n"


def _exit_once_everyone_printed(client, text: str, count: int) -> None:
    """Print the diagnosis, then exit once every process printed its own (or after ``_PRINTED_WAIT_S``).

    The coordination service lives in process 0: when it exits, JAX terminates the others at
    once (a fatal error, SIGABRT), so a process that exited right after printing could cut off a
    slower one's diagnosis, and process 0 leaving as soon as everyone printed aborted a process
    that had printed but not yet exited (2 of 15 jobs started by hand). So process 0 leaves last,
    once the others have said they are leaving.
    """
    print(text, file=sys.stderr, flush=True)
    sys.stdout.flush()
    deadline = time.monotonic() + _PRINTED_WAIT_S
    try:
        _mark(client, "printed")
        _wait_for(client, "printed", count, deadline)
        if jax.process_index() != 0:
            _mark(client, "leaving")
        else:
            _wait_for(client, "leaving", count - 1, deadline)
            time.sleep(_LEAVE_LAST_S)  # the last to say so is between its word and its exit
    except Exception:  # the service is gone: nobody is left to wait for
        pass
    os._exit(WATCHDOG_EXIT)


def _mark(client, stage: str) -> None:
    client.key_value_set(f"{_PREFIX}/{stage}/{jax.process_index()}", "1", allow_overwrite=True)


def _wait_for(client, stage: str, count: int, deadline: float) -> None:
    """Until ``count`` processes have marked ``stage``, or the deadline."""
    while len(client.key_value_dir_get(f"{_PREFIX}/{stage}/")) < count and time.monotonic() < deadline:
        time.sleep(0.05)


def _watch(timeout_s: float, stopping: threading.Event) -> None:
    client = distributed.global_state.client
    count = jax.process_count()
    first_seen: dict[tuple, float] = {}  # progress -> when this process first saw someone reach it
    while not stopping.wait(_POLL_S):
        try:
            entries = client.key_value_dir_get(f"{_PREFIX}/progress/")
            records = {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in entries}
            if len(records) < count:
                continue
            ranks = {pid: _rank(r) for pid, r in records.items()}
            for rank in set(ranks.values()):
                first_seen.setdefault(rank, time.monotonic())
            verdict = _verdict(client, records, ranks, first_seen, timeout_s)
            if verdict is None:
                continue
            behind = verdict["behind"]
            stack = _stack_of(client, behind)
        except Exception:  # the service is gone: the job is ending
            return
        text = _diagnosis(behind, records, verdict["waited"], timeout_s)
        stack_text = f"  Python stack of process {behind} (main thread), most recent call last:\n{stack.rstrip()}"
        _exit_once_everyone_printed(client, f"{text}\n{stack_text}", count)


def timeout_from_env(default_s: float) -> float | None:
    """The watchdog timeout: ``JSHARD_WATCHDOG_TIMEOUT`` seconds (``0`` or ``off``: no watchdog), else ``default_s``."""
    value = os.environ.get(WATCHDOG_TIMEOUT, "").strip().lower()
    if value in ("0", "off", "false", "none"):
        return None
    if not value:
        return default_s
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{WATCHDOG_TIMEOUT}={value!r} must be seconds, or 0 / off for no watchdog.") from None


def start_watchdog(timeout_s: float | None) -> None:
    """Start this process's watchdog thread (once; nothing for one process or ``None``)."""
    if timeout_s is None or _started or jax.process_count() == 1 or distributed.global_state.client is None:
        return
    if not timeout_s > 0:
        raise ValueError(f"The watchdog timeout must be positive seconds, got {timeout_s!r}.")
    _progress.publish()
    watchdog = _Thread(timeout_s)
    watchdog.thread.start()
    _started.append(watchdog)
    atexit.register(stop_watchdog)


def stop_watchdog() -> None:
    """Stop this process's watchdog thread and wait until it has stopped (nothing if none runs).

    The process leaves the job through it before JAX's shutdown (``child.py``) and at exit
    (``atexit``, for processes started by hand): a daemon thread still inside a call to the
    coordination service when the interpreter is torn down is ended there, inside C++, which
    aborts the process after its work is done ("terminate called after throwing an instance
    of ''", "FATAL: exception not rethrown": 1 of 19 two-process jobs on a loaded machine,
    none of 30 since)."""
    for watchdog in _started:
        watchdog.stopping.set()
    for watchdog in _started:  # a poll, or the lagging stack's wait, ends within this
        watchdog.thread.join(_POLL_S + _STACK_WAIT_S)
