"""Train the demo model on whatever JAX sees and report what an accelerator does with it.

``python -m benchmarks.accelerator`` (GPU, TPU or CPU; one device or several) picks the
largest demo size whose compiled step fits 90% of the device's memory (``--size`` to
choose), trains it FSDP-sharded over every device with bf16 parameters and fp32
reduction on an accelerator (fp32 on CPU), and prints per step: tokens/s, model FLOPs
utilisation (the compiled step's matmul FLOPs over the chip's peak, from
``jshard.report.HARDWARE``), the exposed communication (step time on all devices minus
the same per-device work on one device, where FSDP has nothing to send), and the
device's measured peak memory beside the compiled plan's. On CPU it is a dry run of
the same code (``tests/test_benchmarks.py`` runs it), so it works the first time a GPU
is present.

XLA flags GPU users should try (they must be set before JAX starts; names depend on the
jaxlib version, and XLA aborts on an unknown one, so this script only prints them):
:data:`GPU_FLAGS`.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jshard as js
from jshard.demo import model as T
from jshard.demo.plan import standard_promotion
from jshard.report import Memory, PlanConfig, hardware_of_device, matmul_flops, plan

GPU_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",  # overlap collectives with compute
    "--xla_gpu_enable_pipelined_all_gather=true",  # prefetch the next layer's gather in a scan
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",  # one collective for a unit's leaves
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
)
SIZES = ("tiny", "small", "medium", "1b")


def _memory_stat(device: Any, key: str) -> int | None:
    """One of ``device.memory_stats()`` (``None`` where the platform reports none, as CPUs do)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return (stats or {}).get(key)


def _setup(size: str, devices: list, batch_per_device: int, mixed_precision: bool, seed: int = 0):
    config = T.SIZES[size]
    mesh = js.make_mesh(devices=devices)
    mp = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32) if mixed_precision else None
    params = T.shard_lm(jax.jit(lambda k: T.init_params(config, k))(jax.random.key(seed)), mesh, mp)
    optimizer = js.shard_optimizer(optax.adamw(1e-4))
    opt_state = T.init_opt_state(optimizer, params, mesh)
    rng = np.random.default_rng(seed)
    shape = (batch_per_device * len(devices), config.seq_len + 1)
    tokens = jax.device_put(rng.integers(0, config.vocab, shape, dtype=np.int32),
                            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp")))
    step = jax.jit(standard_promotion(T.jshard_train_step(config, optimizer)), donate_argnums=(0, 1))
    compiled = step.lower(params, opt_state, tokens).compile()
    return compiled, (params, opt_state, tokens)


def _time(compiled: Any, args: tuple, steps: int) -> float:
    params, opt_state, tokens = args
    for _ in range(2):  # warm up
        params, opt_state, loss = compiled(params, opt_state, tokens)
    loss.block_until_ready()
    start = time.perf_counter()
    for _ in range(steps):
        params, opt_state, loss = compiled(params, opt_state, tokens)
    loss.block_until_ready()
    return (time.perf_counter() - start) / steps


def choose_size(devices: list, batch_per_device: int, mixed_precision: bool) -> str:
    """The largest demo size whose compiled step fits 90% of the first device's memory."""
    limit = _memory_stat(devices[0], "bytes_limit")
    if limit is None:
        return "tiny"
    best = "tiny"
    for size in SIZES:  # compiled here, for this device, by its own compiler
        config = PlanConfig(batch_per_device=batch_per_device, remat="full", mixed_precision=mixed_precision)
        if plan(f"jshard.demo.plan:build_{size}", devices=len(devices), config=config).report.memory.peak \
                <= 0.9 * limit:
            best = size
    return best


def run(size: str | None = None, steps: int = 10, batch_per_device: int = 1) -> dict[str, Any]:
    """Train and measure (see the module docstring); returns the figures it prints."""
    devices = jax.devices()
    platform = devices[0].platform
    mixed_precision = platform != "cpu"
    size = size or choose_size(devices, batch_per_device, mixed_precision)
    compiled, args = _setup(size, devices, batch_per_device, mixed_precision)
    planned = Memory.from_compiled(compiled).peak
    flops = matmul_flops(compiled.as_text())
    seconds = _time(compiled, args, steps)
    measured = _memory_stat(devices[0], "peak_bytes_in_use")
    alone = seconds
    if len(devices) > 1:
        one, one_args = _setup(size, devices[:1], batch_per_device, mixed_precision)
        alone = _time(one, one_args, steps)
    hardware = hardware_of_device(devices[0].device_kind)
    rate = None if hardware is None else (hardware.bf16_flops if mixed_precision else hardware.fp32_flops)
    config = T.SIZES[size]
    return {
        "platform": platform, "device_kind": devices[0].device_kind, "devices": len(devices), "size": size,
        "batch_per_device": batch_per_device, "seq_len": config.seq_len, "mixed_precision": mixed_precision,
        "step_seconds": seconds, "tokens_per_second": batch_per_device * len(devices) * config.seq_len / seconds,
        "flops_per_device": flops, "mfu": None if rate is None else flops / seconds / rate,
        "exposed_communication_seconds": seconds - alone, "planned_peak_bytes": planned,
        "measured_peak_bytes": measured, "hardware": None if hardware is None else hardware.name,
    }


def format_run(r: dict[str, Any]) -> str:
    """The figures as text."""
    mib = 2.0**20
    measured = "n/a (the platform reports no memory stats)" if r["measured_peak_bytes"] is None else \
        f"{r['measured_peak_bytes'] / mib:.1f} MiB"
    mfu = "n/a (no hardware profile for this device)" if r["mfu"] is None else f"{r['mfu']:.1%} of {r['hardware']}"
    exposed = "0 (one device: nothing to communicate)" if r["devices"] == 1 else \
        f"{r['exposed_communication_seconds'] * 1e3:.2f} ms (step on {r['devices']} devices minus the same on one)"
    return "\n".join([
        f"jshard accelerator benchmark: {r['devices']} x {r['device_kind']} ({r['platform']}), demo size {r['size']}, "
        f"batch {r['batch_per_device']}/device x {r['seq_len']} tokens, "
        + ("bf16 params / fp32 reduce" if r["mixed_precision"] else "fp32"),
        f"  step time          {r['step_seconds'] * 1e3:.2f} ms",
        f"  tokens/s           {r['tokens_per_second']:,.0f}",
        f"  MFU                {mfu} ({r['flops_per_device']:.3e} matmul FLOPs/device/step)",
        f"  exposed comm.      {exposed}",
        f"  peak memory        measured {measured}; planned (compiled) {r['planned_peak_bytes'] / mib:.1f} MiB",
        "  XLA flags to try on GPU (set in XLA_FLAGS before JAX starts):",
        *[f"    {flag}" for flag in GPU_FLAGS],
    ])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.accelerator", description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, help="demo size (default: the largest that fits)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-per-device", type=int, default=1)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    result = run(args.size, args.steps, args.batch_per_device)
    print(format_run(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
