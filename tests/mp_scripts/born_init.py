"""The model that ``born_sharded.py`` initialises in each process and the test in one: blocks, then the root."""

import jax
import jax.numpy as jnp

import jshard as js


def init(key):
    k1, k2, k3 = jax.random.split(key, 3)
    blocks = {"up": jax.random.normal(k1, (3, 20, 36)), "down": jax.random.normal(k2, (3, 36, 20)),
              "bias": jnp.zeros((3, 36))}
    return {"blocks": blocks, "head": jax.random.normal(k3, (20, 10)), "scale": jnp.ones(())}


def sharded_init(mesh):
    def build(key):
        params = init(key)
        params["blocks"] = js.fully_shard(params["blocks"], mesh, js.FullyShardPolicy(scan_axis=0))
        return js.fully_shard(params, mesh)

    return build


def shard_key(path, index) -> str:
    """``leaf|start:stop,...``: one shard of a stored leaf, by its rows in the padded array."""
    rows = [f"{s.start or 0}:{s.stop if s.stop is not None else size}" for s, size in index]
    return jax.tree_util.keystr(path) + "|" + ",".join(rows)


def shards(params) -> dict:
    """Every addressable shard of every leaf, by :func:`shard_key`."""
    import numpy as np

    out = {}
    for path, x in jax.tree.flatten_with_path(params)[0]:
        for shard in x.addressable_shards:
            out[shard_key(path, zip(shard.index, x.shape, strict=True))] = np.asarray(shard.data)
    return out
