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
  instruction's ``op_name``), which is how docs/benchmarks.md attributes a row's excess;
- the allocation's tuple values (:func:`tuple_slots`): the state of each asynchronous operation
  (``copy-start`` to and from on-chip memory, ``all-reduce-start``, ...), 32-352 bytes each,
  which XLA:TPU places in 16 KiB slots of their own, one per buffer (only a loop's state tuples
  share one), above the other values or in gaps among them: up to 16 KiB of the allocation per
  asynchronous operation. It prints how many there are and how far the allocation reaches above
  every other value.

``--above RESULTS.json`` reads a stored sweep instead (its target, flags and jshard options) and,
for every model whose jshard peak is above the best recipe's there, compiles that recipe and
jshard again and prints one Markdown row: both peaks, each program's three temporaries figures
and its tuple values, what jshard holds at its fullest that the recipe's fullest point has no
value of the same shape for (:func:`held_more`), and the other way round. docs/benchmarks.md's tables of the rows above
the recipe come from it.

The parsing functions take the dump's text, so tests can feed them small hand-written pieces.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import pathlib
import re
import tempfile
from typing import Any

from jshard._plan.buffers import temp_values as assigned_temp_values
from jshard._sharding.policies import WEIGHT_GRADIENTS
from jshard.report import CompileTarget, Memory

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
class TupleSlots:
    """The allocation's tuple values: how many, at how many distinct offsets, and how far the
    allocation reaches above every value that is not one."""

    count: int
    offsets: int
    overhang: int  # allocation end - the end of the highest non-tuple value


def tuple_slots(values: list[HeapValue]) -> TupleSlots:
    """:class:`TupleSlots` of the temporaries' ``values``.

    Example:
      >>> values = [HeapValue("dot{}", 16384, 0, "f32[64,64]"),
      ...           HeapValue("copy-start{}", 32, 16384, "(f32[8], f32[8], u32[])"),
      ...           HeapValue("copy-start.1{}", 32, 32768, "(f32[8], f32[8], u32[])")]
      >>> tuple_slots(values)
      TupleSlots(count=2, offsets=2, overhang=16416)
    """
    tuples = [v for v in values if v.shape.startswith("(")]
    end = max((v.offset + v.size for v in values), default=0)
    rest = max((v.offset + v.size for v in values if not v.shape.startswith("(")), default=0)
    return TupleSlots(len(tuples), len({v.offset for v in tuples}), end - rest)


@dataclasses.dataclass(frozen=True)
class Fullest:
    """The temporaries' allocation at the point where most of it is occupied."""

    allocation: int  # bytes XLA allocated for temporaries in the default memory space
    occupied: int  # bytes occupied at once there, at most
    time: int  # the position in the schedule (the live-range dump's numbering)
    live: tuple[HeapValue, ...]  # the values live then, one per buffer, largest first
    tuples: TupleSlots = TupleSlots(0, 0, 0)  # the allocation's tuple values (asynchronous operations)


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
    return Fullest(max((v.offset + v.size for v in values), default=0), best[0], best[1], tuple(largest),
                   tuple_slots(values))


def read_dump(directory: pathlib.Path) -> tuple[Fullest, dict[str, str]]:
    """:func:`fullest` of the largest compiled module dumped in ``directory``, and its op names."""
    heap, ops, _ = _read_step(directory)
    return heap, ops


def _read_step(directory: pathlib.Path) -> tuple[Fullest, dict[str, str], str]:
    """:func:`read_dump`'s figures, and the text of the module's buffer assignment."""
    hlo = max(directory.glob("*after_optimizations.txt"), key=lambda p: p.stat().st_size)
    stem = str(hlo)[: -len(".txt")]
    assignment = pathlib.Path(stem + "-buffer-assignment.txt").read_text()
    ranges = live_ranges(pathlib.Path(stem + "-live-range.txt").read_text())
    return fullest(temp_values(assignment), ranges), op_names(hlo.read_text()), assignment


