"""Multi-process: 2 processes x 4 CPU devices train like 1 x 8; checkpoints, disagreement, failures.

The 2-process runs are real JAX jobs (``jax.distributed`` over 127.0.0.1, gloo
collectives) started by ``python -m jshard.launch`` or by hand; the 1-process
reference runs here, on the 8 devices of ``conftest.py``. Helper scripts are in
``tests/mp_scripts/``. Every subprocess runs in its own process group, killed in
``finally``, under a timeout.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jshard as js
from jshard._multiprocess import agreement, join
from jshard._multiprocess.launcher import split_command_line
from jshard.batch import global_batch
from jshard.launch import free_port, initialize

SCRIPTS = Path(__file__).parent / "mp_scripts"
sys.path.insert(0, str(SCRIPTS))
import mp_model  # noqa: E402

STEPS = 4
TOL = 1e-5


def _popen(cmd: list[str], out: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), env.get("PYTHONPATH", "")])
    with open(out, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)  # the group this test started: the process and its children
    except ProcessLookupError:
        pass
    p.wait()


def _launch(tmp: Path, args: list[str], timeout_s: float, env: dict[str, str] | None = None) -> tuple[int, str, float]:
    """Run ``python -m jshard.launch ARGS``; (exit code, output, seconds)."""
    log = tmp / f"launch-{time.monotonic_ns()}.log"
    start = time.monotonic()
    p = _popen([sys.executable, "-m", "jshard.launch", *args], log, env)
    try:
        rc = p.wait(timeout=timeout_s)
    finally:
        _kill(p)
    return rc, log.read_text(), time.monotonic() - start


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("mp_train")
    args = ["--nproc", "2", "--devices-per-proc", "4", str(SCRIPTS / "train.py"), str(out), str(STEPS)]
    rc, log, _ = _launch(out, args, timeout_s=150)
    assert rc == 0, log
    return out, log


@pytest.fixture(scope="module")
def reference():
    """One process, 8 devices: STEPS steps (params and losses), then one more (its loss)."""
    mesh = js.make_mesh()
    data = [global_batch(b, mesh) for b in mp_model.batches(STEPS + 1)]
    sharded, opt_state, losses = mp_model.train(mp_model.shard(mp_model.init_params(), mesh), data[:STEPS])
    _, _, last = mp_model.train_step(sharded, opt_state, data[STEPS])
    return losses, js.unshard(sharded), float(last)


def _flat(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree.flatten_with_path(tree)[0]}


def test_two_processes_train_like_one(trained, reference):
    out, log = trained
    assert "[0] process 0 of 2: 4 local of 8 devices" in log
    assert "[1] process 1 of 2: 4 local of 8 devices" in log
    assert "[0] global params round-trip" in log and "[1] global params round-trip" in log
    assert "[1] state dict on process 1 : None" in log
    assert "[0] full state dict reloaded" in log and "[1] full state dict reloaded" in log
    ref_losses, ref_params, _ = reference
    for i in range(2):  # js.unshard gathered the full params to every process
        got = np.load(out / f"process{i}.npz")
        np.testing.assert_allclose(got["losses"], ref_losses, rtol=TOL, atol=TOL)
        np.testing.assert_allclose(got["hsdp_losses"], ref_losses[:2], rtol=TOL, atol=TOL)  # 2 x 4 HSDP mesh
        np.testing.assert_allclose(got["tp_losses"], ref_losses[:2], rtol=TOL, atol=TOL)  # fsdp 4 x tp 2 mesh
        for key, want in _flat(ref_params).items():
            np.testing.assert_allclose(got[key], want, rtol=TOL, atol=TOL, err_msg=f"process {i} {key}")
    state_dict = np.load(out / "state_dict.npz")  # jshard.state_dict.full_state_dict(process0_only=True)
    for key, want in _flat(ref_params).items():
        np.testing.assert_allclose(state_dict[key], want, rtol=TOL, atol=TOL, err_msg=f"state dict {key}")


def test_checkpoint_saved_by_two_processes_restores_in_one(trained, reference):
    out, _ = trained
    sharded = mp_model.shard(mp_model.init_params(), js.make_mesh())
    like = {"params": sharded, "opt_state": mp_model.OPTIMIZER.init(sharded)}
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(out / "ckpt", jax.tree.map(ocp.utils.to_shape_dtype_struct, like))
    saved = np.load(out / "process0.npz")
    for key, got in _flat(js.unshard(restored["params"])).items():
        np.testing.assert_array_equal(got, saved[key], err_msg=key)
    # The optimizer state came back too: one more step continues the reference run.
    batch = global_batch(mp_model.batches(STEPS + 1)[STEPS], js.make_mesh())
    _, _, loss = mp_model.train_step(restored["params"], restored["opt_state"], batch)
    np.testing.assert_allclose(float(loss), reference[2], rtol=TOL, atol=TOL)


@pytest.mark.parametrize("mesh_kind", ["fsdp4", "hsdp2x4"])
def test_jshard_checkpoint_saved_by_two_processes_restores_in_one_on_another_mesh(trained, reference, mesh_kind):
    from jshard.checkpoint import CheckpointManager

    out, _ = trained
    mesh = js.make_mesh(devices=jax.devices()[:4]) if mesh_kind == "fsdp4" else js.make_mesh(replicate=2)
    sharded = mp_model.shard(mp_model.init_params(), mesh)
    like = {"params": sharded, "opt_state": mp_model.OPTIMIZER.init(sharded), "step": 0}
    with CheckpointManager(out / "managed") as manager:
        restored = manager.restore(like)
    assert int(restored["step"]) == STEPS
    saved = np.load(out / "process0.npz")
    for key, got in _flat(js.unshard(restored["params"])).items():
        np.testing.assert_array_equal(got, saved[key], err_msg=key)
    batch = global_batch(mp_model.batches(STEPS + 1)[STEPS], mesh)
    _, _, loss = mp_model.train_step(restored["params"], restored["opt_state"], batch)
    np.testing.assert_allclose(float(loss), reference[2], rtol=TOL, atol=TOL)


def test_two_processes_initialise_born_sharded_like_one(tmp_path):
    """Each process of 2 x 4 makes only its own devices' shards under jit, with the values of 1 x 8."""
    import born_init

    args = ["--nproc", "2", "--devices-per-proc", "4", str(SCRIPTS / "born_sharded.py"), str(tmp_path)]
    rc, log, _ = _launch(tmp_path, args, timeout_s=150)
    assert rc == 0, log
    build = jax.jit(born_init.sharded_init(js.make_mesh()))
    reference = born_init.shards(build(jax.random.key(0)))
    per_device = build.lower(jax.random.key(0)).compile().memory_analysis().output_size_in_bytes
    got = {}
    for i in range(2):
        saved = np.load(tmp_path / f"shards{i}.npz")
        assert int(saved["output_bytes"]) == per_device  # each device holds its share, as in 1 x 8
        mine = {k: saved[k] for k in saved.files if k != "output_bytes"}
        assert sum(k.startswith("['head']|") for k in mine) == 4  # its 4 devices' rows of the 8
        got.update(mine)
    assert sorted(got) == sorted(reference)
    for k, want in reference.items():
        np.testing.assert_array_equal(got[k], want, err_msg=k)


