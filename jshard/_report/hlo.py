"""Collectives read from program text: compiled HLO and lowered StableHLO."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

HLO_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64", "s8": "int8",
               "u8": "uint8", "s32": "int32", "s64": "int64", "u32": "uint32", "pred": "bool"}
COMPUTATION_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_WHILE_BODY = re.compile(r"\bwhile\(.*\bbody=%?([\w.\-]+)")
_INSTR = re.compile(
    r"^\s*(?:ROOT )?%?[\w.\-]+ = (.+?) (" + "|".join(KINDS) + r")(?:-start)?\((.*)$"
)
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_GROUPS = re.compile(
    r"replica_groups=(\{(?:\{[\d,]*\},?)*\}|\[[^\]]*\]<=\[[^\]]*\](?:T\([\d,]*\))?|mesh\[[^\]]*\] \{[^}]*\})"
)
_CHAIN = re.compile(r'\bchain_id="(\d+)"')  # one asynchronous collective's copies, under XLA:TPU's async fusion
_PAIRS = re.compile(r"source_target_pairs=(\{(?:\{[\d,]*\},?)*\})")  # a collective-permute's groups
_IOTA = re.compile(r"\[([\d,]*)\]<=\[([\d,]*)\](?:T\(([\d,]*)\))?")
_MESH = re.compile(r"mesh\[([^\]]*)\] \{([^}]*)\}")


def computation_lines(hlo_text: str) -> Iterator[tuple[str, str]]:
    r"""``(computation, line)`` for every line of ``hlo_text`` but the computations' headers:
    the one walk the readers of compiled HLO share.

    Example:
      >>> from jshard._report.hlo import computation_lines
      >>> list(computation_lines("ENTRY %main (p: f32[2]) -> f32[2] {\n  ROOT %p = f32[2] parameter(0)\n}"))
      [('main', '  ROOT %p = f32[2] parameter(0)'), ('main', '}')]
    """
    current = ""
    for line in hlo_text.splitlines():
        header = COMPUTATION_HEADER.match(line)
        if header:
            current = header.group(1)
        else:
            yield current, line


def entry_computation(hlo_text: str) -> str:
    r"""The name of a program's ``ENTRY`` computation (``""`` if it has none).

    Example:
      >>> from jshard._report.hlo import entry_computation
      >>> entry_computation("%f (x: f32[]) -> f32[] {\n}\nENTRY %main (p: f32[2]) -> f32[2] {\n}")
      'main'
    """
    for line in hlo_text.splitlines():
        header = COMPUTATION_HEADER.match(line)
        if header and line.startswith("ENTRY"):
            return header.group(1)
    return ""


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _explicit(groups: np.ndarray) -> str:
    return "{" + ",".join("{" + ",".join(str(int(d)) for d in row) + "}" for row in groups) + "}"


_SUB_AXIS = re.compile(r"'([^']+)'(?::\((\d+)\)(\d+))?")


def _mesh_groups(axes_text: str, listed_text: str) -> np.ndarray:
    """Groups of ``mesh['a'=2,'b'=4] {'b'}``; a listed ``'b':(p)s`` is Shardy's sub-axis of
    ``b`` with pre-size ``p`` (the product of the more major factors) and size ``s``."""
    axes = [(name.strip().strip("'"), int(size)) for name, size in (item.split("=") for item in axes_text.split(","))]
    listed = {m.group(1): (int(m.group(2) or 1), int(m.group(3) or 0)) for m in _SUB_AXIS.finditer(listed_text)}
    dims, keep = [], []
    for name, size in axes:
        pre, sub = listed.get(name, (1, 0))
        sub = sub or (size if name in listed else 0)
        if sub and size % (pre * sub):
            raise ValueError(f"sub-axis {name!r}:({pre}){sub} does not divide {size}")
        factors = [pre, sub, size // (pre * sub)] if sub else [size]
        keep += [False, True, False] if sub else [False]
        dims += factors
    if set(listed) - {name for name, _ in axes}:
        raise ValueError(f"unknown axes in {listed_text!r}")
    order = [i for i, k in enumerate(keep) if not k] + [i for i, k in enumerate(keep) if k]
    devices = np.arange(math.prod(dims)).reshape(dims).transpose(order)
    return devices.reshape(-1, math.prod(d for d, k in zip(dims, keep, strict=True) if k))


def normalize_groups(raw: str) -> str:
    """Replica groups as explicit ``{{0,1},{2,3}}``, whichever notation XLA printed.

    Newer XLA prints iota (``[2,4]<=[4,2]T(1,0)``) or mesh-axes (``mesh['a'=2,'b'=4] {'b'}``)
    forms; the groups they describe are the same.

    Example:
      >>> from jshard._report.hlo import normalize_groups
      >>> normalize_groups("mesh['replicate'=2,'fsdp'=4] {'fsdp'}"), normalize_groups("[2,2]<=[2,2]T(1,0)")
      ('{{0,1,2,3},{4,5,6,7}}', '{{0,2},{1,3}}')
      >>> normalize_groups("mesh['fsdp'=8] {'fsdp':(1)2}"), normalize_groups("mesh['fsdp'=8] {'fsdp':(2)4}")
      ('{{0,4},{1,5},{2,6},{3,7}}', '{{0,1,2,3},{4,5,6,7}}')
    """
    iota = _IOTA.fullmatch(raw)
    if iota:
        shape, dims, perm = _ints(iota.group(1)), _ints(iota.group(2)), _ints(iota.group(3) or "")
        devices = np.arange(math.prod(dims)).reshape(dims)
        return _explicit((devices.transpose(perm) if perm else devices).reshape(shape))
    mesh = _MESH.fullmatch(raw)
    if mesh:
        try:
            return _explicit(_mesh_groups(mesh.group(1), mesh.group(2)))
        except ValueError:
            return raw  # a notation this parser does not know: keep XLA's text
    return raw


@dataclasses.dataclass(frozen=True)
class HloCollective:
    """One collective of a compiled program.

    ``shapes`` and ``dtype`` are its result's (a combined collective has several);
    ``bytes`` is their total size; ``computation`` is the HLO computation it sits in and
    ``in_loop`` whether that is a ``while`` body (it then runs once per iteration);
    ``replica_groups`` a collective-permute's source-target pairs.
    """

    kind: str
    dtype: str
    shapes: tuple[tuple[int, ...], ...]
    replica_groups: str
    computation: str
    in_loop: bool

    @property
    def bytes(self) -> int:
        return sum(math.prod(s) for s in self.shapes) * np.dtype(self.dtype).itemsize


def _arrays(text: str) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for dtype, dims in _ARRAY.findall(text):
        if dtype in HLO_DTYPES:
            out.append((HLO_DTYPES[dtype], tuple(int(d) for d in dims.split(",") if d)))
    return out


def hlo_collectives(hlo_text: str) -> list[HloCollective]:
    """Every collective in compiled HLO text (``compiled.as_text()``), in program order.

    Under XLA:TPU's async-collective fusion (MaxText's ``LIBTPU_INIT_ARGS``) one collective is
    copied into every fusion that runs a step of it, each copy tagged with the same
    ``chain_id``: it is listed once (13 all-gathers of four unrolled 512-wide GELU units read
    35 times otherwise).

    Example:
      >>> import jax, jax.numpy as jnp, jshard as js
      >>> from jshard._report.hlo import hlo_collectives
      >>> mesh = js.make_mesh()
      >>> f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "fsdp"), mesh=mesh,
      ...             in_specs=jax.P("fsdp"), out_specs=jax.P()))
      >>> x = jax.device_put(jnp.ones(8), jax.NamedSharding(mesh, jax.P("fsdp")))
      >>> [c.kind for c in hlo_collectives(f.lower(x).compile().as_text())]
      ['all-reduce']
    """
    bodies = set(_WHILE_BODY.findall(hlo_text))
    found, chains = [], set()
    for computation, line in computation_lines(hlo_text):
        instr = _INSTR.match(line)
        if not instr or instr.group(2) + "-done" in line:
            continue
        chain = _CHAIN.search(line)
        if chain:  # a copy of an asynchronous collective in each fusion that runs one of its steps
            if chain.group(1) in chains:
                continue
            chains.add(chain.group(1))
        result, kind = instr.group(1), instr.group(2)
        arrays = _arrays(result)
        if kind in ("all-gather", "collective-permute", "all-reduce", "reduce-scatter") and "-start(" in line:
            if kind == "all-gather":  # (operands, results)
                arrays = arrays[len(arrays) // 2 :]
            elif kind == "collective-permute":  # (operand, result, two u32 contexts) on XLA:TPU
                arrays = arrays[1:2]
        groups = _GROUPS.search(line) or _PAIRS.search(line)
        found.append(HloCollective(
            kind=kind,
            dtype=arrays[0][0] if arrays else "",
            shapes=tuple(shape for _, shape in arrays),
            replica_groups=normalize_groups(groups.group(1)) if groups else "",
            computation=computation,
            in_loop=computation in bodies,
        ))
    return found


_STABLEHLO = re.compile(r"stablehlo\.(all_gather|reduce_scatter|all_reduce|all_to_all|collective_permute)\"?")
_TENSOR = re.compile(r"tensor<([\dx]*)x?([a-z]+\d*)>")
_MLIR_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64", "i8": "int8",
                "i32": "int32", "ui8": "uint8", "i1": "bool"}


def lowered_collective_results(stablehlo_text: str) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """``(kind, [(dtype, shape) of each result])`` of every collective in lowered StableHLO text.

    Example:
      >>> import jax, jax.numpy as jnp, jshard as js
      >>> from jshard._report.hlo import lowered_collective_results
      >>> mesh = js.make_mesh()
      >>> f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "fsdp"), mesh=mesh,
      ...             in_specs=jax.P("fsdp"), out_specs=jax.P()))
      >>> x = jax.device_put(jnp.ones(16, jnp.bfloat16), jax.NamedSharding(mesh, jax.P("fsdp")))
      >>> lowered_collective_results(f.lower(x).as_text())
      [('all-reduce', [('bfloat16', (2,))])]
    """
    out = []
    lines = stablehlo_text.splitlines()
    for i, line in enumerate(lines):
        match = _STABLEHLO.search(line)
        if not match:
            continue
        kind = match.group(1).replace("_", "-")
        signature = next((s for s in lines[i:] if "->" in s and "tensor<" in s.split("->")[-1]), line)
        results = [
            (_MLIR_DTYPES.get(dtype, dtype), tuple(int(d) for d in dims.split("x") if d))
            for dims, dtype in _TENSOR.findall(signature.split("->")[-1])
        ]
        out.append((kind, results))
    return out


def lowered_collectives(stablehlo_text: str) -> list[tuple[str, str]]:
    """``(kind, result dtype)`` of every collective in lowered StableHLO text.

    XLA:CPU upcasts bf16 collectives when compiling; the lowered program keeps the dtype
    that was asked for, so assert dtypes here.

    Example:
      >>> import jax, jax.numpy as jnp, jshard as js
      >>> from jshard._report.hlo import lowered_collectives
      >>> mesh = js.make_mesh()
      >>> f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "fsdp"), mesh=mesh,
      ...             in_specs=jax.P("fsdp"), out_specs=jax.P()))
      >>> x = jax.device_put(jnp.ones(8, jnp.bfloat16), jax.NamedSharding(mesh, jax.P("fsdp")))
      >>> lowered_collectives(f.lower(x).as_text())
      [('all-reduce', 'bfloat16')]
    """
    return [(kind, results[0][0] if results else "") for kind, results in lowered_collective_results(stablehlo_text)]


_LAYOUT_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\](\{[^}]*\})?")


def entry_bytes_by_memory_space(hlo_text: str) -> dict[str, dict[str, int]]:
    """Per-device bytes of the entry's arguments and outputs, split by memory space.

    XLA:CPU's ``memory_analysis()`` counts host-resident (offloaded) buffers as device
    bytes; the entry layout marks them ``S(5)``, so this tells the two apart exactly.

    Example:
      >>> import jax, jax.numpy as jnp, jshard as js
      >>> from jshard._report.hlo import entry_bytes_by_memory_space
      >>> policy = js.FullyShardPolicy(offload_policy=js.CPUOffloadPolicy())
      >>> p = js.fully_shard({"w": jnp.ones((8, 4))}, policy=policy)
      >>> text = jax.jit(lambda p: p).lower(p).compile().as_text()
      >>> entry_bytes_by_memory_space(text)["host"]
      {'arguments': 16, 'outputs': 16}
    """
    header = next((line for line in hlo_text.splitlines() if "entry_computation_layout=" in line), "")
    layout = header.split("entry_computation_layout={", 1)[-1]
    args, _, outs = layout.partition(")->")
    found = {"device": {"arguments": 0, "outputs": 0}, "host": {"arguments": 0, "outputs": 0}}
    for part, text in (("arguments", args), ("outputs", outs)):
        for dtype, dims, tiling in _LAYOUT_ARRAY.findall(text):
            if dtype not in HLO_DTYPES:
                continue
            size = math.prod(int(d) for d in dims.split(",") if d) * np.dtype(HLO_DTYPES[dtype]).itemsize
            found["host" if "S(5)" in tiling else "device"][part] += size
    return found
