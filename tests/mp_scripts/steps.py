"""Train the common model step after step, printing ``step K`` after each (a victim for kill tests).

Usage: python steps.py STEPS [RAISE_AT RAISE_ON]   (joins the job itself: runs with or without
jshard.launch); with RAISE_AT and RAISE_ON, process RAISE_ON raises after step RAISE_AT.
"""

import sys
import time

from jshard.launch import initialize

initialize()

import jax  # noqa: E402
from mp_model import batches, init_params, local_rows, shard, train  # noqa: E402

import jshard as js  # noqa: E402
from jshard.batch import global_batch  # noqa: E402

me, n = jax.process_index(), jax.process_count()
mesh = js.make_mesh()
sharded = shard(init_params(), mesh)
for k, batch in enumerate(batches(int(sys.argv[1]))):
    sharded, _, losses = train(sharded, [global_batch(local_rows(batch, me, n), mesh)])
    print(f"step {k} loss {losses[0]:.6f}", flush=True)
    if len(sys.argv) > 3 and k == int(sys.argv[2]) and me == int(sys.argv[3]):
        raise RuntimeError(f"process {me} fails on purpose after step {k}")
    time.sleep(0.2)
print("finished", flush=True)
