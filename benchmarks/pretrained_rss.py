"""Host peak memory of loading an unsharded checkpoint: leaf by leaf (``load_pretrained``) against the whole tree.

``python -m benchmarks.pretrained_rss`` (``--quick`` for a 67 MiB model) writes one float32
model of 1.2 GiB (a 32003-row embedding, its largest leaf, and 36 layers of uneven widths) as a safetensors
file, a Flax msgpack file and an Orbax checkpoint of the plain tree, then loads each onto 8
simulated CPU devices in a fresh process per route, reading that process's peak resident set
(``VmHWM``, reset through ``/proc/self/clear_refs`` once the sharded ``like`` is built):

- ``stream``: ``jshard.state_dict.load_pretrained(path, like)``.
- ``whole``: the whole tree read onto the host by the library's own reader
  (``safetensors.numpy.load_file``, ``flax.serialization.msgpack_restore``, Orbax's restore
  to NumPy), then ``load_full_state_dict(tree, like)``.

On CPU the devices' shards live in the same process, so every route's peak includes the
placed model (``placed`` bytes, padding included); ``over`` is the peak above that: the
host's own buffers. The children run with glibc's malloc arenas capped at 2
(``MALLOC_ARENA_MAX``): one arena per reader thread (TensorStore's pool, for Orbax) moved the
quick model's Orbax peak by 20-33 MiB from run to run on a loaded machine, 15-22 capped.
Writes ``results/pretrained_rss.json``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import importlib
import json
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

FORMATS = {"safetensors": "model.safetensors", "msgpack": "flax_model.msgpack", "orbax": "orbax"}


def model_shapes(width: int, layers: int, vocab: int = 32003) -> dict:
    """A nested dict of leaf shapes: the embedding first (the largest leaf), then uneven layers."""
    layer = {"attn": (width, width + 7), "up": (width, 3 * width + 1), "down": (3 * width + 1, width), "norm": (width,)}
    return {"embed": (vocab, width), "layers": {str(i): dict(layer) for i in range(layers)}}


SIZES = {"quick": (512, 8, 4099), "full": (1024, 36, 32003)}  # width, layers, vocab


def leaf_shapes(shapes: dict, prefix: str = "") -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for key, value in shapes.items():
        name = f"{prefix}.{key}" if prefix else key
        out += leaf_shapes(value, name) if isinstance(value, dict) else [(name, value)]
    return out


def _tree(shapes: dict, make) -> dict:
    return {k: _tree(v, make) if isinstance(v, dict) else make(v) for k, v in shapes.items()}


def write_checkpoints(folder: pathlib.Path, shapes: dict) -> dict[str, str]:
    """The model (seeded normal float32) in each format under ``folder``: ``{format: path}``."""
    import flax.serialization
    import orbax.checkpoint as ocp
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tree = _tree(shapes, lambda s: rng.standard_normal(s, dtype=np.float32))
    paths = {f: str(folder / name) for f, name in FORMATS.items()}
    save_file({n: v for (n, _), v in zip(leaf_shapes(shapes), _flat(tree), strict=True)}, paths["safetensors"])
    pathlib.Path(paths["msgpack"]).write_bytes(flax.serialization.msgpack_serialize(tree))
    ocp.PyTreeCheckpointer().save(paths["orbax"], tree)
    return paths


def _flat(tree: dict) -> list[np.ndarray]:
    return [x for v in tree.values() for x in (_flat(v) if isinstance(v, dict) else [v])]


def _status(field: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


_READERS = {"safetensors": ["safetensors.numpy", "flax.traverse_util"], "msgpack": ["flax.serialization"],
            "orbax": ["orbax.checkpoint"]}


def _whole_tree(fmt: str, path: str) -> dict:
    if fmt == "safetensors":
        from flax.traverse_util import unflatten_dict
        from safetensors.numpy import load_file

        return unflatten_dict(load_file(path), sep=".")
    if fmt == "msgpack":
        import flax.serialization

        return flax.serialization.msgpack_restore(pathlib.Path(path).read_bytes())
    import orbax.checkpoint as ocp

    return ocp.PyTreeCheckpointer().restore(path)


def child(route: str, fmt: str, path: str, size: str) -> dict:
    """In a fresh process: the peak resident bytes of one load above those before it."""
    import jax

    import jshard as js
    from jshard.state_dict import load_full_state_dict, load_pretrained

    shapes = model_shapes(*SIZES[size])
    mesh = js.make_mesh()
    abstract = _tree(shapes, lambda s: jax.ShapeDtypeStruct(s, np.float32))
    layer_units = {k: js.fully_shard(v, mesh) for k, v in abstract["layers"].items()}
    like = js.fully_shard({**abstract, "layers": layer_units}, mesh)
    for module in _READERS[fmt]:  # imported before the measure: their code is no load's memory
        importlib.import_module(module)
    pathlib.Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    if route == "stream":
        loaded = load_pretrained(path, like)
    else:
        loaded = load_full_state_dict(_whole_tree(fmt, path), like)
    jax.block_until_ready(loaded)
    placed = sum(x.nbytes for x in jax.tree.leaves(loaded))
    return {"peak": _status("VmHWM") - before, "placed": placed}


def measure(route: str, fmt: str, path: str, size: str) -> dict:
    """:func:`child` in a subprocess with 8 CPU devices."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "8", "MALLOC_ARENA_MAX": "2"}
    cmd = [sys.executable, "-m", "benchmarks.pretrained_rss", "--child", route, fmt, path, size]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def run(size: str) -> dict:
    shapes = model_shapes(*SIZES[size])
    leaves = [4 * int(np.prod(s)) for _, s in leaf_shapes(shapes)]
    result = {"model_bytes": sum(leaves), "largest_leaf_bytes": max(leaves), "rows": []}
    with tempfile.TemporaryDirectory() as folder:
        paths = write_checkpoints(pathlib.Path(folder), shapes)
        for fmt, path in paths.items():
            for route in ("stream", "whole"):
                m = measure(route, fmt, path, size)
                result["rows"].append({"format": fmt, "route": route, **m, "over": m["peak"] - m["placed"]})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    parser.add_argument("--child", nargs=4, metavar=("ROUTE", "FORMAT", "PATH", "SIZE"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    result = run("quick" if args.quick else "full")
    mib = 2**20
    print(f"model {result['model_bytes'] / mib:.0f} MiB, largest leaf {result['largest_leaf_bytes'] / mib:.0f} MiB")
    for r in result["rows"]:
        print(f"{r['format']:12s} {r['route']:7s} peak {r['peak'] / mib:8.0f} MiB  placed {r['placed'] / mib:6.0f} MiB"
              f"  over {r['over'] / mib:7.0f} MiB")
    name = "pretrained_rss_quick.json" if args.quick else "pretrained_rss.json"
    pathlib.Path(args.out, name).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