def test_two_processes_load_a_pretrained_file_each_reading_only_its_rows(tmp_path):
    """``load_pretrained`` in 2 x 4: each process reads its own devices' rows and holds what 1 x 8 holds."""
    import born_init
    from safetensors.numpy import save_file

    from jshard.state_dict import load_pretrained

    weights = jax.tree.map(np.asarray, born_init.init(jax.random.key(1)))
    flat = {".".join(str(k.key) for k in path): x for path, x in jax.tree.flatten_with_path(weights)[0]}
    save_file(flat, tmp_path / "model.safetensors")
    args = ["--nproc", "2", "--devices-per-proc", "4", str(SCRIPTS / "pretrained_load.py"),
            str(tmp_path / "model.safetensors"), str(tmp_path)]
    rc, log, _ = _launch(tmp_path, args, timeout_s=150)
    assert rc == 0, log
    like = jax.eval_shape(born_init.sharded_init(js.make_mesh()), jax.random.key(0))
    reference = born_init.shards(load_pretrained(tmp_path / "model.safetensors", like))
    got = {}
    for i in range(2):
        saved = np.load(tmp_path / f"loaded{i}.npz")
        rows = saved["head_rows"]  # head (20, 10) padded to 24 rows: 3 a device, 12 a process
        assert (rows[:, 1] <= 12).all() if i == 0 else (rows[:, 0] >= 12).all(), rows
        got.update({k: saved[k] for k in saved.files if k != "head_rows"})
    assert sorted(got) == sorted(reference)
    for k, want in reference.items():
        np.testing.assert_array_equal(got[k], want, err_msg=k)