def describe(variant: str, temp: int, heap: Fullest, ops: dict[str, str], top: int) -> str:
    """The printed account of one variant."""
    mib = 2.0**20
    lines = [f"{variant}: memory_analysis temp {temp / mib:.2f} MiB; HBM temp allocation "
             f"{heap.allocation / mib:.2f} MiB, at most {heap.occupied / mib:.2f} MiB of it occupied at once "
             f"(schedule position {heap.time}); {_tuples(heap.tuples)}; the largest values then:"]
    for v in heap.live[:top]:
        op = ops.get(v.instruction, "")[-90:]
        lines.append(f"  {v.size / mib:8.2f} MiB at {v.offset / mib:7.2f}  {v.shape:28s} {op}")
    return "\n".join(lines)


def _tuples(t: TupleSlots) -> str:
    return (f"{t.count} tuple values at {t.offsets} offsets, the allocation {t.overhang / 2**20:.2f} MiB "
            "above the other values")


def held_more(jshard: Fullest, recipe: Fullest, floor: int = 1 << 16) -> list[HeapValue]:
    """jshard's values at its fullest point, of at least ``floor`` bytes, that the recipe's fullest
    point has no value of the same shape for (matched one for one), largest first.

    Example:
      >>> a, b = HeapValue("a{}", 1 << 20, 0, "f32[512,512]"), HeapValue("b{}", 1 << 20, 1 << 20, "f32[512,512]")
      >>> c = HeapValue("c{}", 1 << 17, 0, "bf16[256,256]")
      >>> [v.name for v in held_more(Fullest(0, 0, 0, (a, b, c)), Fullest(0, 0, 0, (a,)))]
      ['b{}', 'c{}']
    """
    left = collections.Counter(v.shape for v in recipe.live)
    more = []
    for v in jshard.live:
        if left[v.shape]:
            left[v.shape] -= 1
        elif v.size >= floor:
            more.append(v)
    return more


def compile_with_dump(step: Any, args: tuple[Any, ...], directory: pathlib.Path) -> Any:
    """``step`` compiled for ``args`` with XLA dumping the compiled module into ``directory``."""
    return step.lower(*args).compile(compiler_options={"xla_dump_to": str(directory)})


def _compiled_heap(ms: Any, model: Any, mesh: Any, variant: str, tmp: pathlib.Path,
                   **options: Any) -> tuple[Memory, Fullest, dict[str, str]]:
    """One variant's step of ``model`` (``options``: :func:`benchmarks.memory_sweep.variant_step`'s)
    compiled with its dump in ``tmp / variant``: its memory (the temporaries from the dumped buffer
    assignment, [Note: TPU temporaries]), and the dump read."""
    directory = tmp / variant
    compiled = compile_with_dump(*ms.variant_step(model, mesh, variant, **options), directory)
    heap, ops, assignment = _read_step(directory)
    return Memory.from_compiled(compiled, assignment), heap, ops


def _cells(memory: Memory, heap: Fullest) -> tuple[float, str]:
    mib = 2.0**20
    figures = (memory.xla_temp, heap.allocation, heap.occupied)
    return (memory.peak / mib, " / ".join(f"{x / mib:.2f}" for x in figures)
            + f" / {heap.tuples.count} ({heap.tuples.overhang / mib:.2f})")


