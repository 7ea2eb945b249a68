"""Per-device bytes of a compiled program, from ``compiled.memory_analysis()``."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jshard._report.buffer_assignment import device_memory_bytes
from jshard._report.hlo import entry_bytes_by_memory_space

MEMORY_FIELDS = ("argument", "output", "temp", "alias", "generated_code")


@dataclasses.dataclass(frozen=True)
class Memory:
    """Per-device bytes of a compiled program, from ``compiled.memory_analysis()``.

    ``peak`` is ``argument + output + temp - alias``: everything the program holds at
    once at most (XLA:CPU's own ``peak_memory_in_bytes`` leaves arguments out and is
    kept as ``xla_peak``). ``host_*`` are the same figures in host memory kinds; where
    the backend counts host-resident arguments and outputs as device bytes (XLA:CPU),
    they are moved to ``host_*`` by the entry layout's memory spaces.

    [Note: TPU temporaries] XLA:TPU's ``temp_size_in_bytes`` is not what its temporaries take in
    HBM, and neither is its ``peak_memory_in_bytes``. What the compiler checks against HBM (its
    out-of-memory error's "total memory required") is the sum of the buffer assignment's
    allocations in the default memory space: arguments, outputs, constants and the temporaries'
    allocation. ``temp_size_in_bytes`` counts that allocation's fragmentation a second time where
    it has much (a ``lax.scan`` of 8 ``[4096, 4096]`` layers under ``jax.checkpoint``: 592.2 MiB
    against the compiler's 432.1, of which 160.1 fragmentation), and can read less where values
    sit on chip; ``peak_memory_in_bytes`` can count on-chip (memory space 1) buffers (a sweep step:
    21.09 MiB, its 9.44 MiB of arguments and about its 11.7 on chip, where it holds 13.27 in HBM).
    docs/benchmarks.md, "What XLA:TPU checks against HBM", has the measurements. So on TPU, given
    the step's ``buffer_assignment`` (a plan's compile writes it), ``temp`` is the default memory
    space's total less the arguments and outputs, and ``temp_size_in_bytes`` is kept as
    ``xla_temp``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jshard.report import Memory
      >>> memory = Memory.from_compiled(jax.jit(lambda x: x * 2).lower(jnp.ones(256)).compile())
      >>> memory.argument, memory.output
      (1024, 1024)
    """

    argument: int
    output: int
    temp: int
    alias: int
    generated_code: int
    host_argument: int
    host_output: int
    host_temp: int
    host_alias: int
    host_generated_code: int
    xla_peak: int
    xla_temp: int

    @property
    def peak(self) -> int:
        return self.argument + self.output + self.temp - self.alias

    @classmethod
    def from_compiled(cls, compiled: Any, buffer_assignment: str = "") -> Memory:
        """Read ``compiled.memory_analysis()`` (missing fields read as 0); on XLA:TPU the temporaries from
        ``buffer_assignment``, the step's ``*buffer-assignment.txt``, where given ([Note: TPU temporaries])."""
        stats = compiled.memory_analysis()
        values = {}
        for name in MEMORY_FIELDS:
            values[name] = int(getattr(stats, f"{name}_size_in_bytes", 0) or 0)
            values[f"host_{name}"] = int(getattr(stats, f"host_{name}_size_in_bytes", 0) or 0)
        host = entry_bytes_by_memory_space(compiled.as_text())["host"]
        for name, part in (("argument", "arguments"), ("output", "outputs")):
            if not values[f"host_{name}"] and host[part]:
                values[name] -= host[part]
                values[f"host_{name}"] = host[part]
        xla_temp = values["temp"]
        if buffer_assignment and _platform(compiled) == "tpu":
            taken = values["argument"] + values["output"] - values["alias"]
            values["temp"] = device_memory_bytes(buffer_assignment) - taken
        return cls(**values, xla_peak=int(getattr(stats, "peak_memory_in_bytes", 0) or 0), xla_temp=xla_temp)


def _platform(compiled: Any) -> str | None:
    """The platform ``compiled`` runs on, read from its arguments' or outputs' devices."""
    for sharding in jax.tree.leaves((compiled.input_shardings, compiled.output_shardings)):
        for device in getattr(sharding, "device_set", ()):
            return device.platform
    return None
