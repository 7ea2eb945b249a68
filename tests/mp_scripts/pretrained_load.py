"""Load an unsharded safetensors file with ``load_pretrained`` in every process; save what each process holds.

Usage: python pretrained_load.py CHECKPOINT OUT_DIR   (under ``python -m jshard.launch``). Writes
``OUT_DIR/loaded{process}.npz``: each addressable shard (``born_init.shard_key``) and, as ``head_rows``, the
``(start, stop)`` rows of ``head`` this process read from the file.
"""

import sys
from pathlib import Path

from jshard.launch import initialize

initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from born_init import sharded_init, shards  # noqa: E402

import jshard as js  # noqa: E402
from jshard._state import pretrained  # noqa: E402
from jshard.state_dict import load_pretrained  # noqa: E402

path, out, me = sys.argv[1], Path(sys.argv[2]), jax.process_index()
read, original = [], pretrained.read_block


def logged(file, tensor, index):
    if tensor.shape:  # 0-d leaves have no rows
        read.append((tensor.shape, *index[0].indices(tensor.shape[0])[:2]))
    return original(file, tensor, index)


pretrained.read_block = logged
like = jax.eval_shape(sharded_init(js.make_mesh()), jax.random.key(0))
arrays = shards(load_pretrained(path, like))
arrays["head_rows"] = np.asarray(sorted({(a, b) for shape, a, b in read if shape == (20, 10)}))
np.savez(out / f"loaded{me}.npz", **arrays)
print(f"process {me}: {len(arrays) - 1} shards loaded", flush=True)
