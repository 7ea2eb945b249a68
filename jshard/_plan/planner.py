"""Compile a builder's step on a mesh of any size, compile only, and report it per device.

[Note: planning] ``compiled.memory_analysis()`` and the compiled HLO give per-device
memory, collectives and FLOPs without running anything, and ``js.fully_shard`` accepts
``jax.ShapeDtypeStruct`` leaves. What compiling needs is devices to name: a mesh of 256
needs 256 devices, which an ``AbstractMesh`` cannot stand in for (jax 0.10 refuses to
lower for it without ``lowering_platforms``, and cannot compile it). Simulated CPU
devices cost nothing until used, so when this process has too few devices the plan
runs in a subprocess started with ``JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=n`` and hands
its result back as JSON. The program compiled there is XLA:CPU's; docs/planning.md says
how far a GPU or TPU program may differ.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jshard._plan.buffers import Buffer, buffer_lines, compile_reading_assignment, largest_temporaries
from jshard._plan.compiler import CompileTarget
from jshard._plan.failure import ERROR_FILE_ENV, from_planning_process, target_raised
from jshard._plan.target import PlanConfig, call_build, load_build, spec_of
from jshard._report.flops import matmul_flops
from jshard._report.report import Report, format_report, report_compiled
from jshard._report.step_collectives import data_center_bytes
from jshard._sharding.mesh import make_mesh, tensor_parallel_mesh


def plan_mesh(devices: int, replicate: int = 1, tensor_parallel: int = 1,
              pool: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
    """The planning mesh on the first ``devices`` devices of ``pool`` (this process's by default).

    :func:`jshard.make_mesh`'s (``("fsdp",)``, or ``("replicate", "fsdp")`` with
    ``replicate > 1``); with ``tensor_parallel > 1`` a trailing ``"tp"`` axis of that
    size, every axis Auto (GSPMD's tensor parallelism, as the demo's ``--tensor-parallel``;
    ``jshard._sharding.mesh.tensor_parallel_mesh`` says how its groups lie on a TPU torus).
    """
    pool = list(jax.devices() if pool is None else pool)
    if devices < 1 or devices % (replicate * tensor_parallel) or devices > len(pool):
        raise ValueError(f"replicate={replicate} x tensor_parallel={tensor_parallel} must divide the {devices} "
                         f"devices of the plan (there are {len(pool)}); choose divisors of it.")
    chosen = pool[:devices]
    if tensor_parallel == 1:
        return make_mesh(replicate=replicate, devices=chosen)
    return tensor_parallel_mesh(tensor_parallel, replicate=replicate, devices=chosen)


@dataclasses.dataclass(frozen=True)
class Plan:
    """One compiled configuration of a builder's step: what it needs and sends per device.

    Attributes:
      target: the builder, ``"pkg.module:build"``.
      config: the :class:`PlanConfig` it was built with.
      report: memory, collectives and the analytic figures (:class:`jshard.report.Report`).
      flops: matrix-multiply FLOPs per device per step (recomputation included).
      compile_seconds: wall time of building, lowering and compiling.
      platform: the compiler's platform (``"cpu"`` for simulated devices).
      temporaries: the largest buffers among the temporaries, from XLA's buffer
        assignment ([Note: temporary buffers]).
      dcn_bytes: bytes each device hands the data-center network per step (multi-slice TPU
        plans: XLA:TPU compiles a collective across slices to ``send`` ops to its megascale
        runtime, outside the slice's collectives above); 0 on one slice.

    Example:
      >>> from jshard.report import plan
      >>> p = plan("jshard.demo.plan:build_tiny", devices=8)
      >>> p.report.analytic.devices, p.report.memory.argument == p.report.analytic.argument_bytes
      (8, True)
    """

    target: str
    config: PlanConfig
    report: Report
    flops: float
    compile_seconds: float
    platform: str
    temporaries: tuple[Buffer, ...] = ()
    dcn_bytes: float = 0.0

    @property
    def bound_bytes(self) -> float:
        """The peak bound of FSDP2 without activations, in bytes.

        The state the step holds (its arguments, the outputs donated into them), one sharded
        gradient tree, and three gathered units (the one running, the one prefetched, the full
        gradient of one before its reduce-scatter).
        """
        a = self.report.analytic
        return a.argument_bytes + a.grad_bytes + 3 * a.gathered_unit_bytes

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready); :meth:`from_dict` rebuilds the plan."""
        return {"target": self.target, "config": dataclasses.asdict(self.config), "report": self.report.to_dict(),
                "flops": self.flops, "compile_seconds": self.compile_seconds, "platform": self.platform,
                "temporaries": [dataclasses.asdict(b) for b in self.temporaries],
                "dcn_bytes": self.dcn_bytes}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """The plan :meth:`to_dict` gave."""
        buffers = tuple(Buffer(**{**b, "shape": tuple(b["shape"])}) for b in data.get("temporaries", ()))
        return cls(data["target"], PlanConfig(**data["config"]), Report.from_dict(data["report"]),
                   float(data["flops"]), float(data["compile_seconds"]), data["platform"], buffers,
                   float(data.get("dcn_bytes", 0.0)))

    def __str__(self) -> str:
        a, m = self.report.analytic, self.report.memory
        wire = self.report.collective_bytes
        fsdp_wire = wire["all-gather"] + wire["reduce-scatter"]
        ring = max(a.param_bytes * (a.shard_size - 1), 1)  # the parameters' bytes times (N-1)/N, all shards
        lines = [
            f"plan of {self.target} ({self.config.describe()}), compiled for {self.platform} in "
            f"{self.compile_seconds:.1f} s",
            format_report(self.report),
            "",
            f"FLOPs per device per step (matmuls, recomputation included): {self.flops:.4g}",
            f"ZeRO-3 traffic: all-gather + reduce-scatter {_size(fsdp_wire)}/device/step = "
            f"{fsdp_wire / ring:.2f} x params (analytic {(a.all_gather + a.reduce_scatter) / ring:.2f}"
            " x: 3 with resharding after forward, 2 without, at equal dtypes)",
            f"FSDP2's bound without activations (state {_size(a.argument_bytes)} + sharded gradients "
            f"{_size(a.grad_bytes)} + 3 x the largest gathered unit {_size(3 * a.gathered_unit_bytes)}): "
            f"{_size(self.bound_bytes)}; compiled peak {_size(m.peak)}"
            + (", within it" if m.peak <= self.bound_bytes else
               f", {_size(m.peak - self.bound_bytes)} above it: activations and XLA scratch"),
        ]
        if self.dcn_bytes:
            within = sum(c.wire_bytes_per_step for c in self.report.collectives)
            lines.append(f"between slices (data-center network): {_size(self.dcn_bytes)}/device/step sent; "
                         f"within a slice (the collectives above): {_size(within)}/device/step")
            if a.all_reduce:  # HSDP's replicas span the slices: XLA:TPU sends their all-reduce as above
                lines.append(f"  the analytic all-reduce across replicas ({_size(a.all_reduce)}) goes between slices "
                             "where the replicas sit in different ones: counted on this line, not in the all-reduce "
                             "row above (collectives within a slice)")
        if not m.alias and m.output > 0.1 * m.argument:
            lines.append("note: the step donates no arguments; XLA then parks temporaries in the output buffers, "
                         "so temp reads low: jit it with donate_argnums for a training step's real figure")
        return "\n".join(lines + buffer_lines(self.temporaries, m.temp))


def _size(x: float) -> str:
    return f"{x / 2**30:.3f} GiB" if abs(x) >= 2**30 else f"{x / 2**20:.2f} MiB"


def resolve_build(build: Callable[..., Any] | str) -> tuple[str, Callable[..., Any]]:
    """``(name, builder)``: a name imported, a builder named (its own name when not importable)."""
    if isinstance(build, str):
        return build, load_build(build)
    try:
        return spec_of(build), build
    except ValueError:  # planned here: it need not be importable
        return getattr(build, "__qualname__", repr(build)), build


def lower_target(build: Callable[..., Any] | str, config: PlanConfig, mesh: jax.sharding.Mesh) -> tuple:
    """``(name, args, params, lowered)``: the builder's program built and lowered on ``mesh``, a failure
    of the target's own code raised as one line ([Note: planning errors])."""
    spec, fn = resolve_build(build)
    try:
        program, args, params = call_build(fn, mesh, config)
        lowered = (program if hasattr(program, "lower") else jax.jit(program)).lower(*args)
    except ValueError:  # jshard's own checks, or the user's: one line already
        raise
    except Exception as err:
        raise target_raised(spec, err) from err
    return spec, args, params, lowered


def plan_here(build: Callable[..., Any] | str, config: PlanConfig, mesh: jax.sharding.Mesh) -> Plan:
    """Build, lower and compile on ``mesh`` in this process."""
    start = time.perf_counter()
    config = config.for_devices(mesh.devices.flat[0].device_kind)
    spec, args, params, lowered = lower_target(build, config, mesh)
    compiled, assignment = compile_reading_assignment(lowered)
    text = compiled.as_text()
    report = report_compiled(compiled, lowered.as_text(), args, params, compiled_text=text,
                             buffer_assignment=assignment)
    buffers = largest_temporaries(assignment, report.placements)
    return Plan(spec, config, report, matmul_flops(text), time.perf_counter() - start,
                mesh.devices.flat[0].platform, buffers, data_center_bytes(text))


_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\d+")


def run_in_devices(argv: Sequence[str], devices: int) -> Any:
    """``python -m jshard.report *argv --json`` with ``devices`` simulated CPU devices; its JSON.

    A target that fails there raises here as it would have here ([Note: planning errors]).
    """
    with tempfile.TemporaryDirectory(prefix="jshard-plan-", ignore_cleanup_errors=True) as work:
        error_file = os.path.join(work, "error.json")
        flags = _DEVICE_COUNT_FLAG.sub("", os.environ.get("XLA_FLAGS", ""))
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices),
               "XLA_FLAGS": flags.strip(), ERROR_FILE_ENV: error_file}
        cmd = [sys.executable, "-m", "jshard.report", *argv, "--json"]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        handed_over = from_planning_process(error_file) if done.returncode == 2 else None
    if handed_over is not None:
        raise handed_over
    if done.returncode:
        raise RuntimeError(f"Planning on {devices} simulated CPU devices failed ({' '.join(cmd[2:])}):\n"
                           f"{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def config_args(config: PlanConfig) -> list[str]:
    """The command-line flags that give ``config``."""
    return ["--config", json.dumps(dataclasses.asdict(config))]


def compile_target(target: str | CompileTarget | None, devices: int | None) -> CompileTarget:
    """The :class:`CompileTarget` of a plan: ``target`` (a name such as ``"tpu:v5p-256"``), or
    ``devices`` simulated CPU devices (64 when neither is given)."""
    if target is None:
        return CompileTarget("cpu", 64 if devices is None else devices)
    target = CompileTarget.parse(target) if isinstance(target, str) else target
    if devices is not None and devices != target.devices:
        raise ValueError(f"The target {target.describe()} has {target.devices} devices, not devices={devices}; "
                         "give one of them.")
    return target


def plan(build: Callable[..., Any] | str, *, devices: int | None = None, replicate: int = 1,
         tensor_parallel: int = 1, config: PlanConfig | None = None,
         target: str | CompileTarget | None = None) -> Plan:
    """Compile a step for a mesh of ``devices`` and report it per device, nothing allocated.

    ``build(mesh)`` or ``build(mesh, config)`` returns ``(step, args)``: the training step
    and its abstract arguments (see [Note: plan target]). With fewer devices here than
    asked for, the plan runs in a subprocess with that many simulated CPU devices, which
    imports the builder by name: pass an importable function or ``"pkg.module:build"``.
    The demo's transformer is ``"jshard.demo.plan:build_<size>"`` (``tiny``, ``small``,
    ``medium``, ``1b``); a Llama-3-8B shape is ``"jshard.demo.llama3:build_nnx"`` (NNX)
    and ``"jshard.demo.llama3:build_hf"`` (Hugging Face Flax).

    Args:
      build: the builder or its name.
      devices: devices in the mesh (64 when no ``target`` says otherwise).
      replicate: ``R > 1`` plans HSDP with ``R`` replicas (across slices first).
      tensor_parallel: ``T > 1`` adds a ``"tp"`` axis of size ``T`` (the builder places
        its tensor-parallel leaves on it).
      config: the :class:`PlanConfig` handed to the builder.
      target: the compiler to plan on ([Note: compile target]): ``"cpu:N"`` (the default,
        N simulated CPU devices) or a TPU topology such as ``"tpu:v5p-256"``, compiled by
        XLA:TPU in this process, without a TPU.

    Returns:
      A :class:`Plan`; ``print(plan)`` shows the table.
    """
    config = config or PlanConfig()
    where = compile_target(target, devices)
    devices = where.devices
    if where.platform == "tpu":
        return plan_here(build, config, plan_mesh(devices, replicate, tensor_parallel, where.tpu_devices()))
    if len(jax.devices()) >= devices:
        return plan_here(build, config, plan_mesh(devices, replicate, tensor_parallel))
    argv = ["plan", spec_of(build), "--devices", str(devices), "--replicate", str(replicate),
            "--tensor-parallel", str(tensor_parallel), *config_args(config)]
    return Plan.from_dict(run_in_devices(argv, devices))
