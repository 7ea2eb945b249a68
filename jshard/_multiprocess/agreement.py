"""Checks that every process of a multi-process job agrees (same model, policy, batch shapes).

[Note: agreement across processes] Every process runs the same program; if one builds a
different model or policy, the compiled steps differ and the job computes garbage or
hangs in a collective that the others never join. So :func:`same_on_all_processes`
publishes a description of what this process is about to use in JAX's coordination
service (its key-value store: host RPCs, no device collective, no compilation, usable
while tracing), waits at a barrier with a timeout, compares digests and, when they
differ, raises the same ``ValueError`` on every process naming the first item that
differs and each process's value. A process that never arrives (it built fewer units,
or it is stuck) gives a ``RuntimeError`` after ``JSHARD_SYNC_TIMEOUT`` seconds.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os

import jax
from jax._src import distributed

SYNC_TIMEOUT = "JSHARD_SYNC_TIMEOUT"
DEFAULT_SYNC_TIMEOUT_S = 300
_calls: collections.Counter[str] = collections.Counter()

Description = dict[str, dict[str, str]]


def _timeout_s() -> float:
    value = os.environ.get(SYNC_TIMEOUT)
    return float(value) if value else DEFAULT_SYNC_TIMEOUT_S


def _by_value(values: dict[int, str | None]) -> str:
    groups: dict[str | None, list[int]] = {}
    for pid, value in values.items():
        groups.setdefault(value, []).append(pid)
    parts = []
    for value, pids in groups.items():
        who = f"process {pids[0]}" if len(pids) == 1 else "processes " + ", ".join(map(str, pids[:8]))
        who += ", ..." if len(pids) > 8 else ""
        parts.append(f"{who}: {'(absent)' if value is None else value}")
    return "; ".join(parts)


def first_difference(descriptions: dict[int, Description]) -> str | None:
    """``"<part> <key>: process 0: <value>; process 1: <value>"`` for the first disagreement."""
    for part in dict.fromkeys(p for d in descriptions.values() for p in d):
        keys = dict.fromkeys(k for d in descriptions.values() for k in d.get(part, {}))
        for key in keys:
            values = {pid: d.get(part, {}).get(key) for pid, d in descriptions.items()}
            if len(set(values.values())) > 1:
                return f"{part} {key}: {_by_value(values)}"
    return None


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def same_on_all_processes(name: str, description: Description, fix: str) -> None:
    """Raise on every process unless all processes pass an equal ``description`` here.

    Args:
      name: what is being checked (``"fully_shard"``); calls are numbered per name.
      description: ``{part: {key: value}}``, e.g. ``{"leaf": {"['w']": "shape (8, 3)"}}``.
      fix: what the user should do, appended to the error.

    Raises:
      ValueError: the processes passed different descriptions.
      RuntimeError: some process did not arrive within ``JSHARD_SYNC_TIMEOUT`` seconds.
    """
    if jax.process_count() == 1 or distributed.global_state.client is None:
        return
    client = distributed.global_state.client
    call, me, n = _calls[name], jax.process_index(), jax.process_count()
    _calls[name] += 1
    prefix = f"jshard/{name}/{call}"
    text = json.dumps(description)
    client.key_value_set(f"{prefix}/full/{me}", text)
    client.key_value_set(f"{prefix}/digest/{me}", _digest(text))
    timeout_s = _timeout_s()
    try:
        client.wait_at_barrier(f"jshard/{name}", int(timeout_s * 1000))  # reusable: no state per call
    except jax.errors.JaxRuntimeError:
        arrived = {int(k.rsplit("/", 1)[1]) for k, _ in client.key_value_dir_get(f"{prefix}/digest/")}
        missing = sorted(set(range(n)) - arrived)
        raise RuntimeError(
            f"{name} (call #{call + 1} on this process): process(es) {missing} did not reach it within "
            f"{timeout_s:g} s: the processes run different programs (e.g. different numbers of {name} "
            f"calls), or those processes are stuck or slow. {fix} To wait longer, set {SYNC_TIMEOUT} "
            "(seconds)."
        ) from None
    if call:  # every process is past the previous call's reads: drop this process's keys of it
        for kind in ("full", "digest"):
            client.key_value_delete(f"jshard/{name}/{call - 1}/{kind}/{me}")
    digests = {int(k.rsplit("/", 1)[1]): v for k, v in client.key_value_dir_get(f"{prefix}/digest/")}
    if len(set(digests.values())) == 1:
        return
    texts = {pid: client.blocking_key_value_get(f"{prefix}/full/{pid}", 60_000) for pid in sorted(digests)}
    where = first_difference({pid: json.loads(t) for pid, t in texts.items()}) or "(descriptions differ)"
    raise ValueError(f"{name} (call #{call + 1}) differs across processes: {where}. {fix}")
