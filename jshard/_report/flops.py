"""Matrix-multiply FLOPs of a compiled step, read from its HLO with loop trip counts.

``compiled.cost_analysis()["flops"]`` counts a ``while`` body once (measured on jax
0.10.2: a 4-layer ``lax.scan`` reported one layer's FLOPs), so a ``js.scan`` stack would
look 1/L as expensive as it is. Here every ``dot`` counts ``2 · |result| · |contracted|``
times the executions of its computation per step (the same call graph that counts
collectives). XLA:TPU writes its matmuls as ``convolution`` ops (``dim_labels=bf_io->bf``):
each counts ``2 · |result| · |lhs feature dim| · |kernel window|`` the same way.
Recomputation under remat is in the compiled program, so it is counted;
element-wise work is not (it is memory-bound and small beside the matmuls of a
transformer).
"""

from __future__ import annotations

import math
import re

from jshard._report.hlo import computation_lines
from jshard._report.step_collectives import loop_counts

_DEFINITION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = [a-z]+\d*\[([\d,]*)\]")
_DOT = re.compile(
    r"^\s*(?:ROOT )?%?[\w.\-]+ = [a-z]+\d*\[([\d,]*)\]\S* dot\(%?([\w.\-]+),.*?lhs_contracting_dims=\{([\d,]*)\}"
)

_CONVOLUTION = re.compile(
    r"^\s*(?:ROOT )?%?[\w.\-]+ = [a-z]+\d*\[([\d,]*)\]\S* convolution\(%?([\w.\-]+), %?([\w.\-]+)\)"
    r".*?dim_labels=([\w]+)_([\w]+)->"
)
_GROUPS = re.compile(r"feature_group_count=(\d+)")


def _dims(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def matmul_flops(hlo_text: str) -> float:
    """FLOPs of every ``dot`` of a compiled module per step, per device.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jshard.report import matmul_flops
      >>> f = lambda w, x: jax.lax.scan(lambda h, wi: (h @ wi, None), x, w)[0]
      >>> text = jax.jit(f).lower(jnp.ones((4, 64, 64)), jnp.ones((8, 64))).compile().as_text()
      >>> matmul_flops(text) == 4 * 2 * 8 * 64 * 64
      True
    """
    counts = loop_counts(hlo_text)
    shapes = {}
    for line in hlo_text.splitlines():
        definition = _DEFINITION.match(line)
        if definition:
            shapes[definition.group(1)] = _dims(definition.group(2))
    total = 0.0
    for current, line in computation_lines(hlo_text):
        dot, conv = _DOT.match(line), _CONVOLUTION.match(line)
        if dot:
            lhs = shapes.get(dot.group(2), [])
            contracted = math.prod(lhs[d] for d in _dims(dot.group(3)) if d < len(lhs))
            result = dot.group(1)
        elif conv:
            contracted = _convolution_contracted(line, conv, shapes)
            result = conv.group(1)
        else:
            continue
        total += 2.0 * math.prod(_dims(result)) * contracted * counts.get(current, (1, None))[0]
    return total


def _convolution_contracted(line: str, conv: re.Match, shapes: dict[str, list[int]]) -> float:
    """Products summed per result element: the lhs feature dim times the kernel's window."""
    lhs, rhs = shapes.get(conv.group(2), []), shapes.get(conv.group(3), [])
    lhs_labels, rhs_labels = conv.group(4), conv.group(5)
    if len(lhs) != len(lhs_labels) or len(rhs) != len(rhs_labels):
        return 0.0
    window = math.prod(size for label, size in zip(rhs_labels, rhs, strict=True) if label.isdigit())
    groups = _GROUPS.search(line)
    return lhs[lhs_labels.index("f")] * window / (int(groups.group(1)) if groups else 1)
