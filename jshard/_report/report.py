"""Memory and collective reports from compiled steps, beside the analytic figures.

``step_report(step, *args)`` compiles ``step`` for ``args`` (concrete arrays, or
``jax.ShapeDtypeStruct`` leaves from ``js.fully_shard`` on abstract inputs: nothing is
allocated) and returns a :class:`Report`: per-device bytes from
``compiled.memory_analysis()`` (device and host), every collective of the compiled
program (kind, dtype as asked for in the lowered program, bytes, replica groups, loop
trip counts), and the figures of docs/design.md "Performance model" with the ratio
measured / analytic. ``print(report)`` shows a table; ``report.to_dict()`` /
``report.to_json()`` give the same to a program. ``jshard.report.plan`` does this for a
user's step on a mesh larger than the machine (``jshard/_plan/``, docs/planning.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

import jax

from jshard._report.analytic import Analytic, analytic
from jshard._report.memory import MEMORY_FIELDS, Memory
from jshard._report.placement import LeafPlacement, placements
from jshard._report.step_collectives import StepCollective, step_collectives, wire_bytes_by_kind
from jshard._sharding.unit import all_units


@dataclasses.dataclass(frozen=True)
class Report:
    """What a compiled step holds and sends per device, measured and analytic.

    Attributes:
      memory: per-device bytes of the compiled step.
      collectives: every collective of the compiled program, in program order.
      analytic: the figures of the performance model for the step's units.
      mesh: the mesh's axis sizes.
      placements: each parameter leaf's placement dim and padding share.

    Example:
      >>> import json, jax.numpy as jnp, jshard as js
      >>> from jshard.report import Report, step_report
      >>> params = js.fully_shard({"w": jnp.ones((16, 4))})
      >>> report = step_report(js.value_and_grad(lambda p, x: jnp.mean(x @ p["w"])), params, jnp.ones((8, 16)))
      >>> report.ratios()["argument bytes"], report.collective_bytes["reduce-scatter"]
      (1.0, 224.0)
      >>> Report.from_dict(json.loads(report.to_json())) == report
      True
    """

    memory: Memory
    collectives: tuple[StepCollective, ...]
    analytic: Analytic
    mesh: dict[str, int]
    placements: tuple[LeafPlacement, ...] = ()
    model_axes: tuple[str, ...] = ()

    def _over_model_axes(self, c: StepCollective) -> bool:
        return bool(set(c.axes) & set(self.model_axes))

    @property
    def collective_bytes(self) -> dict[str, float]:
        """Measured bytes each device sends per step, by collective kind, over the data-parallel
        axes (FSDP's; what the analytic model predicts)."""
        return wire_bytes_by_kind([c for c in self.collectives if not self._over_model_axes(c)])

    @property
    def model_collective_bytes(self) -> dict[str, float]:
        """The same for collectives along model axes (tensor parallelism's, which GSPMD places)."""
        return wire_bytes_by_kind([c for c in self.collectives if self._over_model_axes(c)])

    def comparison(self) -> dict[str, tuple[float, float]]:
        """``name -> (measured, analytic)`` for every figure the model predicts."""
        a, m, c = self.analytic, self.memory, self.collective_bytes
        return {
            "argument bytes": (m.argument, a.argument_bytes),
            "host argument bytes": (m.host_argument, a.host_argument_bytes),
            "all-gather bytes/step": (c["all-gather"], a.all_gather),
            "reduce-scatter bytes/step": (c["reduce-scatter"], a.reduce_scatter),
            "all-reduce bytes/step": (c["all-reduce"], a.all_reduce),
        }

    def ratios(self) -> dict[str, float | None]:
        """``measured / analytic`` per figure (``None`` where the model predicts 0)."""
        return {k: (m / a if a else None) for k, (m, a) in self.comparison().items()}

    def to_dict(self) -> dict[str, Any]:
        """Plain data: every field, plus ``peak``, collective totals and ratios."""
        out = dataclasses.asdict(self)
        out["memory"]["peak"] = self.memory.peak
        out["collective_bytes"] = self.collective_bytes
        out["ratios"] = self.ratios()
        for c, info in zip(out["collectives"], self.collectives, strict=True):
            c["wire_bytes_per_step"] = info.wire_bytes_per_step
        return out

    def to_json(self, **kwargs: Any) -> str:
        """``to_dict()`` as JSON."""
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        """Rebuild a report from :meth:`to_dict` output (e.g. a planning subprocess's)."""
        def fields(kind, values):
            return {f.name: values[f.name] for f in dataclasses.fields(kind) if f.name in values}

        collectives = tuple(
            StepCollective(**{**fields(StepCollective, c), "shapes": tuple(tuple(s) for s in c["shapes"]),
                              "axes": tuple(c["axes"])})
            for c in data["collectives"]
        )
        placed = tuple(
            LeafPlacement(p["path"], tuple(p["shape"]), tuple(p["stored"]), p["dim"], p["padding_share"])
            for p in data.get("placements", ())
        )
        return cls(
            memory=Memory(**fields(Memory, data["memory"])),
            collectives=collectives,
            analytic=Analytic(**{**fields(Analytic, data["analytic"]),
                                 "unit_shard_sizes": tuple(data["analytic"].get("unit_shard_sizes", ()))}),
            mesh=dict(data["mesh"]),
            placements=placed,
            model_axes=tuple(data["model_axes"]),
        )

    def __str__(self) -> str:
        return format_report(self)


def _mib(x: float) -> str:
    return f"{x / 2**20:10.3f} MiB"


def format_report(report: Report) -> str:
    """The report as a text table (what ``print(report)`` shows).

    Example:
      >>> import jax.numpy as jnp, jshard as js
      >>> from jshard.report import format_report, step_report
      >>> params = js.fully_shard({"w": jnp.ones((16, 4))})
      >>> report = step_report(js.value_and_grad(lambda p, x: jnp.mean(x @ p["w"])), params, jnp.ones((8, 16)))
      >>> format_report(report).splitlines()[0]
      'jshard step report: mesh {fsdp=8}, 8 devices, shard size N=8, replicate R=1'
    """
    a, m = report.analytic, report.memory
    mesh = ", ".join(f"{k}={v}" for k, v in report.mesh.items())
    lines = [
        f"jshard step report: mesh {{{mesh}}}, {math.prod(report.mesh.values())} devices, {_shard_sizes(a)}, "
        f"replicate R={a.replicate_size}",
        f"parameters: {a.params:,} (padded {a.padded_params:,}); per device: params {_mib(a.param_bytes)}, "
        f"params+optimizer state {_mib(a.state_bytes)}, one gathered unit {_mib(a.gathered_unit_bytes)}",
        "",
        "memory per device (memory_analysis)        device            host",
    ]
    for name in MEMORY_FIELDS:
        lines.append(f"  {name:<36}{_mib(getattr(m, name))}  {_mib(getattr(m, 'host_' + name))}")
    if m.xla_temp != m.temp:  # XLA:TPU: temp read from the buffer assignment
        lines.append(f"  {'temp as memory_analysis() counts it':<36}{_mib(m.xla_temp)}  "
                     "(not HBM: [Note: TPU temporaries])")
    lines.append(f"  {'peak (argument+output+temp-alias)':<36}{_mib(m.peak)}")
    lines += ["", f"{'measured vs analytic (per device)':<36}{'measured':>16}{'analytic':>16}{'ratio':>8}"]
    ratios = report.ratios()
    for name, (measured, expected) in report.comparison().items():
        ratio = "-" if ratios[name] is None else f"{ratios[name]:.3f}"
        lines.append(f"  {name:<34}{_mib(measured):>16}{_mib(expected):>16}{ratio:>8}")
    lines += ["", "collectives (dtype as lowered; bytes = result size; wire = bytes each device sends per step)"]
    for c in report.collectives:
        upcast = "" if c.dtype == c.compiled_dtype else f" (runs as {c.compiled_dtype})"
        loop = f" x{c.executions}" + (" in loop" if c.in_loop else "")
        shapes = ",".join("x".join(map(str, s)) or "scalar" for s in c.shapes)
        over = f" over {','.join(c.axes)}" if c.axes and report.model_axes else ""
        lines.append(
            f"  {c.kind:<15}{c.dtype + upcast:<27} [{shapes}] groups of {c.group_size}{over}{loop}: "
            f"{c.bytes:,} B, wire {_mib(c.wire_bytes_per_step).strip()}"
        )
    return "\n".join(lines + _model_axis_lines(report) + _placement_lines(report.placements))


def _model_axis_lines(report: Report) -> list[str]:
    """Wire bytes of the collectives along model axes (tensor parallelism's: GSPMD places them)."""
    if not report.model_axes:
        return []
    totals = ", ".join(f"{kind} {_mib(b).strip()}" for kind, b in report.model_collective_bytes.items() if b)
    where = f"along model axes {report.model_axes} (placed by GSPMD, not in the analytic model)"
    return ["", f"{where}: {totals or 'none'}"]


_PLACEMENTS_SHOWN = 12


def _placement_lines(placed: tuple[LeafPlacement, ...]) -> list[str]:
    """The leaves by padding share, most wasteful first (the first dozen)."""
    if not placed:
        return []
    lines = ["", f"placement per leaf ({len(placed)} leaves; most padding first): shape -> stored, split dim, "
             "share of the stored leaf that is padding"]
    for p in sorted(placed, key=lambda p: -p.padding_share)[:_PLACEMENTS_SHOWN]:
        dim = "replicated" if p.dim is None else f"dim {p.dim}"
        lines.append(f"  {p.path:<40} {p.shape} -> {p.stored}, {dim}, {p.padding_share:.1%} padding")
    if len(placed) > _PLACEMENTS_SHOWN:
        lines.append(f"  ... {len(placed) - _PLACEMENTS_SHOWN} more (Report.placements has them all)")
    return lines


def report_lowered(lowered: Any, args: tuple[Any, ...], params: Any = None, microbatches: int = 1) -> Report:
    """A :class:`Report` from a lowered step (``jax.jit(step).lower(*args)``); compiles it.

    Args:
      lowered: the lowered step.
      args: the positional arguments it was lowered with.
      params: the sharded parameters among ``args`` (default: the first argument that
        contains an :class:`jshard.FSDPUnit`).
      microbatches: gradient accumulation steps inside the step.

    Example:
      >>> import jax, jax.numpy as jnp, jshard as js
      >>> from jshard.report import report_lowered
      >>> params = js.fully_shard({"w": jnp.ones((16, 4))})
      >>> args = (params, jnp.ones((8, 16)))
      >>> lowered = jax.jit(js.value_and_grad(lambda p, x: jnp.mean(x @ p["w"]))).lower(*args)
      >>> report_lowered(lowered, args).analytic.params
      64
    """
    return report_compiled(lowered.compile(), lowered.as_text(), args, params, microbatches)


def report_compiled(compiled: Any, lowered_text: str, args: tuple[Any, ...], params: Any = None,
                    microbatches: int = 1, compiled_text: str | None = None, buffer_assignment: str = "") -> Report:
    """A :class:`Report` from a compiled step and its lowered program's text (see :func:`report_lowered`);
    ``buffer_assignment``: the step's, for :meth:`Memory.from_compiled`."""
    if params is None:
        params = next((a for a in args if all_units(a)), None)
        if params is None:
            raise ValueError(
                "No argument of the step contains an FSDPUnit: pass the output of js.fully_shard "
                "as an argument, or name it with `params=`."
            )
    shardings = compiled.input_shardings[0]
    mesh = all_units(params)[0][0].meta.mesh
    return Report(
        memory=Memory.from_compiled(compiled, buffer_assignment),
        collectives=tuple(step_collectives(compiled_text or compiled.as_text(), lowered_text, dict(mesh.shape))),
        analytic=analytic(params, args, shardings, microbatches),
        mesh={str(k): int(v) for k, v in mesh.shape.items()},
        placements=placements(params),
        model_axes=all_units(params)[0][0].meta.axes.model_names,
    )


def step_report(step: Callable[..., Any], *args: Any, params: Any = None, microbatches: int = 1) -> Report:
    """Compile ``step`` for ``args`` and report its memory and collectives per device.

    Args:
      step: a function (jitted or not) taking the sharded parameters among its
        arguments, e.g. a training step around :func:`jshard.value_and_grad`.
      *args: its arguments: arrays or ``jax.ShapeDtypeStruct`` (compile only).
      params: the sharded parameters among ``args`` (default: the first argument that
        contains an :class:`jshard.FSDPUnit`).
      microbatches: gradient accumulation steps inside the step (for the analytic figures).

    Returns:
      A :class:`Report`.

    Example:
      >>> import jax, jax.numpy as jnp, jshard as js
      >>> from jshard.report import step_report
      >>> stack = js.fully_shard({"w": jnp.ones((4, 64, 64))}, policy=js.FullyShardPolicy(
      ...     scan_axis=0, reshard_after_forward=True))
      >>> def loss_fn(p, x):
      ...     h, _ = js.scan(lambda h, layer: (jnp.tanh(h @ layer["w"]), None), x, p)
      ...     return jnp.mean(h ** 2)
      >>> report = step_report(js.value_and_grad(loss_fn, unshard_params=False), stack, jnp.ones((16, 64)))
      >>> report.collective_bytes["reduce-scatter"] == report.analytic.reduce_scatter == 4 * 64 * 64 * 4 * 7 / 8
      True
    """
    jitted = step if hasattr(step, "lower") else jax.jit(step)
    return report_lowered(jitted.lower(*args), args, params, microbatches)


def _shard_sizes(a: Analytic) -> str:
    """``shard size N=8``, or every size where units shard over different axes."""
    sizes = a.unit_shard_sizes or (a.shard_size,)
    if len(sizes) == 1:
        return f"shard size N={sizes[0]}"
    return "shard sizes N=" + " / ".join(map(str, sizes)) + " (units on different axes)"

