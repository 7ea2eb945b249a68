"""Which compiler a plan runs on: simulated CPU devices, or XLA:TPU without a TPU.

[Note: compile target] ``--target cpu:N`` (the default) plans on N simulated CPU devices
(XLA:CPU). ``--target tpu:<generation>-<size>`` or ``tpu:<generation>:<topology>`` plans on
the devices of a TPU topology that this machine does not have: libtpu (``pip install
'jshard[tpu]'``, which installs ``jax[tpu]`` at the installed jax's version) compiles for
them ahead of time, the way MaxText's ``train_compile`` catches out-of-memory configurations
before a pod is rented. Sizes follow Cloud TPU's names: ``v4-N`` and ``v5p-N`` count
TensorCores (two per chip, so ``v5p-256`` is 128 chips, ``v5p:4x4x8``), ``v5e-N`` and
``v6e-N`` count chips. ``slices > 1`` gives that many slices of the topology (multi-slice
over the data-center network); :func:`jshard.make_mesh` puts ``replicate`` across them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any

# Chips of a slice -> its torus, for the generations whose slices are 3-D (v4, v5p) and 2-D.
_TORUS_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
             512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
_TORUS_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
# generation -> (libtpu's name for it, TensorCores per chip in Cloud TPU's size, torus table)
_GENERATIONS = {"v4": ("v4", 2, _TORUS_3D), "v5p": ("v5p", 2, _TORUS_3D), "v5e": ("v5e", 1, _TORUS_2D),
                "v5litepod": ("v5e", 1, _TORUS_2D), "v6e": ("v6e", 1, _TORUS_2D)}
_SIZED = re.compile(r"^(?P<gen>[a-z0-9]+)-(?P<size>\d+)$")
_SHAPED = re.compile(r"^(?P<gen>[a-z0-9]+):(?P<shape>\d+(x\d+)*)$")
NO_LIBTPU = ("Planning for a TPU target needs libtpu, the TPU compiler: install it with "
             "`python -m pip install 'jshard[tpu]'` (jax[tpu] at the installed jax's version), "
             "or plan on simulated CPU devices with --target cpu:N.")


@dataclasses.dataclass(frozen=True)
class CompileTarget:
    """Where a plan compiles: ``platform`` ``"cpu"`` (N simulated devices) or ``"tpu"``.

    Attributes:
      platform: ``"cpu"`` or ``"tpu"``.
      devices: devices of the whole mesh (chips, over every slice).
      topology: libtpu's topology name of one slice (``"v5p:4x4x8"``); ``None`` on CPU.
      slices: slices of that topology.

    Example:
      >>> from jshard.report import CompileTarget
      >>> CompileTarget.parse("tpu:v5p-256")
      CompileTarget(platform='tpu', devices=128, topology='v5p:4x4x8', slices=1)
      >>> CompileTarget.parse("cpu:64").devices
      64
    """

    platform: str
    devices: int
    topology: str | None = None
    slices: int = 1

    def __post_init__(self):
        if self.platform not in ("cpu", "tpu"):
            raise ValueError(f"A compile target's platform is 'cpu' or 'tpu', got {self.platform!r}.")
        if self.devices < 1 or self.slices < 1 or self.devices % self.slices:
            raise ValueError(f"{self.slices} slice(s) must divide the target's {self.devices} devices.")
        if (self.topology is None) != (self.platform == "cpu"):
            raise ValueError("A TPU target names its topology; a CPU target has none.")

    @classmethod
    def parse(cls, text: str, slices: int = 1) -> CompileTarget:
        """``"cpu:N"``, ``"tpu:v5p-256"``, ``"tpu:v5p:4x4x8"`` (or the same without ``tpu:``)."""
        if text.startswith("cpu:"):
            if slices != 1:
                raise ValueError("Slices are a TPU topology's; plan HSDP on CPU with --replicate.")
            count = text[4:]
            if not count.isdigit() or int(count) < 1:
                raise ValueError(f"A CPU target is cpu:N with N simulated devices, got {text!r}.")
            return cls("cpu", int(count))
        topology = _topology(text.removeprefix("tpu:"))
        return cls("tpu", math.prod(int(d) for d in topology.split(":")[1].split("x")) * slices, topology, slices)

    def describe(self) -> str:
        """``"XLA:TPU v5p:4x4x8 x 2 slices (256 devices)"`` or ``"XLA:CPU, 64 simulated devices"``."""
        if self.platform == "cpu":
            return f"XLA:CPU, {self.devices} simulated devices"
        slices = f" x {self.slices} slices" if self.slices > 1 else ""
        return f"XLA:TPU {self.topology}{slices} ({self.devices} devices, compile only)"

    def resized(self, devices: int) -> CompileTarget:
        """The same TPU generation and slice count with ``devices`` chips in all.

        Example:
          >>> from jshard.report import CompileTarget
          >>> CompileTarget.parse("tpu:v5p-256").resized(16).topology
          'v5p:2x2x4'
        """
        kind = self.topology.split(":")[0]
        torus = next(table for name, _, table in _GENERATIONS.values() if name == kind)
        chips, rest = divmod(devices, self.slices)
        if rest or chips not in torus:
            raise ValueError(f"No {kind} slice has {devices // self.slices if not rest else devices} chips "
                             f"({self.slices} slice(s)); chips per slice known here: {sorted(torus)}.")
        return CompileTarget("tpu", devices, f"{kind}:{torus[chips]}", self.slices)

    def tpu_devices(self) -> list[Any]:
        """The target's TPU devices (compile only: nothing runs on them)."""
        return list(_topology_devices(self.topology, self.slices))

    @property
    def device_kind(self) -> str:
        """JAX's ``device_kind`` of the target's devices (``"cpu"`` for simulated CPU devices), which
        picks the settings a policy leaves to the platform ([Note: platform defaults]).

        Example:
          >>> from jshard.report import CompileTarget
          >>> CompileTarget.parse("cpu:8").device_kind
          'cpu'
        """
        return self.tpu_devices()[0].device_kind if self.platform == "tpu" else "cpu"


