"""Plan the demo's transformer on a mesh larger than the machine: compile only, nothing allocated.

``python -m jshard.report --plan`` (:func:`main`) and ``jshard.report.plan`` run it.

[Note: planning] ``compiled.memory_analysis()`` and the compiled HLO give per-device
memory and collectives without running anything, and ``js.fully_shard`` accepts
``jax.ShapeDtypeStruct`` leaves. What compiling needs is devices to name: a mesh of 64
needs 64 devices, which an ``AbstractMesh`` cannot stand in for (jax 0.10 refuses to
lower for it without ``lowering_platforms``, and cannot compile it). Simulated CPU
devices cost nothing until used, so when this process has too few devices the plan
runs in a subprocess started with ``JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=n`` and hands
its report back as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

import jshard as js
from jshard._report.report import Report, step_report
from jshard.demo import model as T


def _concrete(tree: Any, mesh: Any) -> Any:
    """Abstract leaves placed on ``mesh`` (``eval_shape`` gives them abstract-mesh shardings)."""

    def place(x):
        sharding = getattr(x, "sharding", None)
        spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
        kind = getattr(sharding, "memory_kind", None)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec, memory_kind=kind))

    return jax.tree.map(place, tree)


def plan_in_process(size: str, devices: int, replicate: int, batch: int | None, mixed_precision: bool) -> Any:
    """The plan on this process's first ``devices`` devices (see :func:`plan`)."""
    config = T.SIZES[size]
    mesh = js.make_mesh(replicate=replicate, devices=jax.devices()[:devices])
    mp = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32) if mixed_precision else None
    params = T.shard_lm(T.abstract_params(config), mesh, mp)
    optimizer = js.shard_optimizer(optax.adamw(1e-4))
    opt_state = _concrete(jax.eval_shape(optimizer.init, params), mesh)
    tokens = jax.ShapeDtypeStruct(
        (batch or devices, config.seq_len + 1), jnp.int32,
        sharding=NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names))),
    )
    return step_report(T.jshard_train_step(config, optimizer), params, opt_state, tokens)


def plan(size: str = "1b", *, devices: int = 64, replicate: int = 1, batch: int | None = None,
         mixed_precision: bool = False) -> Any:
    """Per-device memory and collectives of training a stacked transformer, compile only.

    The model is the demo's (``jshard/demo/model.py``) (``"1b"``: 18 blocks of width
    2048, vocabulary 32768, context 1024: about 1.04e9 parameters), sharded as the demo
    shards it, trained with AdamW. Nothing is allocated: parameters, optimizer state and
    batch are ``jax.ShapeDtypeStruct``. With fewer devices here than asked for, the plan
    runs in a subprocess with that many simulated CPU devices (see [Note: planning]).

    Args:
      size: ``"tiny"``, ``"small"``, ``"medium"`` or ``"1b"``.
      devices: devices in the mesh.
      replicate: ``R > 1`` plans HSDP with ``R`` replicas of ``devices // R`` shards.
      batch: global batch in sequences (default: one per device).
      mixed_precision: bf16 parameters for compute and all-gather, fp32 reduction.

    Returns:
      A :class:`jshard.report.Report`.

    Example:
      >>> from jshard.report import plan
      >>> report = plan("tiny", devices=16)
      >>> report.analytic.devices, report.memory.argument == report.analytic.argument_bytes
      (16, True)
    """
    if len(jax.devices()) >= devices:
        return plan_in_process(size, devices, replicate, batch, mixed_precision)
    cmd = [sys.executable, "-m", "jshard.report", "--plan", "--json", "--size", size, "--devices", str(devices),
           "--replicate", str(replicate)] + (["--batch", str(batch)] if batch else [])
    cmd += ["--mixed-precision"] if mixed_precision else []
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"Planning on {devices} simulated CPU devices failed:\n{done.stderr[-4000:]}")
    return Report.from_dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> None:
    """``python -m jshard.report --plan``: plan a stacked transformer on a large mesh.

    Example:
      >>> from jshard.report import main
      >>> main(["--plan", "--size", "1b", "--devices", "64"])  # doctest: +SKIP
      jshard step report: mesh {fsdp=64}, 64 devices, shard size N=64, replicate R=1
      ...
    """
    parser = argparse.ArgumentParser(prog="python -m jshard.report", description=main.__doc__.splitlines()[0])
    parser.add_argument("--plan", action="store_true", help="compile-only plan (the only mode)")
    parser.add_argument("--size", default="1b", choices=list(T.SIZES), help="model size (default 1b)")
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--replicate", type=int, default=1)
    parser.add_argument("--batch", type=int, default=None, help="global batch (default: one sequence per device)")
    parser.add_argument("--mixed-precision", action="store_true", help="bf16 params, fp32 reduce")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = parser.parse_args(argv)
    report = plan(args.size, devices=args.devices, replicate=args.replicate, batch=args.batch,
                  mixed_precision=args.mixed_precision)
    print(report.to_json() if args.json else report)
