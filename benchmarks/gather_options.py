"""jshard's gather options compiled side by side: per leaf, one collective per unit, float8.

``python -m benchmarks.gather_options --target tpu:v5p:2x2x2`` (``--quick``: one small model on
``cpu:8``) compiles jshard's training step (benchmarks/memory_sweep.py's models and
``jshard_step``: loss and gradients, parameters donated, abstract inputs) of a few of the
sweep's models under three gather options:

- ``leaf``: one all-gather and one gradient reduction per leaf (the default);
- ``unit``: ``FullyShardPolicy(unit_collectives=True)``, one of each per unit through a flat
  buffer;
- ``float8``: ``custom_all_gather=js.float8_all_gather`` (e4m3 values and float32 row scales
  in one ``uint8`` collective).

Every option gathers in bfloat16 (``MixedPrecisionPolicy(param_dtype=bfloat16)``, float32
parameters): the float8 gather rounds bf16 shards, so the transformers, fp32 in the memory
sweep, run with that policy here under all three options (named ``bf16`` below) to compare
like for like. For each it records the peak per device (``jshard.report.Memory``), the matmul
FLOPs per device (``jshard.report.matmul_flops``), the compiled program's collectives (static
ops by kind, the dtypes of its all-gathers, and the bytes each device sends per step, loop
trips included, in the dtype the program was compiled to), how many all-gathers run
asynchronously and how many of those have a matmul scheduled in flight
(``gather_schedule``), and the lower + compile time. Writes
``results/gather_options_<target>.json``.

``--libtpu-flags async`` compiles under MaxText's async-collective flags
(``memory_sweep.ASYNC_COLLECTIVE_FLAGS``, set as ``LIBTPU_INIT_ARGS`` before libtpu starts: it
reads them once per process) and writes ``gather_options_<target>_async.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import time
from typing import Any

# First: memory_sweep gives jax 8 CPU devices before jax is imported.
from benchmarks.memory_sweep import (RESULTS, Model, add_compile_arguments, compile_target,  # isort: skip
                                     jshard_step, target_mesh)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jshard as js  # noqa: E402
from jshard._plan.buffers import compile_reading_assignment  # noqa: E402
from jshard._report.schedule import gather_schedule  # noqa: E402
from jshard._report.step_collectives import wire_bytes  # noqa: E402
from jshard.report import Memory, matmul_flops, step_collectives  # noqa: E402

OPTIONS: dict[str, dict[str, Any]] = {
    "leaf": {},
    "unit": {"unit_collectives": True},
    "float8": {"custom_all_gather": js.float8_all_gather},
}
KINDS = ("all-gather", "reduce-scatter", "all-reduce")


def models(quick: bool) -> list[Model]:
    """The models compiled: memory_sweep's, activations kept, bf16 gathers."""
    if quick:
        return [Model("gelu", True, 2, 256, 64, remat=False, bf16=True)]
    return [Model("gelu", False, 4, 512, 64, remat=False, bf16=True),
            Model("gelu", True, 4, 512, 64, remat=False, bf16=True),
            Model("transformer", False, 8, 256, 64, remat=False, bf16=True),
            Model("transformer", True, 8, 256, 64, remat=False, bf16=True),
            Model("gelu", False, 8, 1536, 512, remat=False, bf16=True),
            Model("gelu", True, 8, 1536, 512, remat=False, bf16=True)]


def compiled_bytes(c: Any) -> float:
    """What ``c`` sends per device per step in its compiled dtype (ring model, loop trips included)."""
    result = sum(math.prod(s) * np.dtype(c.compiled_dtype).itemsize for s in c.shapes)
    return wire_bytes(c.kind, result, c.group_size) * c.executions


def measure(m: Model, mesh: jax.sharding.Mesh, option: str) -> dict[str, Any]:
    """One compile of jshard's step for ``m`` under gather option ``option``."""
    start = time.perf_counter()
    step, args = jshard_step(m, mesh, **OPTIONS[option])
    with jax.numpy_dtype_promotion("standard"):
        compiled, assignment = compile_reading_assignment(step.lower(*args))
    seconds = time.perf_counter() - start
    hlo = compiled.as_text()
    collectives = [c for c in step_collectives(hlo) if c.kind in KINDS]
    schedule = gather_schedule(hlo)
    return {
        "peak_bytes": Memory.from_compiled(compiled, assignment).peak,
        "flops": matmul_flops(hlo),
        "ops": {k: sum(c.kind == k for c in collectives) for k in KINDS},
        "executions": {k: sum(c.executions for c in collectives if c.kind == k) for k in KINDS},
        "gather_dtypes": sorted({c.compiled_dtype for c in collectives if c.kind == "all-gather"}),
        "wire_bytes": {k: sum(compiled_bytes(c) for c in collectives if c.kind == k) for k in KINDS},
        "gathers_scheduled": len(schedule),
        "gathers_async": sum(g.asynchronous for g in schedule),
        "gathers_overlapping_matmuls": sum(g.matmuls_overlapped > 0 for g in schedule),
        "compile_seconds": seconds,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small stacked model (a smoke test)")
    parser.add_argument("--only", default="", help="run the models whose name contains this text")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS, help="folder for the JSON")
    add_compile_arguments(parser)
    args = parser.parse_args(argv)
    target, said = compile_target(args)
    mesh = target_mesh(target)
    print(said)
    print("| model | option | peak MiB | GFLOP | AG / RS / AR ops | AG dtype | AG / RS+AR MiB sent | "
          "AG async (overlapping matmuls) of | compile s |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for m in [m for m in models(args.quick) if args.only in m.name]:
        row = {**dataclasses.asdict(m), "name": m.name, "options": {}}
        for option in OPTIONS:
            r = measure(m, mesh, option)
            row["options"][option] = r
            ops, sent = r["ops"], {k: v / 2**20 for k, v in r["wire_bytes"].items()}
            print(f"| {m.name} | {option} | {r['peak_bytes'] / 2**20:.2f} | {r['flops'] / 1e9:.3f} | "
                  f"{ops['all-gather']} / {ops['reduce-scatter']} / {ops['all-reduce']} | "
                  f"{','.join(r['gather_dtypes'])} | {sent['all-gather']:.2f} / "
                  f"{sent['reduce-scatter'] + sent['all-reduce']:.2f} | {r['gathers_async']} "
                  f"({r['gathers_overlapping_matmuls']}) of {r['gathers_scheduled']} | "
                  f"{r['compile_seconds']:.1f} |", flush=True)
        rows.append(row)
    result = {"quick": args.quick, "target": args.target, "jax": jax.__version__, "models": rows}
    if args.libtpu_flags != "none":
        result["libtpu_init_args"] = os.environ["LIBTPU_INIT_ARGS"]
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"gather_options_{args.target.replace(':', '_')}"
    name += "" if args.libtpu_flags == "none" else f"_{args.libtpu_flags}"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
