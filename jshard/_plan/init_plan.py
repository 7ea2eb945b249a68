"""Planning the init program: a born-sharded initialiser compiled for N devices, its peak against the 1/N share.

[Note: init plan] ``python -m jshard.report plan --init`` compiles a builder's *initialiser*
instead of a training step: ``build(mesh)`` (or ``build(mesh, config)``) returns
``(init, args)`` as for a step ([Note: plan target]), ``init`` making the sharded model (and,
if it likes, the optimizer state) inside ``jit`` ([Note: born sharded]) from its abstract
``args`` (a key, or nothing). What matters is the per-device peak of that program
(``memory_analysis()``: arguments, outputs and temporaries) against the share each device
must hold at the end, the outputs' per-device bytes (each leaf's shard shape under its output
sharding): about ``1/N`` of the model, plus padding. On simulated CPU devices it compiles with
XLA:CPU's memory-minimising scheduler; its default scheduler may draw several leaves at once.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax

from jshard._plan.compiler import CompileTarget
from jshard._plan.planner import compile_target, config_args, lower_target, plan_mesh, run_in_devices
from jshard._plan.target import PlanConfig, spec_of
from jshard._report.memory import Memory

CPU_MEMORY_MINIMISING = {"xla_cpu_enable_concurrency_optimized_scheduler": False}


def _gib(x: float) -> str:
    return f"{x / 2**30:.3f} GiB" if abs(x) >= 2**30 else f"{x / 2**20:.2f} MiB"


@dataclasses.dataclass(frozen=True)
class InitPlan:
    """The compiled init program of a builder, per device.

    Attributes:
      target: the builder, ``"pkg.module:build"``.
      devices: devices in the mesh.
      platform: the compiler's platform.
      compile_seconds: wall time of building, lowering and compiling.
      model_bytes: the outputs' global bytes (padding included), all devices together.
      share_bytes: the outputs' bytes on one device: what it holds once the program ends.
      largest_shard_bytes: the largest output leaf's bytes on one device.
      memory: the program's per-device bytes (:class:`jshard.report.Memory`).

    Example:
      >>> import jax, jshard as js
      >>> from jshard.report import plan_init
      >>> def build(mesh):
      ...     init = lambda key: js.fully_shard({"w": jax.random.normal(key, (1024, 512))}, mesh)  # noqa: E731
      ...     return init, (jax.random.key(0),)
      >>> p = plan_init(build, devices=8)
      >>> p.model_bytes, p.share_bytes, p.memory.output  # the 1/8 share is all the program outputs
      (2097152, 262144, 262144)
      >>> round(p.memory.peak / p.share_bytes)  # plus threefry's words for it, never the model
      4
    """

    target: str
    devices: int
    platform: str
    compile_seconds: float
    model_bytes: int
    share_bytes: int
    largest_shard_bytes: int
    memory: Memory

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready); :meth:`from_dict` rebuilds the plan."""
        return {**dataclasses.asdict(self), "memory": dataclasses.asdict(self.memory)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InitPlan:
        """The plan :meth:`to_dict` gave."""
        return cls(**{**data, "memory": Memory(**data["memory"])})

    def __str__(self) -> str:
        m = self.memory
        return "\n".join([
            f"init plan of {self.target} on {self.devices} devices, compiled for {self.platform} in "
            f"{self.compile_seconds:.1f} s",
            f"model (the outputs, padded): {_gib(self.model_bytes)}; its 1/{self.devices} share per device: "
            f"{_gib(self.share_bytes)} (largest leaf's shard {_gib(self.largest_shard_bytes)})",
            f"compiled per device: arguments {_gib(m.argument)} + outputs {_gib(m.output)} + temporaries "
            f"{_gib(m.temp)} = peak {_gib(m.peak)}: {m.peak / max(self.share_bytes, 1):.2f} x the share, "
            f"1/{self.model_bytes / max(m.peak, 1):.0f} of the model",
        ])


def _shard_bytes(shape: Any, sharding: Any) -> int:
    return math.prod(sharding.shard_shape(shape.shape)) * shape.dtype.itemsize


def plan_init_here(build: Callable[..., Any] | str, config: PlanConfig, mesh: jax.sharding.Mesh) -> InitPlan:
    """Build, lower and compile the initialiser on ``mesh`` in this process."""
    start = time.perf_counter()
    spec, _, _, lowered = lower_target(build, config, mesh)
    platform = mesh.devices.flat[0].platform
    compiled = lowered.compile(CPU_MEMORY_MINIMISING if platform == "cpu" else None)
    outputs = list(zip(jax.tree.leaves(lowered.out_info), jax.tree.leaves(compiled.output_shardings), strict=True))
    shards = [_shard_bytes(s, sharding) for s, sharding in outputs]
    model = sum(math.prod(s.shape) * s.dtype.itemsize for s, _ in outputs)
    return InitPlan(spec, mesh.size, platform, time.perf_counter() - start, model, sum(shards),
                    max(shards, default=0), Memory.from_compiled(compiled))


def plan_init(build: Callable[..., Any] | str, *, devices: int | None = None, replicate: int = 1,
              tensor_parallel: int = 1, config: PlanConfig | None = None,
              target: str | CompileTarget | None = None) -> InitPlan:
    """Compile a builder's initialiser for a mesh of ``devices``, compile only ([Note: init plan]).

    Like :func:`jshard.report.plan`, in a subprocess of simulated CPU devices when this one
    has fewer, or on a TPU topology with ``target``; ``build`` returns ``(init, args)``.
    The Llama-3-70B shape is ``"jshard.demo.llama3:build_init_70b"``.

    Args:
      build: the builder or its name.
      devices: devices in the mesh (64 when no ``target`` says otherwise).
      replicate: ``R > 1`` plans HSDP with ``R`` replicas.
      tensor_parallel: ``T > 1`` adds a ``"tp"`` axis of size ``T``.
      config: the :class:`jshard.report.PlanConfig` handed to the builder.
      target: the compiler (``"cpu:N"`` or a TPU topology such as ``"tpu:v5p-256"``).

    Returns:
      An :class:`InitPlan`; ``print(plan)`` shows it.
    """
    config = config or PlanConfig()
    where = compile_target(target, devices)
    if where.platform == "tpu":
        return plan_init_here(build, config, plan_mesh(where.devices, replicate, tensor_parallel,
                                                       where.tpu_devices()))
    if len(jax.devices()) >= where.devices:
        return plan_init_here(build, config, plan_mesh(where.devices, replicate, tensor_parallel))
    argv = ["plan", spec_of(build), "--init", "--devices", str(where.devices), "--replicate", str(replicate),
            "--tensor-parallel", str(tensor_parallel), *config_args(config)]
    return InitPlan.from_dict(run_in_devices(argv, where.devices))
