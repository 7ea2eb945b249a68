"""Faults at scale, in real 2-process jobs: a hung process named by the watchdog, preemption, non-finite gradients.

The jobs are ``tests/mp_scripts/faults.py`` in 2 processes x 4 CPU devices, started by
``python -m jshard.launch`` or by hand (as a cluster scheduler starts them); every
subprocess runs in its own process group, killed in ``finally``, under a timeout.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jshard._multiprocess import join
from jshard.launch import PREEMPTED_EXIT, WATCHDOG_EXIT, free_port

SCRIPTS = Path(__file__).parent / "mp_scripts"
FAULTS = str(SCRIPTS / "faults.py")
WATCHDOG_S = 8


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), env.get("PYTHONPATH", "")])
    return env


def _popen(cmd: list[str], log: Path, extra: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(extra), start_new_session=True)


def _kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def _by_hand(args: list[str], tmp_path: Path, extra: dict[str, str] | None = None):
    """Two processes of ``faults.py args`` started as a cluster scheduler starts them (no launcher):
    the processes and their logs."""
    env = {join.COORDINATOR: f"127.0.0.1:{free_port()}", join.NUM_PROCESSES: "2", join.DEVICES_PER_PROCESS: "4",
           **(extra or {})}
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    procs = [_popen([sys.executable, "-u", FAULTS, *args], logs[i], {**env, join.PROCESS_ID: str(i)}) for i in range(2)]
    return procs, logs


def _launcher(*args: str) -> list[str]:
    return [sys.executable, "-m", "jshard.launch", "--nproc", "2", "--devices-per-proc", "4", *args]


def _check_diagnosis(text: str) -> None:
    assert "watchdog: process 1 is behind" in text, text
    assert "process 1: last entered step 3 (still inside it), last left 2; 3 global batches built" in text
    assert "process 0: last entered step 3" in text and "4 global batches built" in text
    assert re.search(r"in load_batch\n(\[\d\] )?\s+time\.sleep\(1000\)", text), text  # the sleeping frame


def _stall_to_exit(procs: list[subprocess.Popen], logs: list[Path]) -> tuple[list[int], float]:
    """Exit codes, and seconds from the stall (process 1 printed step 2 and went to load step 3) to the last exit."""
    deadline = time.monotonic() + 120
    while not any("step 2 loss" in log.read_text() for log in logs):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [g.read_text() for g in logs]
        time.sleep(0.05)
    stalled = time.monotonic()
    codes = [p.wait(timeout=WATCHDOG_S + 60) for p in procs]
    return codes, time.monotonic() - stalled


def test_watchdog_names_the_hung_process_under_the_launcher(tmp_path):
    log = tmp_path / "launch.log"
    p = _popen(_launcher("--watchdog-timeout", str(WATCHDOG_S), FAULTS, "hang", "6"), log)
    try:
        (rc,), seconds = _stall_to_exit([p], [log])
    finally:
        _kill(p)
    text = log.read_text()
    print(f"launcher: exit {rc}, {seconds:.1f} s after the stall (watchdog timeout {WATCHDOG_S} s)")
    assert seconds < WATCHDOG_S + 15
    assert rc == WATCHDOG_EXIT, text
    for i in range(2):  # every process prints the diagnosis
        assert f"[{i}] [jshard] watchdog: process 1 is behind" in text
    _check_diagnosis(text)
    assert "[launch] the step watchdog stopped the job" in text
    assert "step 2 loss" in text and "finished" not in text


@pytest.mark.slow  # the launcher case above is the same watchdog; this one joins from the environment
def test_watchdog_names_the_hung_process_without_the_launcher(tmp_path):
    procs, logs = _by_hand(["hang", "6"], tmp_path, {"JSHARD_WATCHDOG_TIMEOUT": str(WATCHDOG_S)})
    try:
        codes, seconds = _stall_to_exit(procs, logs)
    finally:
        for p in procs:
            _kill(p)
    print(f"by hand: exits {codes}, {seconds:.1f} s after the stall (watchdog timeout {WATCHDOG_S} s)")
    assert seconds < WATCHDOG_S + 15
    assert codes == [WATCHDOG_EXIT, WATCHDOG_EXIT], [log.read_text() for log in logs]
    for log in logs:
        _check_diagnosis(log.read_text())


@pytest.mark.slow  # the same watchdog as above, told only by js.global_batch
def test_watchdog_names_the_hung_process_of_a_loop_that_marks_no_steps(tmp_path):
    log = tmp_path / "launch.log"
    p = _popen(_launcher("--watchdog-timeout", str(WATCHDOG_S), FAULTS, "hang", "6", "plain"), log)
    try:
        (rc,), seconds = _stall_to_exit([p], [log])
    finally:
        _kill(p)
    text = log.read_text()
    assert rc == WATCHDOG_EXIT and seconds < WATCHDOG_S + 15, text
    assert "watchdog: process 1 is behind" in text
    assert "process 1: no step marked (jshard.launch.steps); 3 global batches built" in text
    assert "process 0: no step marked (jshard.launch.steps); 4 global batches built" in text
    assert re.search(r"in load_batch\n(\[\d\] )?\s+time\.sleep\(1000\)", text), text


def _run(tmp: Path, out: Path, steps: int, *extra: str, sigterm_after: str | None = None) -> tuple[int, str]:
    log = tmp / f"run-{time.monotonic_ns()}.log"
    p = _popen(_launcher("--preemption-grace", "60", FAULTS, "preempt", str(out), str(steps), *extra), log)
    try:
        if sigterm_after:
            deadline = time.monotonic() + 120
            while sigterm_after not in log.read_text():
                assert p.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            p.send_signal(signal.SIGTERM)  # to the launcher, as a scheduler preempting the job
            sent = time.monotonic()
        rc = p.wait(timeout=150)
        if sigterm_after:
            print(f"SIGTERM to the launcher: saved and exited {rc} after {time.monotonic() - sent:.1f} s")
    finally:
        _kill(p)
    return rc, log.read_text()


def test_sigterm_saves_at_one_step_and_the_rerun_resumes_bit_exact(tmp_path):
    steps = 8
    cut = tmp_path / "cut"
    rc, text = _run(tmp_path, cut, steps, sigterm_after="step 2 loss")
    assert rc == PREEMPTED_EXIT, text
    saved = {int(s) for s in re.findall(r"\[\d\] preempted: saved step (\d+)", text)}
    assert len(saved) == 1 and len(re.findall(r"preempted: saved step", text)) == 2, text  # both, same step
    assert "every process saved and stopped" in text and not (cut / "final.npz").exists()
    # The same command again; then the job trains the same steps uninterrupted, as the reference.
    rc, resumed = _run(tmp_path, cut, steps, "reference")
    assert rc == 0, resumed
    assert f"[0] resumed at step {saved.pop()}" in resumed and "[1] resumed at step" in resumed
    a, b = np.load(cut / "uninterrupted.npz"), np.load(cut / "final.npz")
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)  # bit for bit


@pytest.mark.parametrize("started", ["launcher", "by hand"])
def test_apply_if_finite_skips_on_every_process_when_one_device_has_an_inf(tmp_path, started):
    if started == "launcher":
        logs = [tmp_path / "finite.log"]
        procs = [_popen(_launcher(FAULTS, "finite", str(tmp_path)), logs[0])]
    else:  # leaves through atexit alone
        procs, logs = _by_hand(["finite", str(tmp_path)], tmp_path)
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            _kill(p)
    if started == "launcher":
        text = logs[0].read_text()
    else:  # each line prefixed with its process, as the launcher does
        text = "".join(f"[{i}] {line}" for i, log in enumerate(logs) for line in log.read_text().splitlines(True))
    assert codes == [0] * len(procs), text
    for i in range(2):
        assert f"[{i}] step 0 notfinite_count 0 total 0 params unchanged False" in text
        assert f"[{i}] step 1 notfinite_count 1 total 1 params unchanged True" in text  # skipped everywhere
        assert f"[{i}] step 2 notfinite_count 0 total 1 params unchanged False" in text
    digests = set(re.findall(r"\[\d\] final digest ([\d.]+)", text))
    assert len(digests) == 1, text
    # the watchdog stopped before the interpreter's teardown: a daemon thread ended there inside a
    # call to the coordination service aborted a process after its work (exit 134: 1 of 19 loaded jobs)
    for i in range(2):
        assert f"[{i}] watchdog thread alive at exit: False" in text, text
