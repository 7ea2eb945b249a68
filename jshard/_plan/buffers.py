"""Which buffers the temporaries are, and what the device holds: XLA's buffer assignment.

[Note: temporary buffers] ``memory_analysis()`` gives one number for temporaries. XLA writes
what lives in them when a compile is given the option ``xla_dump_to`` (a plan's compile is,
:func:`compile_reading_assignment`): the ``*buffer-assignment.txt`` of the step's module
lists each allocation and the values placed in it. The preallocated temporary allocation
holds values whose lifetimes do not overlap at shared offsets, so its largest values name
what the peak is made of; a value whose shape is a parameter's (or one layer's of a stack)
is that gathered parameter or its full gradient before the reduce-scatter. Outputs not
donated to the step's arguments are allocations of their own, into which XLA also places
temporaries that die before the output is written: without donation ``temp`` undercounts the
working set by up to the outputs' size (the 1B demo on 8 devices: 768 MiB temp undonated,
the same buffers at 1729 MiB donated).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import tempfile
from typing import Any

from jshard._report.buffer_assignment import ALLOCATION

_VALUE = re.compile(r"^\s*value: <\d+ ([^ >]+) @\d+> \(size=(\d+),offset=(\d+)\): (.*)$")
_ARRAY = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")
_SHOWN = 10


@dataclasses.dataclass(frozen=True)
class AssignedValue:
    """One value XLA placed in a temporary allocation, as its buffer assignment writes it.

    ``name``: the instruction, with its tuple index where it has one (``fusion.2``, ``fusion{1}``);
    ``shape`` with its layout (``f32[12]{0}``); ``allocation``: the allocation's kinds
    (``preallocated-temp:``, or ``color 1, preallocated-temp:`` in another memory space).
    """

    name: str
    size: int
    offset: int
    shape: str
    allocation: str


def temp_values(buffer_assignment: str) -> list[AssignedValue]:
    """The values of every preallocated temporary allocation in a ``*buffer-assignment.txt``.

    Example:
      >>> text = '''allocation 3: size 64, preallocated-temp:
      ...  value: <7 fusion.2 @0> (size=48,offset=16): f32[12]{0}
      ... allocation 5: size 8, parameter 0:
      ...  value: <9 p @0> (size=8,offset=0): f32[2]{0}'''
      >>> temp_values(text)
      [AssignedValue(name='fusion.2', size=48, offset=16, shape='f32[12]{0}', allocation='preallocated-temp:')]
    """
    values, kinds = [], None
    for line in buffer_assignment.splitlines():
        allocation = ALLOCATION.match(line)
        if allocation:
            kinds = allocation.group(3) if "preallocated-temp" in allocation.group(3) else None
            continue
        value = _VALUE.match(line) if kinds else None
        if value:
            name, size, offset, shape = value.groups()
            values.append(AssignedValue(name, int(size), int(offset), shape, kinds))
    return values


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One value in the step's temporary allocation."""

    op: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    leaf: str = ""


def _step_assignment(directory: str) -> str:
    """The text of the buffer assignment with the largest temporary allocation (the step's, not an
    initialiser's); "" where XLA wrote none."""
    best, best_size = "", -1
    for path in pathlib.Path(directory).glob("*buffer-assignment.txt"):
        text = path.read_text()
        for line in text.splitlines():
            match = ALLOCATION.match(line)
            if match and "preallocated-temp" in match.group(3) and int(match.group(2)) > best_size:
                best, best_size = text, int(match.group(2))
    return best


def compile_reading_assignment(lowered: Any) -> tuple[Any, str]:
    """``lowered`` compiled with XLA writing its buffer assignment into a temporary folder, and that assignment's
    text ("" if XLA wrote none)."""
    with tempfile.TemporaryDirectory(prefix="jshard-buffers-", ignore_cleanup_errors=True) as dump:
        compiled = lowered.compile(compiler_options={"xla_dump_to": dump})
        return compiled, _step_assignment(dump)


def _leaf_shapes(placements: Any) -> dict[tuple[int, ...], str]:
    shapes: dict[tuple[int, ...], str] = {}
    for p in placements:
        for shape in (tuple(p.shape), tuple(p.shape[1:])):
            if len(shape) >= 2 and shape not in shapes:
                shapes[shape] = p.path
    return shapes


def largest_temporaries(buffer_assignment: str, placements: Any = (), top: int = _SHOWN) -> tuple[Buffer, ...]:
    """The ``top`` largest distinct values of the step's temporary allocation, named by leaf where shapes match."""
    leaf_of = _leaf_shapes(placements)
    seen: dict[tuple[str, tuple[int, ...]], Buffer] = {}
    for value in temp_values(buffer_assignment):
        array = _ARRAY.match(value.shape)  # tuple-shaped values are left out
        if array is None:
            continue
        shape = tuple(int(v) for v in array.group(2).split(",") if v)
        op = re.sub(r"\.\d+$", "", value.name)
        key = (op, shape)
        if key not in seen:
            seen[key] = Buffer(op, array.group(1), shape, value.size, leaf_of.get(shape, ""))
    return tuple(sorted(seen.values(), key=lambda b: -b.bytes)[:top])


def buffer_lines(buffers: tuple[Buffer, ...], temp: int) -> list[str]:
    """The table of :func:`largest_temporaries` under a plan."""
    if not buffers:
        return []
    lines = ["", f"largest temporaries (XLA's buffer assignment; they share the {temp / 2**20:.1f} MiB at "
                 "non-overlapping times):"]
    for b in buffers:
        what = f"  <- the shape of {b.leaf}: gathered, or its full gradient" if b.leaf else ""
        shape = "x".join(map(str, b.shape)) or "scalar"
        lines.append(f"  {b.bytes / 2**20:10.1f} MiB  {b.dtype}[{shape}]  {b.op}{what}")
    return lines
