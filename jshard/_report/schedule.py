"""When a compiled step's all-gathers run: asynchronous or not, and what computes meanwhile.

A scheduled HLO module lists each computation's instructions in execution order. An
asynchronous all-gather is a start and a done (``all-gather-start`` / ``all-gather-done``,
or XLA:TPU's ``async-collective-start`` / ``async-collective-done`` fusions with the gather
inside, under its async-collective-fusion flags); what is scheduled between them overlaps
the transfer. A synchronous ``all-gather`` overlaps nothing.
"""

from __future__ import annotations

import dataclasses
import re

from jshard._report.hlo import computation_lines

_LINE = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$")
_OP = re.compile(r"[\s}\]\)]([a-z][\w\-]*)\((.*)$")  # the opcode: the first name( after the type
_CALLS = re.compile(r"\b(?:calls|to_apply)=%?([\w.\-]+)")
_OPERAND = re.compile(r"%([\w.\-]+)")
_MATMUL_OPS = ("dot", "convolution")


@dataclasses.dataclass(frozen=True)
class ScheduledGather:
    """One all-gather of a compiled program, where it is scheduled.

    ``matmuls_overlapped``: the matmuls (dots, convolutions, fusions holding one) scheduled
    between its start and its done (0 for a synchronous gather).
    """

    name: str
    computation: str
    asynchronous: bool
    matmuls_overlapped: int


def _computations(hlo_text: str) -> dict[str, list[tuple[str, str, str]]]:
    """``computation -> [(instruction, opcode, rest of line)]`` in schedule order."""
    out: dict[str, list[tuple[str, str, str]]] = {}
    for computation, line in computation_lines(hlo_text):
        instr = _LINE.match(line)
        op = _OP.search(instr.group(2)) if instr and computation else None
        if op:
            out.setdefault(computation, []).append((instr.group(1), op.group(1), op.group(2)))
    return out


def _holding(comps: dict, ops: tuple[str, ...]) -> set[str]:
    """The computations that have an instruction of ``ops``, or call one that does (computed
    once per program: a fixpoint over the call graph)."""
    calls = {name: {c for _, _, rest in instrs for c in _CALLS.findall(rest)} for name, instrs in comps.items()}
    found = {name for name, instrs in comps.items() if any(op in ops for _, op, _ in instrs)}
    grew = True
    while grew:
        more = {name for name, callees in calls.items() if name not in found and callees & found}
        found |= more
        grew = bool(more)
    return found


def _calls_any(rest: str, holding: set[str]) -> bool:
    return any(c in holding for c in _CALLS.findall(rest))


def gather_schedule(hlo_text: str) -> list[ScheduledGather]:
    """Every all-gather of a compiled (scheduled) program, asynchronous or not, with the
    matmuls that run while it is in flight.

    Example:
      >>> from jshard._report.schedule import gather_schedule
      >>> hlo = '''
      ... ENTRY %main (p: f32[2,4]) -> f32[8,4] {
      ...   %p = f32[2,4]{1,0} parameter(0)
      ...   %ags = (f32[2,4]{1,0}, f32[8,4]{1,0}) all-gather-start(%p), dimensions={0}
      ...   %d = f32[2,2]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={1}
      ...   ROOT %agd = f32[8,4]{1,0} all-gather-done(%ags)
      ... }'''
      >>> gather_schedule(hlo)
      [ScheduledGather(name='ags', computation='main', asynchronous=True, matmuls_overlapped=1)]
    """
    comps = _computations(hlo_text)
    fused = {c for instrs in comps.values() for _, op, rest in instrs if op == "fusion" for c in _CALLS.findall(rest)}
    gathering, multiplying = _holding(comps, ("all-gather",)), _holding(comps, _MATMUL_OPS)
    out = []
    for comp, instrs in comps.items():
        if comp in fused:  # a fusion's body is not scheduled itself: its gathers are counted where it runs
            continue
        open_starts: dict[str, int] = {}
        source: dict[str, str] = {}  # a get-tuple-element -> the instruction it reads
        for name, op, rest in instrs:
            if op == "get-tuple-element":
                operand = _OPERAND.findall(rest)[0]
                source[name] = source.get(operand, operand)
                continue
            is_start = op == "all-gather-start" or (op == "fusion" and name.startswith("async-collective-start")
                                                    and _calls_any(rest, gathering))
            if is_start:
                open_starts[name] = 0
            elif op == "all-gather-done" or (op == "fusion" and name.startswith("async-collective-done")):
                started = [source.get(o, o) for o in _OPERAND.findall(rest) if source.get(o, o) in open_starts]
                for s in started[:1]:
                    out.append(ScheduledGather(s, comp, True, open_starts.pop(s)))
            elif op == "all-gather":
                out.append(ScheduledGather(name, comp, False, 0))
            else:
                if op in _MATMUL_OPS or (op == "fusion" and _calls_any(rest, multiplying)):
                    for s in open_starts:
                        open_starts[s] += 1
                carried = [source.get(o, o) for o in _OPERAND.findall(rest) if source.get(o, o) in open_starts]
                if carried:  # XLA:TPU runs a collective's steps inside the fusions between start and done
                    source[name] = carried[0]
    return out