def test_processes_that_disagree_get_the_same_clear_error(tmp_path):
    args = ["--nproc", "2", "--devices-per-proc", "4", str(SCRIPTS / "mismatch.py")]
    rc, log, _ = _launch(tmp_path, args, timeout_s=120, env={agreement.SYNC_TIMEOUT: "5"})
    assert rc == 0, log
    expected = {
        "batch": r"CAUGHT batch ValueError: global_batch \(call #1\) differs across processes: batch leaf \['x'\]: "
                 r"process 0: shape \(8, 6\) float32; process 1: shape \(6, 6\) float32\. Every process must pass",
        "policy": r"CAUGHT policy ValueError: fully_shard \(call #1\) differs across processes: policy field "
                  r"reshard_after_forward: process 0: False; process 1: True\. Every process must build the same",
        "model": r"CAUGHT model ValueError: fully_shard \(call #2\) differs across processes: leaf \['b'\]: "
                 r"process 0: shape \(13,\) float32, sharded on dim 0 padded to 16; process 1: shape \(14,\)",
    }
    for case, pattern in expected.items():
        for i in range(2):
            assert re.search(rf"\[{i}\] {pattern}", log), f"process {i}, case {case}:\n{log}"
    assert "[0] NO ERROR count" in log
    assert re.search(r"\[1\] CAUGHT count RuntimeError: fully_shard \(call #3 on this process\): process\(es\) "
                     r"\[0\] did not reach it within 5 s", log), log


def _start_job(tmp: Path, script_args: list[str], heartbeat_s: int) -> tuple[list[subprocess.Popen], list[Path]]:
    """Two processes started by hand (no launcher), as a cluster scheduler would."""
    env = {
        join.COORDINATOR: f"127.0.0.1:{free_port()}",
        join.NUM_PROCESSES: "2",
        join.DEVICES_PER_PROCESS: "4",
        join.HEARTBEAT_TIMEOUT: str(heartbeat_s),
    }
    logs = [tmp / f"process{i}.log" for i in range(2)]
    procs = []
    for i in range(2):
        cmd = [sys.executable, "-u", str(SCRIPTS / "steps.py"), *script_args]
        procs.append(_popen(cmd, logs[i], {**env, join.PROCESS_ID: str(i)}))
    return procs, logs


