"""Faults in a 2-process job: a process that hangs in its data loading, preemption, a non-finite gradient.

Usage (joins the job itself: runs with or without jshard.launch):
  faults.py hang STEPS [plain]   process 1 sleeps in its data loading at step 3 (plain: a loop that does
                                 not mark its steps; only js.global_batch tells the watchdog)
  faults.py preempt OUT STEPS [reference]
                                 train with a CheckpointManager in OUT; resume from its latest step;
                                 on SIGTERM save at the agreed step and exit PREEMPTED_EXIT; at the
                                 end process 0 writes OUT/final.npz (reference: then trains STEPS
                                 more from the initial state, uninterrupted, into OUT/uninterrupted.npz)
  faults.py finite OUT           optax.apply_if_finite with an Inf put on one device of process 1
"""

import atexit
import os
import sys
import threading
import time

from jshard.launch import initialize


def _report_watchdog_at_exit():  # registered before initialize(): runs after jshard's own exit hooks
    alive = any(t.name == "jshard-watchdog" and t.is_alive() for t in threading.enumerate())
    print(f"watchdog thread alive at exit: {alive}", flush=True)


atexit.register(_report_watchdog_at_exit)
initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from mp_model import OPTIMIZER, batches, init_params, local_rows, loss_fn, shard, train_step  # noqa: E402

import jshard as js  # noqa: E402
from jshard.batch import global_batch  # noqa: E402
from jshard.checkpoint import CheckpointManager  # noqa: E402
from jshard.launch import PREEMPTED_EXIT, steps  # noqa: E402

me, n = jax.process_index(), jax.process_count()
mesh = js.make_mesh()
mode = sys.argv[1]


def load_batch(data, k):
    """The data loader: process 1 stalls at step 3 in the hang case (a stuck disk or reader)."""
    if mode == "hang" and me == 1 and k == 3:
        time.sleep(1000)
    return global_batch(local_rows(data[k], me, n), mesh)


if mode == "hang":
    total = int(sys.argv[2])
    data = batches(total)
    params = shard(init_params(), mesh)
    opt_state = OPTIMIZER.init(params)
    for k in (range(total) if sys.argv[3:] == ["plain"] else steps(range(total))):
        batch = load_batch(data, k)
        params, opt_state, loss = train_step(params, opt_state, batch)
        print(f"step {k} loss {float(loss):.6f}", flush=True)
    print("finished", flush=True)

elif mode == "preempt":
    out, total = sys.argv[2], int(sys.argv[3])
    data = batches(total)

    def initial_state():
        params = shard(init_params(), mesh)
        return {"params": params, "opt_state": OPTIMIZER.init(params)}

    def save_final(state, name):
        full = js.unshard(state["params"])
        if me == 0:
            flat = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree.flatten_with_path(full)[0]}
            np.savez(os.path.join(out, name), **flat)

    state = initial_state()
    ckpt = CheckpointManager(os.path.join(out, "ckpt"))
    start = 0
    if ckpt.latest_step() is not None:
        start = ckpt.latest_step()
        state = ckpt.restore(state)
        print(f"resumed at step {start}", flush=True)
    for k in steps(range(start, total), start=start):
        if ckpt.reached_preemption(k):
            ckpt.save(k, state)  # the state before step k: a resumed run starts at k
            ckpt.wait_until_finished()
            print(f"preempted: saved step {k}", flush=True)
            sys.exit(PREEMPTED_EXIT)
        params, opt_state, loss = train_step(state["params"], state["opt_state"], load_batch(data, k))
        state = {"params": params, "opt_state": opt_state}
        print(f"step {k} loss {float(loss):.6f}", flush=True)
        time.sleep(0.3)
    save_final(state, "final.npz")
    if sys.argv[4:] == ["reference"]:  # the same steps in this process, never interrupted (no new compile)
        state = initial_state()
        for k in range(total):
            params, opt_state, _ = train_step(state["params"], state["opt_state"], load_batch(data, k))
            state = {"params": params, "opt_state": opt_state}
        save_final(state, "uninterrupted.npz")
    print("finished", flush=True)

elif mode == "finite":
    out = sys.argv[2]
    guarded = js.shard_optimizer(optax.apply_if_finite(optax.sgd(0.1, momentum=0.9), max_consecutive_errors=5))
    params = shard(init_params(), mesh)
    opt_state = guarded.init(params)
    grad_fn = jax.jit(js.value_and_grad(loss_fn, unshard_params=False))
    update = jax.jit(guarded.update)
    data = batches(3)
    for k in range(3):
        _, grads = grad_fn(params, global_batch(local_rows(data[k], me, n), mesh))
        if k == 1:  # one device of process 1 holds an Inf in its shard of block0's weight
            leaf = grads["block0"]["w"]
            shards = [s.data if (me != 1 or i != 2) else jnp.full_like(s.data, jnp.inf)
                      for i, s in enumerate(leaf.addressable_shards)]
            bad = jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, shards)
            grads = jax.tree.map(lambda x, bad=bad, leaf=leaf: bad if x is leaf else x, grads)
        before = js.unshard(params)
        updates, opt_state = update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        after = js.unshard(params)
        same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True))
        print(f"step {k} notfinite_count {int(opt_state.notfinite_count)} total {int(opt_state.total_notfinite)} "
              f"params unchanged {same}", flush=True)
    digest = float(sum(np.abs(np.asarray(x)).sum() for x in jax.tree.leaves(js.unshard(params))))
    print(f"final digest {digest:.9f}", flush=True)
