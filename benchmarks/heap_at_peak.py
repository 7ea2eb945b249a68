"""What fills the temporaries of a compiled step at their fullest, read from XLA's own dump.

``python -m benchmarks.heap_at_peak --target tpu:v5p:2x2x2 --model "gelu stacked 4x512 b64 remat bf16"``
compiles the sweep model's step for each variant of :mod:`benchmarks.memory_sweep` (recipe,
constrained, jshard), with XLA dumping the compiled module's buffer assignment and live ranges
(``compiler_options={"xla_dump_to": ...}``, one directory per variant), and prints for each:

- ``memory_analysis()``'s temporaries and XLA's allocation for temporaries in the default memory
  space (HBM on a TPU; ``preallocated-temp`` without a color in ``*-buffer-assignment.txt``).
  They are not the same figure: on v5p ``temp_size_in_bytes`` exceeds the allocation by an
  amount the dump does not itemise (0.4-52 MiB on the sweep's models above the recipe), on v6e
  it can read less (0.00 MiB against an allocation of 2.17);
- the point of the schedule where the most bytes of that allocation are occupied at once (the
  union of the live values' ``[offset, offset + size)``, so values sharing a buffer count once),
  and the allocation's size above it: what XLA's packing leaves unused at its fullest;
- the largest values live there, with their shape and the JAX operation that made them (the HLO
  instruction's ``op_name``), which is how docs/benchmarks.md attributes a row's excess.

The parsing functions take the dump's text, so tests can feed them small hand-written pieces.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
import tempfile
from typing import Any

from jshard._plan.buffers import temp_values as assigned_temp_values

_RANGE = re.compile(r"^\s*([\w.\-]+)(\{[\d,]*\}):(\d+)-(\d+)$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*?\bop_name=\"([^\"]*)\"")
_LAYOUT = re.compile(r"\{[^{}]*\}")


@dataclasses.dataclass(frozen=True)
class HeapValue:
    """One HLO value placed in the temporaries' allocation: ``name`` is ``instruction{index}``."""

    name: str
    size: int
    offset: int
    shape: str

    @property
    def instruction(self) -> str:
        return self.name.split("{")[0]


@dataclasses.dataclass(frozen=True)
class Fullest:
    """The temporaries' allocation at the point where most of it is occupied."""

    allocation: int  # bytes XLA allocated for temporaries in the default memory space
    occupied: int  # bytes occupied at once there, at most
    time: int  # the position in the schedule (the live-range dump's numbering)
    live: tuple[HeapValue, ...]  # the values live then, one per buffer, largest first


def temp_values(buffer_assignment: str) -> list[HeapValue]:
    """The values of the default memory space's temporaries in ``*-buffer-assignment.txt``.

    Example:
      >>> text = '''allocation 3: size 64, preallocated-temp:
      ...  value: <7 fusion.2 @0> (size=48,offset=16): f32[12]{0}
      ... allocation 4: size 8, color 1, preallocated-temp:
      ...  value: <8 copy @0> (size=8,offset=0): f32[2]{0:S(1)}'''
      >>> temp_values(text)
      [HeapValue(name='fusion.2{}', size=48, offset=16, shape='f32[12]')]
    """
    return [HeapValue(v.name if v.name.endswith("}") else v.name + "{}", v.size, v.offset, _LAYOUT.sub("", v.shape))
            for v in assigned_temp_values(buffer_assignment) if "color" not in v.allocation]


def live_ranges(live_range: str) -> dict[str, tuple[int, int]]:
    """``instruction{index} -> (first, last)`` schedule positions from ``*-live-range.txt``."""
    return {m.group(1) + m.group(2): (int(m.group(3)), int(m.group(4)))
            for m in map(_RANGE.match, live_range.splitlines()) if m}


def op_names(hlo: str) -> dict[str, str]:
    """``instruction -> op_name`` (the JAX operation it came from) of a compiled HLO text."""
    return {m.group(1): m.group(2) for m in map(_INSTRUCTION.match, hlo.splitlines()) if m}