def _wait_for(log: Path, text: str, procs: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        assert all(p.poll() is None for p in procs), "a process ended early:\n" + log.read_text()
        assert time.monotonic() < deadline, f"no {text!r} after {timeout_s} s:\n" + log.read_text()
        time.sleep(0.1)


# Killing process 1 ends process 0 by the heartbeat timeout, as process 1 raising does (default run).
@pytest.mark.parametrize("victim, how", [pytest.param(1, "kill", marks=pytest.mark.slow), (0, "kill"), (1, "raise")])
def test_a_failed_process_ends_the_others_without_the_launcher(tmp_path, victim, how):
    heartbeat_s = 5
    args = ["200"] if how == "kill" else ["200", "2", str(victim)]  # bounded even if orphaned
    procs, logs = _start_job(tmp_path, args, heartbeat_s)
    try:
        _wait_for(logs[victim], "step 2", procs, timeout_s=120)
        if how == "kill":
            os.killpg(procs[victim].pid, signal.SIGKILL)
        start = time.monotonic()
        rc_victim = procs[victim].wait(timeout=30)  # "raise": exits at once, not after the shutdown timeout
        survivor = procs[1 - victim]
        rc = survivor.wait(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        for p in procs:
            _kill(p)
    text = logs[1 - victim].read_text()
    print(f"victim {victim} ({how}, rc {rc_victim}): survivor rc {rc} after {elapsed:.1f} s")
    assert rc_victim != 0 and rc != 0
    assert elapsed < 60
    assert "JAX distributed service detected fatal errors" in text and "another task died" in text, text
    if how == "raise":
        assert "process 1 fails on purpose" in logs[victim].read_text()
        assert "exiting now instead of waiting at JAX's shutdown barrier" in logs[victim].read_text()


def test_launcher_prefixes_output_and_stops_the_others_when_one_fails(tmp_path):
    args = ["--nproc", "2", "--no-auto-init", str(SCRIPTS / "fail_fast.py")]
    rc, log, seconds = _launch(tmp_path, args, timeout_s=60)
    assert rc == 17, log
    assert "[0] hello from 0" in log and "[1] hello from 1" in log and "[1] failing" in log
    assert "[launch] process 1 failed first: exit code 17" in log
    assert "terminating the other 1 running process(es)" in log
    assert seconds < 30  # process 0 would have slept for 600 s


def test_launcher_names_the_process_that_raised_first(tmp_path):
    """Process 0 exits first (its collective failed) but process 1 raised first: the launcher names 1."""
    args = ["--nproc", "2", "--no-auto-init", str(SCRIPTS / "raise_first.py"), str(tmp_path / "flag")]
    rc, log, _ = _launch(tmp_path, args, timeout_s=60)
    assert "[launch] process 1 failed first (uncaught ValueError, reported first): exit code 1" in log, log
    assert rc == 1


def test_launcher_names_a_process_killed_by_a_signal_it_did_not_send(tmp_path):
    """Process 1 is SIGKILLed; process 0's collective fails and it reports that first: 1 is the cause."""
    args = ["--nproc", "2", "--no-auto-init", str(SCRIPTS / "killed.py"), str(tmp_path / "flag"), "kill"]
    rc, log, _ = _launch(tmp_path, args, timeout_s=60)
    assert "[launch] process 1 failed first (killed by SIGKILL, which the launcher did not send): " \
           "exit code 137 (SIGKILL)" in log, log
    assert "[launch] non-zero exits: process 0: exit code 1 (uncaught JaxRuntimeError); " \
           "process 1: exit code 137 (SIGKILL)." in log, log
    assert rc == 137 and "-9" not in log


def test_launcher_does_not_blame_a_process_aborted_after_another_failed(tmp_path):
    """SIGABRT is how JAX stops the survivors: the process that reported first stays the cause."""
    args = ["--nproc", "2", "--no-auto-init", str(SCRIPTS / "killed.py"), str(tmp_path / "flag"), "abort"]
    rc, log, _ = _launch(tmp_path, args, timeout_s=60)
    assert "[launch] process 0 failed first (uncaught JaxRuntimeError, reported first): exit code 1" in log, log
    assert "process 1: exit code 134 (SIGABRT)" in log and rc == 1


def test_launcher_timeout_stops_every_process(tmp_path):
    args = ["--nproc", "2", "--timeout", "2", "--no-auto-init", str(SCRIPTS / "fail_fast.py"), "--sleep-all"]
    rc, log, seconds = _launch(tmp_path, args, timeout_s=60)
    assert rc == 124 and "ran past --timeout 2 s" in log, log
    assert seconds < 30


def test_launcher_splits_its_options_from_the_script():
    assert split_command_line(["--nproc", "2", "train.py", "--nproc", "3"]) == (
        ["--nproc", "2"], ["train.py", "--nproc", "3"])
    assert split_command_line(["--nproc=2", "--no-auto-init", "-m", "pkg.mod", "-x"]) == (
        ["--nproc=2", "--no-auto-init"], ["-m", "pkg.mod", "-x"])
    assert split_command_line(["--nproc", "2", "--", "-weird.py"]) == (["--nproc", "2"], ["-weird.py"])


def test_initialize_alone_is_a_no_op_and_late_joining_is_an_error(monkeypatch):
    assert initialize() is False
    assert initialize(distributed=False) is False
    monkeypatch.setenv(join.COORDINATOR, "127.0.0.1:1")
    with pytest.raises(ValueError, match="JSHARD_NUM_PROCESSES and JSHARD_PROCESS_ID not: start the processes"):
        initialize()
    monkeypatch.setenv(join.NUM_PROCESSES, "2")
    monkeypatch.setenv(join.PROCESS_ID, "0")
    jax.devices()  # this process already uses JAX
    with pytest.raises(RuntimeError, match="must run before any JAX computation or jax.devices"):
        initialize()


def test_global_batch_errors_name_the_leaf_and_the_fix():
    mesh = js.make_mesh()
    with pytest.raises(ValueError, match=r"Batch leaf \['x'\] of local shape \(12, 3\): this process holds 8 "
                                         r"slice\(s\).*must be a multiple of 8; pad or drop"):
        global_batch({"x": np.ones((12, 3), np.float32)}, mesh)
    with pytest.raises(ValueError, match=r"Batch leaf \['t'\] of local shape \(\): a 0-d leaf has no batch dim"):
        global_batch({"t": np.float32(1)}, mesh)
    hsdp = js.make_mesh(replicate=2)
    batch = global_batch({"x": np.arange(16.0, dtype=np.float32)}, hsdp)
    assert batch["x"].sharding.spec == jax.sharding.PartitionSpec(("replicate", "fsdp"))


def test_first_difference_groups_processes_by_value():
    leaf = {0: {"leaf": {"['w']": "shape (3,)"}}, 1: {"leaf": {"['w']": "shape (4,)"}},
            2: {"leaf": {"['w']": "shape (3,)"}}, 3: {"leaf": {}}}
    assert agreement.first_difference(leaf) == (
        "leaf ['w']: processes 0, 2: shape (3,); process 1: shape (4,); process 3: (absent)")
    assert agreement.first_difference({0: leaf[0], 1: leaf[0]}) is None
