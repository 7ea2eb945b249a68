"""What a compiled step communicates: collectives with loop trip counts, dtypes, wire bytes.

Builds on :mod:`jshard._report.hlo`: each collective of the compiled HLO gets the number of
times it runs per step (the product of the known trip counts of the ``while`` loops
around it), its group size, its dtype as *asked for* (the lowered StableHLO's, since
XLA:CPU upcasts bf16 collectives when compiling; the compiled one where XLA narrowed it) and
the bytes each device sends per execution under the ring model of docs/design.md
"Performance model".
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

import numpy as np

from jshard._report import hlo, loop_trips

_CALLEE = re.compile(r"\b(body|condition|calls|to_apply)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_PARTITIONS = re.compile(r"\bnum_partitions=(\d+)")
_EXPLICIT_GROUP = re.compile(r"\{([\d,]*)\}")
_IOTA_GROUPS = re.compile(r"^\[(\d+),(\d+)\]<=")


@dataclasses.dataclass(frozen=True)
class StepCollective:
    """One collective of a compiled step, as a report lists it.

    ``dtype`` is the dtype the program asked for (lowered StableHLO), or the compiled one where
    the backend sends less (XLA:TPU gathers f32 weights read by default-precision matmuls in
    bf16), and ``compiled_dtype`` the one the backend runs (XLA:CPU upcasts bf16 to f32).
    ``bytes`` is the size of its result in ``dtype``; ``wire_bytes`` what each device
    sends per execution (ring model); ``executions`` how often it runs per step
    (``trip_count`` of the innermost loop, ``None`` when unknown, counted once); ``axes``
    the mesh axes its groups run along (empty when the mesh was not given).
    """

    kind: str
    dtype: str
    compiled_dtype: str
    shapes: tuple[tuple[int, ...], ...]
    replica_groups: str
    group_size: int
    in_loop: bool
    trip_count: int | None
    executions: int
    bytes: int
    wire_bytes: float
    axes: tuple[str, ...] = ()

    @property
    def wire_bytes_per_step(self) -> float:
        """Bytes each device sends for this collective over one step."""
        return self.wire_bytes * self.executions


def _call_graph(hlo_text: str) -> tuple[dict[str, list[tuple[str, int | None, bool]]], str]:
    """``caller -> [(callee, trip count or None, is a loop body)]`` and the entry computation."""
    graph: dict[str, list[tuple[str, int | None, bool]]] = collections.defaultdict(list)
    trips = loop_trips.trip_counts(hlo_text)
    entry = hlo.entry_computation(hlo_text)
    for current, line in hlo.computation_lines(hlo_text):
        for role, callee in _CALLEE.findall(line):
            body = role == "body"
            graph[current].append((callee, trips.get(callee) if body else None, body))
        for branches in _BRANCHES.findall(line):
            graph[current].extend((b.strip().lstrip("%"), None, False) for b in branches.split(",") if b.strip())
    return graph, entry


def loop_counts(hlo_text: str) -> dict[str, tuple[int, int | None]]:
    """``computation -> (executions per step, trip count of the innermost loop)``.

    A ``while`` body runs ``trip count`` times per execution of its caller; an unknown
    trip count counts as one (and its trip count is reported as ``None``).
    """
    graph, entry = _call_graph(hlo_text)
    counts: dict[str, tuple[int, int | None]] = {}
    stack = [(entry, 1, None)]
    while stack:
        name, mult, trip = stack.pop()
        if name in counts and counts[name][0] >= mult:
            continue
        counts[name] = (mult, trip)
        for callee, n, body in graph.get(name, ()):
            if body:
                stack.append((callee, mult * (1 if n is None else n), n))
            else:
                stack.append((callee, mult, trip))
    return counts


def group_size(replica_groups: str, num_partitions: int) -> int:
    """Devices in one replica group (explicit ``{{0,1},{2,3}}`` or iota ``[2,2]<=[4]``)."""
    iota = _IOTA_GROUPS.match(replica_groups)
    if iota:
        return int(iota.group(2))
    groups = [g for g in _EXPLICIT_GROUP.findall(replica_groups.strip()[1:-1] if replica_groups else "")]
    if not groups or not groups[0]:
        return num_partitions
    return len(groups[0].split(","))


def group_axes(replica_groups: str, mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes a collective's (explicit) replica groups run along: those that vary in a group.

    Example:
      >>> from jshard._report.step_collectives import group_axes
      >>> group_axes("{{0,2,4,6},{1,3,5,7}}", {"fsdp": 4, "tp": 2}), group_axes("{{0,1},{2,3}}", {"fsdp": 2, "tp": 2})
      (('fsdp',), ('tp',))
    """
    names, sizes = tuple(mesh_shape), tuple(mesh_shape.values())
    groups = _EXPLICIT_GROUP.findall(replica_groups.strip()[1:-1] if replica_groups else "")
    if not groups or not groups[0]:
        return names
    coords = np.unravel_index([int(i) for i in groups[0].split(",")], sizes)
    return tuple(name for name, c in zip(names, coords, strict=True) if len(set(c.tolist())) > 1)


