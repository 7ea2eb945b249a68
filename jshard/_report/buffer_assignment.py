"""The allocations of XLA's buffer assignment (a compile's ``*buffer-assignment.txt``)."""

from __future__ import annotations

import re

ALLOCATION = re.compile(r"^allocation (\d+): size (\d+), (.*)$")


def device_memory_bytes(buffer_assignment: str) -> int:
    """Bytes XLA allocates in the device's own memory space (HBM on a TPU) in a ``*buffer-assignment.txt``:
    parameters, outputs, constants and temporaries, not the allocations of another memory space
    (``color N``) or a thread's own (``thread-local``). On XLA:TPU this is the figure the compiler checks
    against HBM ([Note: TPU temporaries]).

    Example:
      >>> text = '''allocation 0: size 64, parameter 0, shape |f32[16]| at ShapeIndex {}:
      ... allocation 1: size 512, constant:
      ... allocation 2: size 4096, preallocated-temp:
      ... allocation 3: size 2048, color 1, preallocated-temp:
      ... allocation 4: size 512, thread-local:'''
      >>> device_memory_bytes(text)
      4672
    """
    allocations = (m.groups() for m in map(ALLOCATION.match, buffer_assignment.splitlines()) if m)
    return sum(int(size) for _, size, kinds in allocations if "color" not in kinds and "thread-local" not in kinds)
