"""Processes that disagree get the same clear error on every process, not a hang or a wrong result.

Usage: JSHARD_SYNC_TIMEOUT=5 python -m jshard.launch --nproc 2 --devices-per-proc 4 mismatch.py
Process 1 differs from process 0 in one thing per case; every process prints
``CAUGHT <case> <ExceptionType>: <message>`` for each error it catches.
"""

import jax
import numpy as np
from mp_model import BATCH, init_params, local_rows, shard

import jshard as js
from jshard.batch import global_batch

me, n = jax.process_index(), jax.process_count()
mesh = js.make_mesh()


def case(name, fn):
    try:
        fn()
        print(f"NO ERROR {name}", flush=True)
    except (ValueError, RuntimeError) as e:
        print(f"CAUGHT {name} {type(e).__name__}: {e}", flush=True)


def uneven_batch():
    rows = local_rows({"x": np.zeros((BATCH, 6), np.float32)}, me, n)
    global_batch({"x": rows["x"][: -2 if me == 1 else None]}, mesh)


def other_policy():
    js.fully_shard(init_params()["block0"], mesh, js.FullyShardPolicy(reshard_after_forward=me == 1))


def other_model():
    shard(init_params(width=14 if me == 1 else 13), mesh)


def extra_unit():  # last: afterwards the processes have made different numbers of calls
    if me == 1:
        js.fully_shard(init_params()["head"], mesh)


case("batch", uneven_batch)
case("policy", other_policy)
case("model", other_model)
case("count", extra_unit)
