"""Initialise a model born sharded in every process; save each process's addressable shards.

Usage: python born_sharded.py OUT_DIR   (under ``python -m jshard.launch``). Writes
``OUT_DIR/shards{process}.npz``: for every leaf, each addressable shard's rows of the stored
(padded) array, keyed ``leaf|start:stop,...`` (``born_init.shard_key``), and the per-device bytes of the compiled init.
"""

import sys
from pathlib import Path

from jshard.launch import initialize

initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from born_init import sharded_init, shards  # noqa: E402

import jshard as js  # noqa: E402

out, me = Path(sys.argv[1]), jax.process_index()
build = jax.jit(sharded_init(js.make_mesh()))
key = jax.random.key(0)
params = build(key)
arrays = shards(params)
memory = build.lower(key).compile().memory_analysis()
arrays["output_bytes"] = np.asarray(memory.output_size_in_bytes)
np.savez(out / f"shards{me}.npz", **arrays)
print(f"process {me}: {len(jax.local_devices())} local devices, {len(arrays) - 1} shards saved", flush=True)
