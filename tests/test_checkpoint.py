"""Orbax checkpoints of sharded train states: exact restores onto other meshes, async saves, killed saves."""

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import assert_zero_padding

import jshard as js
from jshard.checkpoint import CheckpointManager
from jshard.optim import shard_optimizer
from jshard.state_dict import full_state_dict

REPO = pathlib.Path(__file__).resolve().parents[1]


def _params(seed):
    rng = np.random.default_rng(seed)
    f32 = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    return {"block": {"w": f32(7, 15), "b": f32(10, 3)}, "head": f32(16, 17), "bias": f32(1), "scale": np.float32(2.0)}


def _tx():
    return shard_optimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.adafactor(0.05, min_dim_size_to_factor=3),
                                       optax.add_decayed_weights(1e-3)), min_size_to_shard=8)


def _shard(params, mesh, policy=None):
    block = js.fully_shard(params["block"], mesh, policy)
    return js.fully_shard({**params, "block": block}, mesh, policy)


def _train_state(mesh, seed=0, steps=2, policy=None):
    """A train state after a few optimizer steps (steps=0: freshly initialised, the restore target)."""
    params = _shard(_params(seed), mesh, policy)
    with jax.numpy_dtype_promotion("standard"):  # Optax mixes Python floats with int32 counts
        state = _tx().init(params)

        @jax.jit
        def step(p, s):
            updates, s = _tx().update(jax.tree.map(lambda x: jnp.sin(x) * 0.1, p), s, p)
            return optax.apply_updates(p, updates), s

        for _ in range(steps):
            params, state = step(params, state)
    buffers = js.fully_shard({"ids": np.arange(5, dtype=np.int32) * (seed + 1)}, mesh, policy)
    return {"params": params, "opt_state": state, "buffers": buffers, "step": steps}


