"""Plan a training step on a mesh larger than the machine: compile only, nothing allocated.

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

import json
import os
import subprocess
import sys
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec


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
    import jax.numpy as jnp
    import optax

    import jshard as js
    from jshard import _transformer as T
    from jshard.report import step_report

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

    The model is the one of ``jshard/_transformer.py`` (``"1b"``: 18 blocks of width
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
    from jshard.report import Report

    cmd = [sys.executable, "-m", "jshard.report", "--plan", "--json", "--size", size, "--devices", str(devices),
           "--replicate", str(replicate)] + (["--batch", str(batch)] if batch else [])
    cmd += ["--mixed-precision"] if mixed_precision else []
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"Planning on {devices} simulated CPU devices failed:\n{done.stderr[-4000:]}")
    return Report.from_dict(json.loads(done.stdout.strip().splitlines()[-1]))
