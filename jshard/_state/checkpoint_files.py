"""Where each tensor of a safetensors or Flax msgpack file lies, and reading some of its rows.

[Note: checkpoint files] Both formats store every tensor as one C-ordered run of bytes (a Flax
msgpack array over ``flax.serialization.MAX_CHUNK_SIZE`` as several runs, its flat chunks), so
an index of ``(name, shape, dtype, runs)`` read from the headers alone lets a loader read just
the rows a device needs: the dim-0 rows spanning the requested block are one flat range of the
runs, copied through a memory map opened for that read and closed after it, so the host holds
at most that range (a whole leaf when the block splits another dim) and no mapped page
outlives the read. A safetensors header is JSON; a msgpack file is walked type byte by type
byte, skipping each array's bytes, without unpacking it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import struct
from typing import Any

import ml_dtypes
import numpy as np

_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64, "I32": np.int32,
    "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
    "BOOL": np.bool_,
}
_CHUNKED = "__msgpack_chunked_array__"  # Flax's key for an array split into flat chunks
_NDARRAY_EXT = (1, 3)  # Flax's ext codes: an ndarray, a NumPy scalar (both (shape, dtype name, bytes))


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor of a file: its shape, dtype and ``runs``, ``(byte offset, element count)`` in flat order."""

    shape: tuple[int, ...]
    dtype: np.dtype
    runs: tuple[tuple[int, int], ...]


def safetensors_index(path: str) -> dict[str, StoredTensor]:
    """The tensors of a ``.safetensors`` file by name, from its JSON header."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    index = {}
    for name, entry in header.items():
        dtype = np.dtype(_SAFETENSORS_DTYPES[entry["dtype"]])
        shape = tuple(entry["shape"])
        index[name] = StoredTensor(shape, dtype, ((8 + length + entry["data_offsets"][0], math.prod(shape)),))
    return index


class _Walker:
    """A msgpack reader over a memory map that returns values but only the places of byte strings."""

    def __init__(self, buf: Any):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(">" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def raw(self, size: int) -> tuple[int, int]:
        """Skip ``size`` bytes: ``(offset, size)``."""
        self.pos += size
        return self.pos - size, size

    def value(self) -> Any:  # noqa: PLR0911, PLR0912 - one branch per msgpack type byte
        b = self.take("B")
        if b <= 0x7F or b >= 0xE0:
            return b if b <= 0x7F else b - 0x100
        if 0x80 <= b <= 0x8F or b in (0xDE, 0xDF):
            n = b & 0x0F if b <= 0x8F else self.take("H" if b == 0xDE else "I")
            return {self.text(self.value()): self.value() for _ in range(n)}
        if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
            n = b & 0x0F if b <= 0x9F else self.take("H" if b == 0xDC else "I")
            return [self.value() for _ in range(n)]
        if 0xA0 <= b <= 0xBF:
            return self.raw(b & 0x1F)
        sizes = {0xD9: "B", 0xDA: "H", 0xDB: "I", 0xC4: "B", 0xC5: "H", 0xC6: "I"}  # str and bin
        if b in sizes:
            return self.raw(self.take(sizes[b]))
        if b in (0xC7, 0xC8, 0xC9) or 0xD4 <= b <= 0xD8:  # ext
            size = self.take({0xC7: "B", 0xC8: "H", 0xC9: "I"}[b]) if b <= 0xC9 else 1 << (b - 0xD4)
            code = self.take("b")
            return self.ndarray() if code in _NDARRAY_EXT else self.raw(size)
        fixed = {0xC0: None, 0xC2: False, 0xC3: True}
        if b in fixed:
            return fixed[b]
        numbers = {0xCA: "f", 0xCB: "d", 0xCC: "B", 0xCD: "H", 0xCE: "I", 0xCF: "Q", 0xD0: "b", 0xD1: "h",
                   0xD2: "i", 0xD3: "q"}
        if b in numbers:
            return self.take(numbers[b])
        raise ValueError(f"not a msgpack file: unknown type byte {b:#x} at offset {self.pos - 1}")

    def text(self, key: Any) -> str:
        return bytes(self.buf[key[0]:key[0] + key[1]]).decode() if isinstance(key, tuple) else str(key)

    def ndarray(self) -> StoredTensor:
        """Flax's ext payload, ``(shape, dtype name, bytes)``, as a tensor of one run."""
        shape, name, (offset, _) = self.value()
        dtype = np.dtype(ml_dtypes.bfloat16) if self.text(name) == "bfloat16" else np.dtype(self.text(name))
        return StoredTensor(tuple(shape), dtype, ((offset, math.prod(shape)),))


def _flatten(node: Any, prefix: str, out: dict[str, StoredTensor]) -> None:
    if isinstance(node, dict) and _CHUNKED in node:
        chunks = [node["chunks"][str(i)] for i in range(len(node["chunks"]))]
        shape = tuple(node["shape"][str(i)] for i in range(len(node["shape"])))
        out[prefix] = StoredTensor(shape, chunks[0].dtype, tuple(r for c in chunks for r in c.runs))
    elif isinstance(node, dict):
        for key, child in node.items():
            _flatten(child, f"{prefix}.{key}" if prefix else key, out)
    elif isinstance(node, StoredTensor):
        out[prefix] = node


def msgpack_index(path: str) -> dict[str, StoredTensor]:
    """The arrays of a Flax msgpack file (``flax.serialization.to_bytes``) by dotted key path."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        tree = _Walker(buf).value()
    out: dict[str, StoredTensor] = {}
    _flatten(tree, "", out)
    return out


def read_block(path: str, tensor: StoredTensor, index: tuple[slice, ...]) -> np.ndarray:
    """``tensor[index]`` (slices with step 1, within the shape), reading only the dim-0 rows it spans."""
    if not tensor.shape:
        start, stop, shape = 0, 1, ()
    else:
        rows = index[0].indices(tensor.shape[0])
        per_row = math.prod(tensor.shape[1:])
        start, stop, shape = rows[0] * per_row, rows[1] * per_row, (rows[1] - rows[0], *tensor.shape[1:])
    out = np.empty(stop - start, tensor.dtype)
    done, first = 0, 0  # elements copied; flat index of the current run's first element
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        for offset, count in tensor.runs:
            lo, hi = max(start, first), min(stop, first + count)
            if lo < hi:
                view = np.frombuffer(buf, tensor.dtype, hi - lo, offset + (lo - first) * tensor.dtype.itemsize)
                out[done:done + hi - lo] = view
                done += hi - lo
                del view  # the map closes only once no array points into it
            first += count
    block = out.reshape(shape)
    return block if not tensor.shape else block[(slice(None), *index[1:])]
