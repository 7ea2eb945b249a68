"""Which gradient sizes XLA:TPU reduce-scatters natively: asked of the compiler.

[Note: scatter padding] XLA:TPU splits a large reduce-scatter into pieces of whole tiles and
wants the scattered dimension padded to a size it chooses. When the gradient does not have
that size already, it does not pad and scatter: it pads and runs an *all-reduce* of the whole
padded gradient, then slices (libtpu 0.0.42, measured on v5p, v5e and v6e groups of 2 to 16
chips: a float32 ``[4096, 4096]`` gradient scattered over a ring of 4 becomes an all-reduce of
``[4160, 4096]``; ``[4160, 4096]`` itself stays a reduce-scatter; shards up to about 4 MiB are
scattered as they are). That sends twice a reduce-scatter's bytes. The size depends on the
shape, the dtype and the group in a way not published, so jshard asks: it compiles the
reduce-scatter alone (once per shape, cached), reads the all-reduce's padded size, checks that
a gradient of that size stays a reduce-scatter, and pads each chunk of the gradient to it
(``jshard.collectives.reduce_scatter(sizes=...)``) so that every device still keeps its own
rows. The padding costs the extra rows (1.5% for ``[4096, 4096]``); elsewhere nothing changes.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from jax.sharding import Mesh

from jshard._sharding.compiler_probe import compiled_scatter
from jshard._sharding.torus import phase_groups


def scatter_sizes(mesh: Mesh | None, axes: tuple[str, ...], phases: tuple[int, ...], shape: tuple[int, ...],
                  dtype: np.dtype, dim: int) -> tuple[int, ...]:
    """For each reduce-scatter of a gradient of ``shape`` over ``axes`` (one per torus phase,
    or the one), the size of ``dim`` XLA:TPU scatters natively ([Note: scatter padding]);
    ``()`` off TPU (``mesh`` None).

    Example:
      >>> import numpy as np
      >>> from jshard._sharding.scatter_padding import scatter_sizes
      >>> scatter_sizes(None, ("fsdp",), (), (4096, 4096), np.dtype("float32"), 0)
      ()
    """
    if mesh is None:
        return ()
    n = math.prod(mesh.shape[a] for a in axes)
    steps = [(p, tuple(map(tuple, phase_groups(phases, k)))) for k, p in enumerate(phases)] if phases else [(n, None)]
    sizes = []
    for size, groups in steps:
        sizes.append(_native_size(mesh, axes, groups, size, tuple(shape), np.dtype(dtype).name, dim))
        shape = shape[:dim] + (shape[dim] // size,) + shape[dim + 1 :]
    return tuple(sizes)


@functools.cache
def _native_size(mesh: Mesh, axes: tuple[str, ...], groups, n: int, shape: tuple[int, ...], dtype: str,
                 dim: int) -> int:
    kind, padded = compiled_scatter(mesh, axes, groups, shape, dtype, dim)
    if kind == "reduce-scatter" or padded is None or padded <= shape[dim] or padded % n:
        return shape[dim]
    wider = shape[:dim] + (padded,) + shape[dim + 1 :]
    return padded if compiled_scatter(mesh, axes, groups, wider, dtype, dim)[0] == "reduce-scatter" else shape[dim]


def phases_and_sizes(mesh: Mesh | None, axes: tuple[str, ...], phases: tuple[int, ...], per_dimension: tuple[int, ...],
                     shape: tuple[int, ...], dtype: np.dtype, dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The phases a gradient of ``shape`` is reduced in, and each one's native size: ``phases``
    (an unrolled unit's two: [Note: two phases] in ``torus.py``), or the mesh's ``per_dimension``
    ones where XLA:TPU would pad the first of ``phases`` wider (a float32 ``[4096, 4096]`` on a
    v5p 2x2x2: 4480 rows over groups of 4, 4256 over pairs) or all-reduce it at any size where
    it keeps the per-dimension one a reduce-scatter (the Llama-3-8B output matrix's float32
    ``[4096, 128256]`` gradient, 2 GiB, over groups of 16 of a v5p 4x4x8, and over 4).

    Example:
      >>> import numpy as np
      >>> from jshard._sharding.scatter_padding import phases_and_sizes
      >>> phases_and_sizes(None, ("fsdp",), (), (), (4096, 4096), np.dtype("float32"), 0)
      ((), ())
    """
    sizes = scatter_sizes(mesh, axes, phases, shape, dtype, dim)
    if not phases or phases == per_dimension or not sizes:  # () is a choice too (``phases_pay_off``)
        return phases, sizes
    other = scatter_sizes(mesh, axes, per_dimension, shape, dtype, dim)
    if sizes[0] > other[0]:
        return per_dimension, other
    two_kept = first_kept(mesh, axes, phases, shape, sizes[0], dtype, dim)
    if not two_kept and first_kept(mesh, axes, per_dimension, shape, other[0], dtype, dim):
        return per_dimension, other
    return phases, sizes


def first_kept(mesh: Mesh, axes: tuple[str, ...], phases: tuple[int, ...], shape: tuple[int, ...], size: int,
               dtype: np.dtype, dim: int) -> bool:
    """Whether XLA:TPU keeps the first reduce-scatter of a ``shape`` gradient over ``axes`` (the
    first of ``phases``, or the one) a reduce-scatter, its input ``size`` wide on ``dim`` (small
    ones, vectors, it all-reduces alone whatever the phases: a latency choice).

    Example:
      >>> import jax, numpy as np
      >>> from jshard._sharding.scatter_padding import first_kept
      >>> mesh = jax.make_mesh((8,), ("fsdp",))
      >>> first_kept(mesh, ("fsdp",), (2, 4), (64, 128), 64, np.dtype("float32"), 0)  # CPU keeps it
      True
    """
    first = tuple(shape[:dim]) + (size,) + tuple(shape[dim + 1 :])
    groups = tuple(map(tuple, phase_groups(phases, 0))) if phases else None
    return compiled_scatter(mesh, axes, groups, first, np.dtype(dtype).name, dim)[0] == "reduce-scatter"
