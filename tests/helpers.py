"""Shared test references: torch.chunk layout in NumPy, device coordinates, padding, NNX blocks, divisions,
the largest difference between two trees."""

from __future__ import annotations

import collections
import math
import re

import numpy as np


def torch_chunks(x: np.ndarray, n: int, dim: int) -> list[np.ndarray]:
    """FSDP2's shards: ``torch.chunk`` into ``ceil(d/n)`` rows, zero-padded to n equal chunks."""
    d = x.shape[dim]
    c = math.ceil(d / n)
    chunks = []
    for i in range(n):
        part = np.take(x, np.arange(min(i * c, d), min((i + 1) * c, d)), axis=dim)
        widths = [(0, 0)] * x.ndim
        widths[dim] = (0, c - part.shape[dim])
        chunks.append(np.pad(part, widths))
    return chunks


def shard_index(mesh, device, shard_axes: tuple[str, ...]) -> int:
    """The device's linear index over the shard axes (row-major, in the given order)."""
    coords = dict(zip(mesh.axis_names, np.argwhere(mesh.devices == device)[0], strict=True))
    sizes = [mesh.shape[a] for a in shard_axes]
    return int(np.ravel_multi_index([coords[a] for a in shard_axes], sizes))


def assert_torch_layout(stored, original: np.ndarray, mesh, shard_axes: tuple[str, ...], dim: int) -> None:
    """Every addressable shard of ``stored`` holds exactly FSDP2's chunk for its device."""
    n = math.prod(mesh.shape[a] for a in shard_axes)
    chunks = torch_chunks(np.asarray(original), n, dim)
    seen = set()
    for shard in stored.addressable_shards:
        i = shard_index(mesh, shard.device, shard_axes)
        np.testing.assert_array_equal(np.asarray(shard.data), chunks[i])
        seen.add(i)
    assert seen == set(range(n))


def max_diff(a, b) -> float:
    """The largest absolute difference between the paired leaves of two trees (in ``a``'s dtypes).

    ``inf`` when either tree holds a NaN or an infinity: a NaN is close to nothing, and
    Python's ``max`` over per-leaf maxima would skip one unless it came first.
    """
    import jax

    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x = np.asarray(x)
        x, y = x.astype(np.float64), np.asarray(y).astype(x.dtype).astype(np.float64)
        if not (np.isfinite(x).all() and np.isfinite(y).all()):
            return math.inf
        worst = max(worst, float(np.max(np.abs(x - y), initial=0.0)))
    return worst


def padding_values(tree) -> np.ndarray:
    """Every padding element of every stored leaf of ``tree`` (units), concatenated, as float32.

    Empty when nothing is padded; all zeros when the layout holds (``[Note: layout]``).
    """
    import jax

    from jshard._sharding.unit import map_unit_leaves

    def values(meta, layout, x):
        if layout is None or not layout.padding:
            return np.zeros((0,), np.float32)
        rows = range(layout.shape[layout.dim], layout.padded)
        return np.take(np.asarray(x), rows, layout.dim).ravel().astype(np.float32)

    return np.concatenate(jax.tree.leaves(map_unit_leaves(values, tree)))


def assert_zero_padding(*trees) -> None:
    """The trees hold padding, and every padding element is zero (an empty check would prove nothing)."""
    values = np.concatenate([padding_values(tree) for tree in trees])
    assert values.size, "nothing is padded: this check needs a leaf that the shard axes do not divide"
    assert not values.any(), f"{np.count_nonzero(values)} non-zero padding elements"


def run_nnx_blocks(blocks, x, scan: bool):
    """NNX blocks as the NNX docs run them: ``nnx.scan`` over stacked blocks, or a Python loop."""
    from flax import nnx

    if scan:

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return block(x)

        return forward(x, blocks)
    for block in blocks:
        x = block(x)
    return x


_CONSTANT = re.compile(r"(%[\w#]+) = stablehlo\.constant dense<([-+.\deE]+)> : tensor<\w*>")
_BROADCAST = re.compile(r"(%[\w#]+) = stablehlo\.broadcast_in_dim (%[\w#]+),")
_DIVIDE = re.compile(r"stablehlo\.divide %[\w#]+, (%[\w#]+)")


def collective_dtypes(stablehlo_text: str) -> dict[str, set[str]]:
    """The result dtypes of each kind of collective in a lowered program (the dtypes the step asked for)."""
    from jshard._report.hlo import lowered_collectives

    found: dict[str, set[str]] = collections.defaultdict(set)
    for kind, dtype in lowered_collectives(stablehlo_text):
        found[kind].add(dtype)
    return dict(found)


def constant_divisors(stablehlo_text: str) -> collections.Counter:
    """How many times a lowered program divides by each scalar constant (broadcast or not)."""
    values: dict[str, float] = {}
    found: collections.Counter = collections.Counter()
    for line in stablehlo_text.splitlines():
        if m := _CONSTANT.search(line):
            values[m.group(1)] = float(m.group(2))
        elif m := _BROADCAST.search(line):
            if m.group(2) in values:
                values[m.group(1)] = values[m.group(2)]
        elif (m := _DIVIDE.search(line)) and m.group(1) in values:
            found[values[m.group(1)]] += 1
    return found
