"""Matrix-multiply FLOPs of a compiled step, read from its HLO with loop trip counts.

``compiled.cost_analysis()["flops"]`` counts a ``while`` body once (measured on jax
0.10.2: a 4-layer ``lax.scan`` reported one layer's FLOPs), so a ``js.scan`` stack would
look 1/L as expensive as it is. Here every ``dot`` counts ``2 · |result| · |contracted|``
times the executions of its computation per step (the same call graph that counts
collectives). XLA:TPU writes its matmuls as ``convolution`` ops (``dim_labels=bf_io->bf``):
each counts ``2 · |result| · |lhs feature dim| / groups`` times the window taps that land on
the input ([Note: convolution taps]).

[Note: convolution taps] XLA:TPU also writes batched and broadcast matmuls as convolutions
over a spatial dim with a window, padding, strides and base dilation: a projection broadcast
over 8 heads is ``window={size=8 pad=7_7 rhs_reversal=1}`` over an input of spatial size 1, so
each output position meets exactly one input element and the other 7 taps fall in the padding.
Counting the whole window (``|lhs feature dim| · |kernel window|``, what this module did
before) read such a product as 8 matmuls: an NNX Llama layer (dim 1024, 8 heads, GQA) on v5p
counted 429.5 forward GFLOP against XLA:CPU's 257.7 for the same program, and jshard's and the
recipe's programs, written with different windows, differed by 10% while XLA:CPU counted them
equal. Only taps on real input elements multiply: per spatial dim, the pairs (output position
``o``, window tap ``j``) whose input position ``o · stride + j · rhs_dilate - pad_low`` lies in
the base-dilated input ``[0, (n - 1) · lhs_dilate]`` on a multiple of ``lhs_dilate``.
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
    r".*?dim_labels=([\w]+)_([\w]+)->([\w]+)"
)
_WINDOW = re.compile(r"window=\{([^}]*)\}")
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
    """Products summed per result element, on average: the lhs feature dim (over its groups) times
    the window taps that land on the input ([Note: convolution taps])."""
    lhs, rhs, out = shapes.get(conv.group(2), []), shapes.get(conv.group(3), []), _dims(conv.group(1))
    lhs_labels, rhs_labels, out_labels = conv.group(4), conv.group(5), conv.group(6)
    if len(lhs) != len(lhs_labels) or len(rhs) != len(rhs_labels) or len(out) != len(out_labels):
        return 0.0
    window = _window(line)
    taps = 1.0
    for d in sorted(label for label in lhs_labels if label.isdigit()):
        taps *= _taps(lhs[lhs_labels.index(d)], rhs[rhs_labels.index(d)], out[out_labels.index(d)],
                      **{key: values[int(d)] for key, values in window.items()})
    groups = _GROUPS.search(line)
    return lhs[lhs_labels.index("f")] / (int(groups.group(1)) if groups else 1) * taps


def _window(line: str) -> dict[str, list[int]]:
    """``stride``, ``pad_low``, ``lhs_dilate`` and ``rhs_dilate`` per spatial dim of the line's ``window={...}``."""
    found = _WINDOW.search(line)
    fields = dict(field.split("=") for field in found.group(1).split()) if found else {}
    rank = len(fields["size"].split("x")) if "size" in fields else 0

    def per_dim(name: str, default: int) -> list[int]:
        return [int(v) for v in fields[name].split("x")] if name in fields else [default] * rank

    return {"stride": per_dim("stride", 1), "lhs_dilate": per_dim("lhs_dilate", 1),
            "rhs_dilate": per_dim("rhs_dilate", 1),
            "pad_low": [int(v.split("_")[0]) for v in fields["pad"].split("x")] if "pad" in fields else [0] * rank}


def _taps(size: int, window: int, outputs: int, stride: int, pad_low: int, lhs_dilate: int, rhs_dilate: int) -> float:
    """Window taps on input elements per output position of one spatial dim, on average.

    Example:
      >>> _taps(1, 8, 8, stride=1, pad_low=7, lhs_dilate=1, rhs_dilate=1)  # broadcast over 8: one tap each
      1.0
      >>> _taps(16, 3, 16, stride=1, pad_low=1, lhs_dilate=1, rhs_dilate=1)  # "same" padding: 3 inside, 2 at the edges
      2.875
    """
    last = (size - 1) * lhs_dilate
    hits = 0
    for j in range(window):
        first = j * rhs_dilate - pad_low  # the input position of output 0's tap j
        if lhs_dilate == 1:  # outputs o with 0 <= first + o * stride <= last
            hits += max(0, min(outputs - 1, (last - first) // stride) - max(0, -(first // stride)) + 1)
        else:
            hits += sum(1 for o in range(outputs)
                        if 0 <= first + o * stride <= last and (first + o * stride) % lhs_dilate == 0)
    return hits / outputs
