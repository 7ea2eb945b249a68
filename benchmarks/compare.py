"""Replicated data parallel vs the hand-written GSPMD FSDP recipe vs jshard, side by side.

``python -m benchmarks.compare`` (``--quick`` for a smoke run) trains the same stacked
transformer (``jshard/demo/model.py``) with the three steps of
``benchmarks/variants.py`` on meshes over ``jax.devices()[:n]`` and reports per device:
peak memory (``memory_analysis``: argument + output + temp − alias), collective bytes
sent per step by kind (compiled HLO, loop trip counts included, ring model), and the
median step time over interleaved runs. It prints a table, writes
``results/compare.json`` and plots ``results/compare.png``.

Step times on simulated CPU devices share the machine's cores: they compare the
variants with each other, not with a real accelerator.

``--target tpu:v5p-8`` (any TPU topology ``jshard.report`` plans for; the ``tpu`` extra)
compiles the same steps with XLA:TPU for that topology's chips instead, compile only: the
arguments are abstract, nothing runs, and each case reports peak memory and collective bytes
without step times (device counts up to the topology's chips). It writes
``results/compare_<target>.json`` and no plot.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import time
from typing import Any

import jax

from benchmarks.memory_sweep import add_compile_arguments, compile_target
from benchmarks.variants import EXTRA_VARIANTS, VARIANTS, model_inputs, prepare
from jshard._plan.buffers import compile_reading_assignment
from jshard.demo import model as T
from jshard.report import (
    Memory,
    step_collectives,
    wire_bytes_by_kind,
)

RESULTS = pathlib.Path(__file__).parent / "results"


def _measure_compiled(prepared) -> dict[str, Any]:
    lowered = prepared.step.lower(*prepared.args)
    compiled, assignment = compile_reading_assignment(lowered)
    memory = Memory.from_compiled(compiled, assignment)
    by_kind = wire_bytes_by_kind(step_collectives(compiled.as_text(), lowered.as_text()))
    return {
        "peak_bytes": memory.peak,
        "argument_bytes": memory.argument,
        "temp_bytes": memory.temp,
        "output_bytes": memory.output,
        "xla_peak_bytes": memory.xla_peak,  # peak_memory_in_bytes, as XLA reports it
        "collective_bytes": {k: v for k, v in by_kind.items() if v},
        "collective_bytes_total": sum(by_kind.values()),
        "compiled": compiled,
    }


def _time_interleaved(compiled: dict[str, Any], args: dict[str, tuple], rounds: int) -> dict[str, float]:
    """Median seconds per step, the variants taking turns within each round."""
    for name, fn in compiled.items():
        jax.block_until_ready(fn(*args[name]))  # warm up
    times: dict[str, list[float]] = {name: [] for name in compiled}
    for _ in range(rounds):
        for name, fn in compiled.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args[name]))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def run_case(size: str, n: int, batch: int, rounds: int, variants: tuple[str, ...] = VARIANTS,
             pool: list[Any] | None = None) -> dict[str, Any]:
    """Every variant on ``size`` over the first ``n`` devices of ``pool`` (this process's by
    default). Devices of a TPU topology (``jshard.report.CompileTarget.tpu_devices``) are compiled
    for only: abstract arguments, no step times (``rounds`` unused)."""
    config = T.SIZES[size]
    devices = (jax.devices() if pool is None else pool)[:n]
    compile_only = devices[0].platform != jax.devices()[0].platform
    results, compiled, args = {}, {}, {}
    params, tokens = model_inputs(config, batch, abstract=compile_only)
    for variant in variants:
        prepared = prepare(variant, config, devices, params, tokens)
        results[variant] = _measure_compiled(prepared)
        compiled[variant] = results[variant].pop("compiled")
        args[variant] = prepared.args
    if not compile_only:
        for variant, seconds in _time_interleaved(compiled, args, rounds).items():
            results[variant]["step_seconds"] = seconds
    params = T.count_params(params)
    for variant in variants:
        base = results["gspmd"]
        results[variant]["vs_gspmd"] = {
            "peak": results[variant]["peak_bytes"] / base["peak_bytes"],
            "collective_bytes": _ratio(results[variant]["collective_bytes_total"], base["collective_bytes_total"]),
            "step_time": None if compile_only else results[variant]["step_seconds"] / base["step_seconds"],
        }
    return {"size": size, "params": params, "devices": n, "batch": batch, "variants": results}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(cases: list[dict[str, Any]]) -> str:
    """A Markdown table of every case (ratios are to the GSPMD recipe)."""
    head = ("| size | params | devices | variant | peak MiB/device | collective MiB/step (AG / RS / AR) "
            "| step ms (median) | peak vs gspmd | comm vs gspmd | time vs gspmd |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for case in cases:
        for variant, r in case["variants"].items():
            c = r["collective_bytes"]
            comm = " / ".join(f"{c.get(k, 0) / 2**20:.2f}" for k in ("all-gather", "reduce-scatter", "all-reduce"))
            v = r["vs_gspmd"]
            ms = f"{r['step_seconds'] * 1e3:.1f}" if "step_seconds" in r else "-"
            lines.append(
                f"| {case['size']} | {case['params'] / 1e6:.2f}M | {case['devices']} | {variant} "
                f"| {r['peak_bytes'] / 2**20:.2f} | {comm} | {ms} "
                f"| {v['peak']:.2f} | {_fmt_ratio(v['collective_bytes'])} | {_fmt_ratio(v['step_time'])} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the comparison; returns what it writes to JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 8 devices, few rounds")
    parser.add_argument("--sizes", nargs="+", default=None, help="model sizes (default: tiny small medium)")
    parser.add_argument("--devices", type=int, nargs="+", default=None, help="device counts (default: 1 2 4 8)")
    parser.add_argument("--batch", type=int, default=8, help="global batch in sequences")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 15, quick 3)")
    parser.add_argument("--variants", nargs="+", default=None,
                        help=f"default: {' '.join(VARIANTS + EXTRA_VARIANTS)} (quick: {' '.join(VARIANTS)})")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS, help="folder for compare.json / compare.png")
    add_compile_arguments(parser)
    args = parser.parse_args(argv)
    target, said = compile_target(args)
    pool = target.tpu_devices() if target.platform == "tpu" else jax.devices()[: target.devices]
    sizes = args.sizes or (["tiny"] if args.quick else ["tiny", "small", "medium"])
    counts = args.devices or ([min(8, len(pool))] if args.quick else [n for n in (1, 2, 4, 8) if n <= len(pool)])
    rounds = args.rounds or (3 if args.quick else 15)
    variants = tuple(args.variants or (VARIANTS if args.quick else VARIANTS + EXTRA_VARIANTS))
    cases = []
    if target.platform == "tpu":
        print(f"{said}: peaks and collectives, no step times", flush=True)
    print("\n".join(table([]).splitlines()), flush=True)
    for size in sizes:
        for n in counts:
            cases.append(run_case(size, n, args.batch, rounds, variants, pool))
            print("\n".join(table(cases[-1:]).splitlines()[2:]), flush=True)
    out = {
        "quick": args.quick,
        "rounds": rounds,
        "target": args.target,
        "backend": pool[0].platform,
        "device_kind": pool[0].device_kind,
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "cases": cases,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    if target.platform == "tpu":
        path = args.out / f"compare_{args.target.replace(':', '_')}.json"
        path.write_text(json.dumps(out, indent=1))
        print(f"wrote {path}")
        return out
    (args.out / "compare.json").write_text(json.dumps(out, indent=1))
    from benchmarks.plot import plot

    print(f"wrote {args.out / 'compare.json'} and {plot(out, args.out / 'compare.png')}")
    return out


if __name__ == "__main__":
    main()