def above_rows(results: pathlib.Path) -> None:
    """Print a Markdown row for every model of the stored sweep ``results`` whose jshard peak is above
    its best recipe's, from a fresh compile of both under the sweep's own settings."""
    stored = json.loads(results.read_text())
    if stored.get("libtpu_init_args"):
        flags = f"{os.environ.get('LIBTPU_INIT_ARGS', '')} {stored['libtpu_init_args']}"
        os.environ["LIBTPU_INIT_ARGS"] = flags.strip()  # before the topology starts libtpu
    from benchmarks import memory_sweep as ms  # starts JAX (8 CPU devices where no accelerator is given)

    target = CompileTarget.parse(stored["target"])
    mesh = ms.target_mesh(target)
    options = {"apply_sgd": stored.get("apply_sgd", False), "replicate_below": stored.get("replicate_below", 0),
               "backward_prefetch": stored.get("backward_prefetch", True),
               "weight_gradients": stored.get("weight_gradients", "reduced")}  # all but the first: jshard's only
    models = {m.name: m for m in ms.models(False)}
    print(f"{results.name}: compiled by {target.describe()}"
          + (f" with LIBTPU_INIT_ARGS={os.environ['LIBTPU_INIT_ARGS']}" if stored.get("libtpu_init_args") else ""))
    print("| model | best recipe | jshard (/ best) | recipe: temporaries / HBM allocation / occupied "
          "/ tuple values (allocation above the others) "
          "| jshard: the same | what jshard holds at its fullest that the recipe does not | and the recipe, that "
          "jshard does not |")
    print("|---|---|---|---|---|---|---|")
    for row in filter(ms.above_recipe, stored["models"]):
        best, model = ms.best_recipe(row), models[row["name"]]
        with tempfile.TemporaryDirectory() as tmp:
            memory, recipe_heap, recipe_ops = _compiled_heap(ms, model, mesh, best, pathlib.Path(tmp), **options)
            recipe_peak, recipe_cells = _cells(memory, recipe_heap)
            memory, heap, ops = _compiled_heap(ms, model, mesh, "jshard", pathlib.Path(tmp), **options)
            peak, cells = _cells(memory, heap)
        print(f"| {row['name']} | {recipe_peak:.2f} ({best}) | {peak:.2f} ({peak / recipe_peak:.2f}) | {recipe_cells} "
              f"| {cells} | {_values(held_more(heap, recipe_heap), ops)} "
              f"| {_values(held_more(recipe_heap, heap), recipe_ops)} |", flush=True)


def _values(values: list[HeapValue], ops: dict[str, str]) -> str:
    """The three largest of ``values``: shape, MiB and the last name of the JAX operation that made it."""
    return ", ".join(f"`{v.shape}` {v.size / 2**20:.2f} ({ops.get(v.instruction, '?').split('/')[-1]})"
                     for v in values[:3]) or "none of 0.06 MiB or more"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model of the sweep, by its name")
    parser.add_argument("--above", type=pathlib.Path,
                        help="a stored sweep (benchmarks/results/memory_sweep*.json): a row for each model above "
                             "the best recipe there, under the sweep's own settings")
    parser.add_argument("--variants", default="recipe,constrained,jshard")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--replicate-below", type=int, default=0,
                        help="jshard's FullyShardPolicy(replicate_below=N), as in benchmarks.memory_sweep")
    parser.add_argument("--apply-sgd", action="store_true",
                        help="the training step (gradients applied by plain SGD), as in benchmarks.memory_sweep")
    parser.add_argument("--weight-gradients", default="reduced", choices=WEIGHT_GRADIENTS,
                        help="jshard's FullyShardPolicy(weight_gradients=...), as in benchmarks.memory_sweep")
    from benchmarks import memory_sweep as ms  # starts JAX (8 CPU devices where no accelerator is given)

    ms.add_compile_arguments(parser)
    args = parser.parse_args(argv)
    if args.above is not None:
        above_rows(args.above)
        return
    if args.model is None:
        parser.error("give --model NAME (one model) or --above RESULTS.json (the models above the recipe there)")
    model = next((m for m in ms.models(False) if m.name == args.model), None)
    if model is None:
        raise SystemExit(f"No sweep model is named {args.model!r}; "
                         "names look like 'tanh unrolled 4x512 b64 kept fp32' (python -m benchmarks.memory_sweep).")
    target, said = ms.compile_target(args)
    print(said)
    mesh = ms.target_mesh(target)
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants.split(","):
            memory, heap, ops = _compiled_heap(ms, model, mesh, variant, pathlib.Path(tmp), apply_sgd=args.apply_sgd,
                                               replicate_below=args.replicate_below,
                                               weight_gradients=args.weight_gradients)
            print(f"{variant}: peak {memory.peak / 2**20:.2f} MiB", flush=True)
            print(describe(variant, memory.xla_temp, heap, ops, args.top), flush=True)


if __name__ == "__main__":
    main()