def _occupied(values: list[HeapValue]) -> int:
    total, end = 0, -1
    for lo, hi in sorted((v.offset, v.offset + v.size) for v in values):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def fullest(values: list[HeapValue], ranges: dict[str, tuple[int, int]]) -> Fullest:
    """The schedule position where the most bytes of the allocation are occupied, and what is there.

    Example:
      >>> values = [HeapValue("a{}", 8, 0, "f32[2]"), HeapValue("b{}", 8, 8, "f32[2]"),
      ...           HeapValue("c{}", 8, 16, "f32[2]")]
      >>> f = fullest(values, {"a{}": (0, 1), "b{}": (1, 2), "c{}": (3, 4)})
      >>> f.allocation, f.occupied, f.time, [v.name for v in f.live]
      (24, 16, 1, ['a{}', 'b{}'])
    """
    placed = [v for v in values if v.name in ranges]
    events = sorted({t for v in placed for t in ranges[v.name]})
    best: tuple[int, int] = (0, -1)
    for t in events:
        occupied = _occupied([v for v in placed if ranges[v.name][0] <= t <= ranges[v.name][1]])
        if occupied > best[0]:
            best = (occupied, t)
    live = [v for v in placed if ranges[v.name][0] <= best[1] <= ranges[v.name][1]]
    # values sharing a buffer (an in-place update, a loop's carried state): the one defined first
    one_per_buffer = {(v.offset, v.size): v for v in sorted(live, key=lambda v: ranges[v.name][0], reverse=True)}
    largest = sorted(one_per_buffer.values(), key=lambda v: (-v.size, v.offset))
    return Fullest(max((v.offset + v.size for v in values), default=0), best[0], best[1], tuple(largest))


def read_dump(directory: pathlib.Path) -> tuple[Fullest, dict[str, str]]:
    """:func:`fullest` of the largest compiled module dumped in ``directory``, and its op names."""
    hlo = max(directory.glob("*after_optimizations.txt"), key=lambda p: p.stat().st_size)
    stem = str(hlo)[: -len(".txt")]
    values = temp_values(pathlib.Path(stem + "-buffer-assignment.txt").read_text())
    ranges = live_ranges(pathlib.Path(stem + "-live-range.txt").read_text())
    return fullest(values, ranges), op_names(hlo.read_text())


def describe(variant: str, temp: int, heap: Fullest, ops: dict[str, str], top: int) -> str:
    """The printed account of one variant."""
    mib = 2.0**20
    lines = [f"{variant}: memory_analysis temp {temp / mib:.2f} MiB; HBM temp allocation "
             f"{heap.allocation / mib:.2f} MiB, at most {heap.occupied / mib:.2f} MiB of it occupied at once "
             f"(schedule position {heap.time}); the largest values then:"]
    for v in heap.live[:top]:
        op = ops.get(v.instruction, "")[-90:]
        lines.append(f"  {v.size / mib:8.2f} MiB at {v.offset / mib:7.2f}  {v.shape:28s} {op}")
    return "\n".join(lines)


def compile_with_dump(step: Any, args: tuple[Any, ...], directory: pathlib.Path) -> Any:
    """``step`` compiled for ``args`` with XLA dumping the compiled module into ``directory``."""
    return step.lower(*args).compile(compiler_options={"xla_dump_to": str(directory)})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model of the sweep, by its name")
    parser.add_argument("--variants", default="recipe,constrained,jshard")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--replicate-below", type=int, default=0,
                        help="jshard's FullyShardPolicy(replicate_below=N), as in benchmarks.memory_sweep")
    parser.add_argument("--apply-sgd", action="store_true",
                        help="the training step (gradients applied by plain SGD), as in benchmarks.memory_sweep")
    from benchmarks import memory_sweep as ms  # starts JAX (8 CPU devices where no accelerator is given)

    ms.add_compile_arguments(parser)
    args = parser.parse_args(argv)
    model = next((m for m in ms.models(False) if m.name == args.model), None)
    if model is None:
        raise SystemExit(f"No sweep model is named {args.model!r}; "
                         "names look like 'tanh unrolled 4x512 b64 kept fp32' (python -m benchmarks.memory_sweep).")
    target, said = ms.compile_target(args)
    print(said)
    mesh = ms.target_mesh(target)
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants.split(","):
            directory = pathlib.Path(tmp) / variant
            step = ms.variant_step(model, mesh, variant, apply_sgd=args.apply_sgd, replicate_below=args.replicate_below)
            compiled = compile_with_dump(*step, directory)
            heap, ops = read_dump(directory)
            print(describe(variant, compiled.memory_analysis().temp_size_in_bytes, heap, ops, args.top), flush=True)


if __name__ == "__main__":
    main()