def _assert_restored(restored, like, saved):
    """``restored`` has ``like``'s units, shapes and shardings, zero padding, and ``saved``'s values exactly."""
    assert jax.tree.structure(restored) == jax.tree.structure(like)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(like), strict=True):
        if isinstance(want, jax.Array):
            assert jax.typeof(got) == jax.typeof(want) and got.sharding.is_equivalent_to(want.sharding, got.ndim)
    full_got, full_want = full_state_dict(restored), full_state_dict(saved)
    assert jax.tree.structure(full_got) == jax.tree.structure(full_want)
    for got, want in zip(jax.tree.leaves(full_got), jax.tree.leaves(full_want), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    assert_zero_padding(restored)


MESH4 = lambda: js.make_mesh(devices=jax.devices()[:4])  # noqa: E731
TARGETS = {
    "same_mesh": (lambda: js.make_mesh(), None),
    "4_devices": (MESH4, None),  # (10, 3) pads to 12 rows instead of 16
    "hsdp_2x4": (lambda: js.make_mesh(replicate=2), None),
    "last_dim": (lambda: js.make_mesh(), js.FullyShardPolicy(shard_placement_fn=lambda p, x: -1 if x.ndim else None)),
    "offload": (MESH4, js.FullyShardPolicy(offload_policy=js.CPUOffloadPolicy())),
    "small_leaves_whole": (MESH4, js.FullyShardPolicy(replicate_below=31)),  # (10, 3), (1,), the ids: whole
}


@pytest.fixture(scope="module")
def saved_on_8(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt8")
    state = _train_state(js.make_mesh())
    with CheckpointManager(directory) as ckpt:
        ckpt.save(2, state)
    return directory, state


@pytest.mark.parametrize("target", TARGETS)
def test_restores_exactly_onto_another_mesh(saved_on_8, target):
    directory, saved = saved_on_8
    mesh, policy = TARGETS[target]
    like = _train_state(mesh(), seed=1, steps=0, policy=policy)
    with CheckpointManager(directory) as ckpt:
        assert ckpt.all_steps() == [2]
        restored = ckpt.restore(like)
    _assert_restored(restored, like, saved)
    assert restored["step"] == 2 and type(restored["step"]) is int


def test_restores_into_an_abstract_target(saved_on_8):
    directory, saved = saved_on_8
    mesh = js.make_mesh(replicate=2)
    abstract = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)  # noqa: E731
    params = _shard(abstract(_params(1)), mesh)
    with jax.numpy_dtype_promotion("standard"):
        opt_state = jax.eval_shape(_tx().init, params)
    buffers = js.fully_shard(abstract({"ids": np.arange(5, dtype=np.int32)}), mesh)
    like = {"params": params, "opt_state": opt_state, "buffers": buffers, "step": 0}
    with CheckpointManager(directory) as ckpt:
        restored = ckpt.restore(like)
    concrete_like = _train_state(js.make_mesh(replicate=2), seed=1, steps=0)
    _assert_restored(restored, concrete_like, saved)


def test_async_save_snapshots_the_state_and_grows_padding(tmp_path):
    """Saved from 4 devices (12 rows for (10, 3)), restored on 8 (16 rows): Orbax zero-fills the new rows."""
    state = _train_state(MESH4(), seed=2)
    expected = full_state_dict(state)
    with CheckpointManager(tmp_path, async_save=True) as ckpt:
        ckpt.save(2, state)
        for x in jax.tree.leaves(state):  # the save must not need the device arrays any more
            if isinstance(x, jax.Array):
                x.delete()
        ckpt.wait_until_finished()
        like = _train_state(js.make_mesh(), seed=1, steps=0)
        restored = ckpt.restore(like)
    for got, want in zip(jax.tree.leaves(full_state_dict(restored)), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(got, want)
    grown = restored["params"]["block"]["b"]
    assert grown.shape == (16, 3) and not np.asarray(grown)[10:].any()


def test_plain_orbax_reads_the_original_shapes(saved_on_8):
    """The checkpoint is usable without jshard: `layouts` gives each leaf's original shape."""
    directory, saved = saved_on_8
    with ocp.CheckpointManager(directory) as manager:
        layouts = manager.restore(2, args=ocp.args.Composite(layouts=ocp.args.JsonRestore()))["layouts"]
        shape = tuple(layouts["leaves"]["params/block/b"]["shape"])
        leaf_args = ocp.ArrayRestoreArgs(sharding=jax.sharding.NamedSharding(MESH4(), jax.P()), global_shape=shape,
                                         strict=False)
        item = {"params": {"block": {"b": jax.ShapeDtypeStruct(shape, np.float32)}}}
        args = ocp.args.PyTreeRestore(item=item, restore_args={"params": {"block": {"b": leaf_args}}},
                                      partial_restore=True)
        got = manager.restore(2, args=ocp.args.Composite(state=args))["state"]["params"]["block"]["b"]
    assert shape == (10, 3)
    np.testing.assert_array_equal(np.asarray(got), full_state_dict(saved)["params"]["block"]["b"])


_CHILD = """
import os, sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp, numpy as np, jshard as js
from jshard.checkpoint import CheckpointManager
base = np.arange(512 * 1024, dtype=np.float32).reshape(2048, 256)
with CheckpointManager(sys.argv[1], async_save=True) as ckpt:
    for step in range(1000):
        ckpt.save(step, {"params": js.fully_shard({"w": jnp.asarray(base + step)}), "step": step})
"""


def _entries(path):
    """A directory's entries; none if it is gone (the saver renames temporary directories as we look)."""
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def _listing(directory):
    """Finished steps, and the contents of unfinished (temporary) step directories."""
    names = _entries(directory)
    in_progress = [entry for n in names if "tmp" in n for entry in _entries(directory / n)]
    return sorted(int(n) for n in names if n.isdigit()), in_progress


def test_killed_save_leaves_the_previous_step_restorable(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while True:  # wait for a finished step >= 1 and a later save writing its arrays, then SIGKILL
            done, in_progress = _listing(tmp_path)
            if done and max(done) >= 1 and "state" in in_progress:
                child.send_signal(signal.SIGKILL)
                break
            assert child.poll() is None, child.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the child never had a save in progress"
            time.sleep(0.001)
    finally:
        child.kill()
        child.wait()
        child.stderr.close()
    done, in_progress = _listing(tmp_path)
    assert "state" in in_progress, "the kill did not land during a save"
    base = np.arange(512 * 1024, dtype=np.float32).reshape(2048, 256)
    like = {"params": js.fully_shard({"w": jnp.zeros((2048, 256))}, MESH4()), "step": 0}
    with CheckpointManager(tmp_path) as ckpt:
        step = ckpt.latest_step()
        assert step == max(done) >= 1
        restored = ckpt.restore(like)
        assert restored["step"] == step
        np.testing.assert_array_equal(full_state_dict(restored["params"])["w"], base + step)
        ckpt.save(step + 1, restored)  # and saving goes on after the crash
        assert ckpt.latest_step() == step + 1


def test_errors_name_the_leaf_and_the_fix(saved_on_8, tmp_path):
    directory, _ = saved_on_8
    like = _train_state(js.make_mesh(), seed=1, steps=0)
    other = {**_params(1), "head": np.zeros((16, 18), np.float32)}
    wrong = {**like, "params": _shard(other, js.make_mesh())}
    with CheckpointManager(directory) as ckpt:
        with pytest.raises(ValueError, match=r"Leaf \['params'\]\['head'\]: the checkpoint holds shape \(16, 17\) .*"
                                             r"`like` has shape \(16, 18\)"):
            ckpt.restore(wrong)
        with pytest.raises(ValueError, match=r"missing \[\].*unexpected \['step'\].*same structure"):
            ckpt.restore({k: v for k, v in like.items() if k != "step"})
        with pytest.raises(FileNotFoundError, match=r"No finished checkpoint step 7 .*steps: \[2\]"):
            ckpt.restore(like, step=7)
    with CheckpointManager(tmp_path / "empty") as ckpt, pytest.raises(FileNotFoundError, match="save one first"):
        ckpt.restore(like)


_TWO_PROCESS_SAVE = """
import sys
import jax, numpy as np
import jshard as js
from jshard.checkpoint import CheckpointManager
rng = np.random.default_rng(0)
params = js.fully_shard({"w": rng.normal(size=(10, 3)).astype(np.float32), "v": np.arange(7.0, dtype=np.float32)})
assert jax.process_count() == 2 and jax.device_count() == 8
with CheckpointManager(sys.argv[1], async_save=True) as ckpt:
    ckpt.save(5, {"params": params, "step": 5})
"""


def test_saved_by_two_processes_restores_in_one(tmp_path):
    script = tmp_path / "save.py"
    script.write_text(_TWO_PROCESS_SAVE)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "jshard.launch", "--nproc", "2", "--devices-per-proc", "4",
                          str(script), str(tmp_path / "ckpt")], env=env, cwd=REPO, capture_output=True, timeout=300)
    assert run.returncode == 0, run.stdout.decode()[-3000:] + run.stderr.decode()[-3000:]
    like = {"params": js.fully_shard({"w": np.zeros((10, 3), np.float32), "v": np.zeros(7, np.float32)}, MESH4()),
            "step": 0}
    with CheckpointManager(tmp_path / "ckpt") as ckpt:
        restored = ckpt.restore(like)
    full = full_state_dict(restored)
    np.testing.assert_array_equal(full["params"]["w"], np.random.default_rng(0).normal(size=(10, 3)).astype(np.float32))
    np.testing.assert_array_equal(full["params"]["v"], np.arange(7.0, dtype=np.float32))
    assert full["step"] == 5


def test_docs_example_runs():
    text = (REPO / "docs" / "checkpoint.md").read_text()
    code = re.search(r"<!-- checkpoint-example -->\s*```python\n(.*?)```", text, re.S).group(1)
    with jax.numpy_dtype_promotion("standard"):  # the example runs as users run it, with JAX's default promotion
        exec(compile(code, "docs/checkpoint.md", "exec"), {})
