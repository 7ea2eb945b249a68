"""Asking XLA what it makes of one collective: a probe compiled apart from the caller's program."""

from __future__ import annotations

import concurrent.futures
import functools
import re

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jshard._sharding.scatter_layout import dim_major

# Probes compile in a thread of their own: the caller is usually tracing a step (inside
# ``shard_map``), whose context mesh a separate program must not see.
_PROBES = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jshard-compiler-probe")
_SHAPE = re.compile(r"=\s*\(?\w+\[([\d,]*)\]")


@functools.cache
def compiled_scatter(mesh: Mesh, axes: tuple[str, ...], groups: tuple[tuple[int, ...], ...] | None,
                     shape: tuple[int, ...], dtype: str, dim: int) -> tuple[str, int | None]:
    """What XLA compiles a tiled reduce-scatter of ``shape`` over ``axes`` (within ``groups`` of
    indices over them; ``dim`` most major, as jshard hands them over) to on ``mesh``'s devices:
    ``("reduce-scatter", None)`` where it stays one, else ``("all-reduce", size)`` with the size
    of ``dim`` in the all-reduce it made of it (``None`` if other dims changed too). Cached;
    compiled in a thread of its own.

    Example:
      >>> import jax
      >>> from jshard._sharding.compiler_probe import compiled_scatter
      >>> mesh = jax.make_mesh((8,), ("fsdp",))
      >>> compiled_scatter(mesh, ("fsdp",), None, (64, 128), "float32", 0)  # CPU keeps it
      ('reduce-scatter', None)
    """
    return _PROBES.submit(_compile, mesh, axes, groups, shape, dtype, dim).result()


def _compile(mesh, axes, groups, shape, dtype, dim) -> tuple[str, int | None]:
    def scatter(g):
        index_groups = None if groups is None else [list(group) for group in groups]
        return jax.lax.psum_scatter(dim_major(g, dim), axes, scatter_dimension=dim, tiled=True,
                                    axis_index_groups=index_groups)

    f = jax.shard_map(scatter, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec(axes), check_vma=False)
    text = jax.jit(f).lower(jax.ShapeDtypeStruct(shape, np.dtype(dtype))).compile().as_text()
    lines = [line for line in text.splitlines() if re.search(r" (reduce-scatter|all-reduce)(-start)?\(", line)]
    if not lines or any(re.search(r" reduce-scatter(-start)?\(", line) for line in lines):
        return "reduce-scatter", None
    m = _SHAPE.search(lines[0])
    dims = tuple(int(d) for d in m.group(1).split(",")) if m and m.group(1) else ()
    if len(dims) != len(shape) or any(a != b for i, (a, b) in enumerate(zip(dims, shape, strict=True)) if i != dim):
        return "all-reduce", None
    return "all-reduce", dims[dim]