def wire_bytes(kind: str, result_bytes: int, n: int) -> float:
    """Bytes one device sends for one collective under the ring model of docs/design.md.

    Example:
      >>> from jshard._report.step_collectives import wire_bytes
      >>> wire_bytes("all-gather", 800, 8), wire_bytes("reduce-scatter", 100, 8), wire_bytes("all-reduce", 800, 8)
      (700.0, 700.0, 1400.0)
    """
    if n <= 1:
        return 0.0
    if kind == "reduce-scatter":
        return float(result_bytes * (n - 1))
    if kind == "all-reduce":
        return 2.0 * result_bytes * (n - 1) / n
    if kind == "collective-permute":
        return float(result_bytes)
    return result_bytes * (n - 1) / n


def _lowered_dtypes(stablehlo_text: str) -> dict[tuple[str, tuple[int, ...]], set[str]]:
    """``(kind, result shape) -> dtypes`` of the lowered program's collectives."""
    out: dict[tuple[str, tuple[int, ...]], set[str]] = collections.defaultdict(set)
    for kind, results in hlo.lowered_collective_results(stablehlo_text):
        for dtype, shape in results:
            out[(kind, shape)].add(dtype)
    return out


def _requested_dtype(kind: str, shape: tuple[int, ...], compiled: str, lowered: dict) -> str:
    """The lowered program's dtype where the backend widened it (XLA:CPU runs bf16 collectives in
    f32), the compiled one where the backend narrowed it (XLA:TPU gathers an f32 leaf whose readers
    are all default-precision matmuls in bf16: its convert moves before the all-gather)."""
    dtypes = lowered.get((kind, shape), set())
    if len(dtypes) != 1:
        return compiled
    asked = next(iter(dtypes))
    return compiled if np.dtype(compiled).itemsize < np.dtype(asked).itemsize else asked


def step_collectives(hlo_text: str, stablehlo_text: str = "", mesh_shape: dict[str, int] | None = None
                     ) -> list[StepCollective]:
    """Every collective of a compiled step, with executions per step and wire bytes.

    Args:
      hlo_text: ``compiled.as_text()``.
      stablehlo_text: ``lowered.as_text()``; where a compiled collective's kind and
        shape match lowered ones of a single dtype, that dtype is reported.
      mesh_shape: the step's mesh axis sizes; each collective then names the axes it runs along.

    Example:
      >>> import jax, jax.numpy as jnp, jshard as js
      >>> from jshard._report.step_collectives import step_collectives
      >>> mesh = js.make_mesh()
      >>> f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "fsdp"), mesh=mesh,
      ...             in_specs=jax.P("fsdp"), out_specs=jax.P()))
      >>> x = jax.device_put(jnp.ones(8, jnp.bfloat16), jax.NamedSharding(mesh, jax.P("fsdp")))
      >>> lowered = f.lower(x)
      >>> [(c.kind, c.dtype, c.executions) for c in step_collectives(lowered.compile().as_text(), lowered.as_text())]
      [('all-reduce', 'bfloat16', 1)]
    """
    partitions = _PARTITIONS.search(hlo_text)
    num_partitions = int(partitions.group(1)) if partitions else 1
    counts = loop_counts(hlo_text)
    lowered = _lowered_dtypes(stablehlo_text)
    out = []
    for c in hlo.hlo_collectives(hlo_text):
        n = group_size(c.replica_groups, num_partitions)
        dtypes = [_requested_dtype(c.kind, s, c.dtype, lowered) for s in c.shapes]
        nbytes = sum(math.prod(s) * np.dtype(d).itemsize for s, d in zip(c.shapes, dtypes, strict=True))
        executions, trip = counts.get(c.computation, (1, None))
        out.append(StepCollective(
            kind=c.kind,
            dtype=dtypes[0] if dtypes else c.dtype,
            compiled_dtype=c.dtype,
            shapes=c.shapes,
            replica_groups=c.replica_groups,
            group_size=n,
            in_loop=c.in_loop or trip is not None,
            trip_count=trip,
            executions=executions,
            bytes=nbytes,
            wire_bytes=wire_bytes(c.kind, nbytes, n),
            axes=group_axes(c.replica_groups, mesh_shape) if mesh_shape else (),
        ))
    return out


def wire_bytes_by_kind(collectives: list[StepCollective]) -> dict[str, float]:
    """Bytes each device sends per step, summed by collective kind (every kind listed)."""
    totals = dict.fromkeys(hlo.KINDS, 0.0)
    for c in collectives:
        totals[c.kind] += c.wire_bytes_per_step
    return totals


_MEGASCALE_SEND = re.compile(r"^\s*%?[\w.\-]+ = \((\w+)\[([\d,]*)\][^,]*,.* send\(.*xla_megascale")


def data_center_bytes(hlo_text: str) -> float:
    """Bytes each device sends across TPU slices per step: a multi-slice program's collectives
    between slices are ``send`` ops to XLA:TPU's megascale runtime (loop trip counts included)."""
    counts = loop_counts(hlo_text)
    total = 0.0
    for current, line in hlo.computation_lines(hlo_text):
        send = _MEGASCALE_SEND.match(line)
        if send:
            size = math.prod(int(d) for d in send.group(2).split(",") if d)
            total += size * np.dtype(hlo.HLO_DTYPES[send.group(1)]).itemsize * counts.get(current, (1,))[0]
    return total
