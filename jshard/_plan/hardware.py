"""Accelerator profiles from public specifications, for the planner's step-time estimate.

Figures per chip, dense (no sparsity), from the vendors' pages (docs/planning.md cites
them): peak bf16 matmul FLOP/s, HBM capacity and bandwidth, the inter-chip link
bandwidth a collective can use in one direction, and host-to-device bandwidth (for
offload). The link figure is the published per-chip total halved: NVLink 4 is 900 GB/s
bidirectional per H100/H200 (450 GB/s each way); a TPU's ICI figure is its published
per-chip bandwidth, halved the same way. fp32 matmuls: GPUs run them as TF32 at half the
bf16 rate; TPUs' default precision runs them as one bf16 pass (XLA's
``Precision.DEFAULT``), at the bf16 rate.
"""

from __future__ import annotations

import dataclasses
import re

GB = 1e9
TERA = 1e12


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """One accelerator chip's figures (bytes and bytes/s, FLOP/s).

    Example:
      >>> from jshard.report import HARDWARE
      >>> h100 = HARDWARE["h100"]
      >>> h100.bf16_flops / 1e12, h100.hbm_bytes / 1e9
      (989.0, 80.0)
    """

    name: str
    bf16_flops: float
    fp32_flops: float
    hbm_bytes: float
    hbm_bandwidth: float
    link_bandwidth: float
    host_bandwidth: float
    source: str

    def __post_init__(self):
        for field in ("bf16_flops", "fp32_flops", "hbm_bytes", "hbm_bandwidth", "link_bandwidth", "host_bandwidth"):
            value = getattr(self, field)
            if not value > 0:
                raise ValueError(f"HardwareProfile {self.name!r}: {field} must be positive, got {value}.")


HARDWARE = {
    "h100": HardwareProfile("NVIDIA H100 SXM", 989 * TERA, 494.5 * TERA, 80 * GB, 3350 * GB, 450 * GB, 64 * GB,
                            "https://www.nvidia.com/en-us/data-center/h100/"),
    "h200": HardwareProfile("NVIDIA H200 SXM", 989 * TERA, 494.5 * TERA, 141 * GB, 4800 * GB, 450 * GB, 64 * GB,
                            "https://www.nvidia.com/en-us/data-center/h200/"),
    "v5p": HardwareProfile("Google TPU v5p", 459 * TERA, 459 * TERA, 95 * GB, 2765 * GB, 300 * GB, 32 * GB,
                           "https://cloud.google.com/tpu/docs/v5p"),
    "v6e": HardwareProfile("Google TPU v6e (Trillium)", 918 * TERA, 918 * TERA, 32 * GB, 1640 * GB, 224 * GB,
                           32 * GB, "https://cloud.google.com/tpu/docs/v6e"),
}

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> float:
    """``"80GiB"`` -> bytes (``GB`` decimal, ``GiB`` binary).

    Example:
      >>> from jshard.report import parse_bytes
      >>> parse_bytes("80GiB") == 80 * 2**30, parse_bytes("1.5 GB")
      (True, 1500000000.0)
    """
    match = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"Cannot read a memory size from {text!r}: write e.g. 80GiB, 95GB or 34359738368.")
    return float(match.group(1)) * _UNITS[match.group(2).lower()]


def profile(name: str) -> HardwareProfile:
    """The profile named ``name`` (``h100``, ``h200``, ``v5p``, ``v6e``), or a clear error."""
    if name not in HARDWARE:
        raise ValueError(f"Unknown hardware {name!r}; choose one of {sorted(HARDWARE)}.")
    return HARDWARE[name]


def hardware_of_device(device_kind: str) -> HardwareProfile | None:
    """The profile of a ``jax.Device.device_kind`` (``"NVIDIA H200"``, ``"TPU v5p"``), if known.

    Example:
      >>> from jshard.report import hardware_of_device
      >>> hardware_of_device("NVIDIA H200").name, hardware_of_device("cpu")
      ('NVIDIA H200 SXM', None)
    """
    kind = device_kind.lower().replace(" ", "")
    for key in ("h200", "h100", "v5p", "v6e"):
        if key in kind or (key == "v6e" and "v6lite" in kind):
            return HARDWARE[key]
    return None