def _topology(name: str) -> str:
    sized, shaped = _SIZED.match(name), _SHAPED.match(name)
    match = sized or shaped
    if match is None or match.group("gen") not in _GENERATIONS:
        raise ValueError(f"Unknown TPU target {name!r}: give tpu:<generation>-<size> or tpu:<generation>:<topology> "
                         f"with a generation of {sorted(_GENERATIONS)} (e.g. tpu:v5p-256, tpu:v6e:4x4).")
    libtpu_name, cores, torus = _GENERATIONS[match.group("gen")]
    if shaped:
        return f"{libtpu_name}:{shaped.group('shape')}"
    chips, rest = divmod(int(sized.group("size")), cores)
    if rest or chips not in torus:
        sizes = ", ".join(f"{match.group('gen')}-{c * cores}" for c in torus)
        raise ValueError(f"No {match.group('gen')} slice has {sized.group('size')} "
                         f"{'TensorCores' if cores > 1 else 'chips'}; sizes known here: {sizes}, "
                         f"or name the topology (tpu:{libtpu_name}:AxBxC).")
    return f"{libtpu_name}:{torus[chips]}"


@functools.cache
def _topology_devices(topology: str, slices: int) -> tuple[Any, ...]:
    try:
        import libtpu  # noqa: F401  (only to say what is missing)
        from jax.experimental import topologies
    except ImportError as err:
        raise ValueError(NO_LIBTPU) from err
    kwargs = {"num_slices": slices} if slices > 1 else {}
    if topology.startswith("v4:"):  # one device per chip, as JAX runs a v4 pod (its two cores as one)
        kwargs["chip_config_name"] = "megacore"
    return tuple(topologies.get_topology_desc(topology_name=topology, platform="tpu", **kwargs).devices)

