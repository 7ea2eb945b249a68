r"""Trip counts of a compiled program's ``while`` loops, read from its HLO text.

[Note: loop trips] XLA:CPU marks a ``lax.scan``'s loop with ``known_trip_count``; XLA:TPU's
compiled loops carry none. There a loop is ``while (i < N)``: the condition's root compares a
counter (element ``k`` of the loop's tuple) with a constant ``N``; the body's root tuple sets
element ``k`` to ``i + s``; the loop's initial tuple gives element ``k`` a constant ``a``.
The loop runs ``ceil((N - a) / s)`` times. ``lax.scan`` counts from 0 by 1; the loops XLA:TPU
makes itself do not always (a windowed einsum, the collective matmul GSPMD makes of a dot
whose operand is sharded, counts to 4 by 2 on 8 devices: read as 4 trips, the recipe's
backward matmuls were counted twice). A part that cannot be read falls back to ``a = 0``,
``s = 1``.
"""

from __future__ import annotations

import collections
import dataclasses
import re

from jshard._report import hlo

_KNOWN = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_WHILE = re.compile(r"\bwhile\(%?([\w.\-]+)\), condition=%?([\w.\-]+), body=%?([\w.\-]+)")
_DEFINITION = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = .*? ([a-z][\w\-]*)\(([^()]*)\)(.*)$")
_CONSTANT = re.compile(r"^[su](?:8|16|32|64)\[\]")
_COMMENT = re.compile(r"/\*.*?\*/")


@dataclasses.dataclass
class _Computation:
    """The scalar facts of one computation that loop counters are made of."""

    constants: dict[str, int] = dataclasses.field(default_factory=dict)
    elements: dict[str, int] = dataclasses.field(default_factory=dict)  # get-tuple-element name -> index
    adds: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    tuples: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    root: str = ""
    less_than: tuple[str, str] | None = None  # the root's ``compare(lhs, rhs), direction=LT``


def _computations(hlo_text: str) -> dict[str, _Computation]:
    found: dict[str, _Computation] = collections.defaultdict(_Computation)
    for current, line in hlo.computation_lines(hlo_text):
        definition = _DEFINITION.match(_COMMENT.sub("", line))
        if not definition:
            continue
        root, name, opcode, operands, rest = definition.groups()
        args = [a.strip().lstrip("%") for a in operands.split(",") if a.strip()]
        c = found[current]
        shape = line.split(" = ", 1)[1]
        if opcode == "constant" and _CONSTANT.match(shape) and operands.lstrip("-").isdigit():
            c.constants[name] = int(operands)
        elif opcode == "get-tuple-element":
            index = re.search(r"index=(\d+)", rest)
            if index:
                c.elements[name] = int(index.group(1))
        elif opcode == "add":
            c.adds[name] = tuple(args)
        elif opcode == "tuple":
            c.tuples[name] = args
        if root:
            c.root = name
            if opcode == "compare" and "direction=LT" in rest and len(args) == 2:
                c.less_than = (args[0], args[1])
    return found


def _trips(caller: _Computation, init: str, cond: _Computation, body: _Computation) -> int | None:
    if cond.less_than is None or cond.less_than[1] not in cond.constants:
        return None
    counter, bound = cond.less_than[0], cond.constants[cond.less_than[1]]
    index = cond.elements.get(counter)
    start, step = 0, 1
    if index is not None:
        initial = caller.tuples.get(init, [])
        if index < len(initial) and initial[index] in caller.constants:
            start = caller.constants[initial[index]]
        updated = body.tuples.get(body.root, [])
        terms = body.adds.get(updated[index], ()) if index < len(updated) else ()
        if len(terms) == 2 and any(body.elements.get(t) == index for t in terms):
            increments = [body.constants[t] for t in terms if t in body.constants]
            step = increments[0] if increments and increments[0] > 0 else 1
    return max(0, -(-(bound - start) // step))


def trip_counts(hlo_text: str) -> dict[str, int]:
    """``loop body -> trips per execution of the loop`` for every ``while`` whose count is known
    or readable ([Note: loop trips]).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jshard._report.loop_trips import trip_counts
      >>> f = lambda x: jax.lax.fori_loop(0, 5, lambda i, h: jnp.sin(h), x)
      >>> list(trip_counts(jax.jit(f).lower(jnp.ones(3)).compile().as_text()).values())
      [5]
    """
    computations = _computations(hlo_text)
    counts: dict[str, int] = {}
    for current, line in hlo.computation_lines(hlo_text):
        loop = _WHILE.search(line)
        if not loop:
            continue
        init, cond, body = loop.groups()
        known = _KNOWN.search(line)
        trips = int(known.group(1)) if known else _trips(
            computations[current], init, computations[cond], computations[body])
        if trips is not None:
            counts[body] = trips
    return counts
