"""Train the common model in every process; write losses, full params and a checkpoint.

Usage: python -m jshard.launch --nproc 2 --devices-per-proc 4 train.py OUT_DIR STEPS
Each process writes ``OUT_DIR/process{i}.npz`` (losses and the unsharded params it
gathered), process 0 ``OUT_DIR/state_dict.npz`` (a full state dict made for process 0
only); all processes save the sharded state with plain Orbax to ``OUT_DIR/ckpt`` and with
``jshard.checkpoint.CheckpointManager`` to ``OUT_DIR/managed``.
"""

import os
import sys

import jax

jax.config.update("jax_numpy_dtype_promotion", "strict")

import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from mp_model import batches, init_params, local_rows, shard, train  # noqa: E402

import jshard as js  # noqa: E402
from jshard.batch import global_batch  # noqa: E402
from jshard.checkpoint import CheckpointManager  # noqa: E402
from jshard.launch import initialize  # noqa: E402
from jshard.state_dict import full_state_dict, load_full_state_dict  # noqa: E402


def _flat(tree):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree.flatten_with_path(tree)[0]}


def _equal(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


initialize()  # a no-op here: the launcher already joined; kept to show the one-call form
out_dir, steps = sys.argv[1], int(sys.argv[2])
me, n = jax.process_index(), jax.process_count()
print(f"process {me} of {n}: {jax.local_device_count()} local of {jax.device_count()} devices", flush=True)

mesh = js.make_mesh()
host = init_params()
# Global params (e.g. from a jitted init): fully_shard takes them as well as host values.
replicated = jax.device_put(host, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
back = js.unshard(shard(replicated, mesh))
assert _equal(host, back)
print("global params round-trip", flush=True)
sharded = shard(host, mesh)
data = [global_batch(local_rows(b, me, n), mesh) for b in batches(steps)]
sharded, opt_state, losses = train(sharded, data)
print("losses", " ".join(f"{x:.6f}" for x in losses), flush=True)

full = jax.tree.map(np.asarray, js.unshard(sharded))  # gathered to every process

# HSDP: the replicate axis spans the two processes.
hsdp = js.make_mesh(replicate=2)
_, _, hsdp_losses = train(shard(host, hsdp), [global_batch(local_rows(b, me, n), hsdp) for b in batches(2)])
# FSDP x tensor parallel: "tp" pairs the devices inside each process, "fsdp" spans both.
tp = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
tp_host = {**host, "embed": {"w": jax.device_put(host["embed"]["w"], jax.NamedSharding(tp, jax.P("tp")))}}
tp_sharded = shard(tp_host, tp)
assert tp_sharded["embed"]["w"].sharding.spec == jax.P("tp", "fsdp")
_, _, tp_losses = train(tp_sharded, [global_batch(local_rows(b, me, n), tp) for b in batches(2)])
np.savez(os.path.join(out_dir, f"process{me}.npz"), losses=np.asarray(losses), hsdp_losses=np.asarray(hsdp_losses),
         tp_losses=np.asarray(tp_losses), **_flat(full))

# A full state dict on process 0 only (every process takes part in the gathers).
state = full_state_dict(sharded, process0_only=True)
if me == 0:
    np.savez(os.path.join(out_dir, "state_dict.npz"), **_flat(state))
    print("state dict on process 0:", sorted(_flat(state)), flush=True)
else:
    print("state dict on process", me, ":", state, flush=True)
# Loading a full state dict that every process holds gives back the same sharded params.
reloaded = load_full_state_dict(full, sharded)
assert _equal(full, js.unshard(reloaded))
print("full state dict reloaded", flush=True)

with ocp.StandardCheckpointer() as ckptr:  # plain Orbax
    ckptr.save(os.path.join(out_dir, "ckpt"), {"params": sharded, "opt_state": opt_state})
with CheckpointManager(os.path.join(out_dir, "managed")) as manager:  # jshard.checkpoint
    manager.save(steps, {"params": sharded, "opt_state": opt_state, "step": steps})
print("saved", flush=True)
