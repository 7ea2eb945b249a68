"""Per-device bytes of a compiled program, from ``compiled.memory_analysis()``."""

from __future__ import annotations

import dataclasses
from typing import Any

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

    @property
    def peak(self) -> int:
        return self.argument + self.output + self.temp - self.alias

    @classmethod
    def from_compiled(cls, compiled: Any) -> Memory:
        """Read ``compiled.memory_analysis()`` (missing fields read as 0)."""
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
        return cls(**values, xla_peak=int(getattr(stats, "peak_memory_in_bytes", 0) or 0))
