"""The settings a :class:`FullyShardPolicy` leaves to the platform, filled in per mesh.

[Note: platform defaults] Two of a unit's settings trade memory for nothing else the step keeps
(bytes on the wire and matmul FLOPs stay at or below FSDP2's) and which way the trade goes depends
on the compiler: ``replicate_below`` (vectors kept whole) and ``weight_gradients`` (how a matrix's
gradient is formed). Left ``None`` (the default), :func:`for_mesh` fills them in from the mesh's
devices when ``fully_shard`` builds the unit, so the unit's policy always holds concrete values:

- TPU v5p (``device_kind`` ``"TPU v5"``/``"TPU v5p"``): vectors under 4096 elements whole and
  weight gradients ``"from_activations+in_blocks"``. Measured on the 48-model training-step sweep
  (``benchmarks.memory_sweep --apply-sgd``, v5p 2x2x2, libtpu 0.0.42.1): 1 model above the best
  hand-written recipe instead of FSDP2's layout's 7, geometric mean of the peak ratios 0.571
  against 0.805, collective bytes 0.26 of the recipes' against 0.93, FLOPs no higher in any; the
  Llama-3-8B plans on ``v5p-256`` 4099.1 MiB per device against 5064.3 (NNX) and 5278.9 against
  8179.0 (Hugging Face) (docs/benchmarks.md, "jshard's defaults per platform").
- Everything else: FSDP2's layout, every leaf sharded and its gradient reduced. On v6e 2x4 the
  options raise the sweep (7 rows above the recipe with FSDP2's layout; 28 with vectors whole, 12
  with weight gradients from activations, 32 with v5p's layout). On v4 2x2x2 too, though its torus
  is 3-D like v5p's (14 with FSDP2's layout, 33 with v5p's): there, as on v6e, most of the small
  models' temporaries sit on chip, and whole vectors add their bytes to the arguments. GPUs were
  not measured.

A unit that asks for ``unit_collectives`` keeps the reduction (a route cannot share its flat
buffer). Set either field to override the platform's choice.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from jshard._sharding.policies import FullyShardPolicy

# The two settings where the platform has no measured better choice: FSDP2's (also what tests and
# benchmarks of FSDP2's reductions and gathers name explicitly).
FSDP2_LAYOUT = {"replicate_below": 0, "weight_gradients": "reduced"}
# ... and on TPU v5p (see the Note).
V5P_LAYOUT = {"replicate_below": 4096, "weight_gradients": "from_activations+in_blocks"}
V5P_KINDS = frozenset({"TPU v5", "TPU v5p"})


def platform_layout(device_kind: str, unit_collectives: bool = False) -> dict[str, int | str]:
    """``replicate_below`` and ``weight_gradients`` for devices of ``device_kind`` (see the Note above).

    Example:
      >>> from jshard._sharding.platform_defaults import platform_layout
      >>> platform_layout("TPU v5")
      {'replicate_below': 4096, 'weight_gradients': 'from_activations+in_blocks'}
      >>> platform_layout("cpu")
      {'replicate_below': 0, 'weight_gradients': 'reduced'}
    """
    layout = dict(V5P_LAYOUT if device_kind in V5P_KINDS else FSDP2_LAYOUT)
    return {**layout, "weight_gradients": "reduced"} if unit_collectives else layout


def unset(settings: Any, layout: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``layout`` that ``settings`` (a policy, a plan's configuration) leaves ``None``.

    Example:
      >>> import jshard as js
      >>> from jshard._sharding.platform_defaults import V5P_LAYOUT, unset
      >>> unset(js.FullyShardPolicy(replicate_below=0), V5P_LAYOUT)
      {'weight_gradients': 'from_activations+in_blocks'}
    """
    return {name: value for name, value in layout.items() if getattr(settings, name) is None}


def for_mesh(policy: FullyShardPolicy, mesh: Mesh) -> FullyShardPolicy:
    """``policy`` with its ``None`` ``replicate_below`` and ``weight_gradients`` set for ``mesh``'s devices.

    Example:
      >>> import jshard as js
      >>> from jshard._sharding.platform_defaults import for_mesh
      >>> policy = for_mesh(js.FullyShardPolicy(), js.make_mesh())  # CPU devices: FSDP2's layout
      >>> policy.replicate_below, policy.weight_gradients
      (0, 'reduced')
      >>> for_mesh(js.FullyShardPolicy(weight_gradients="in_blocks"), js.make_mesh()).weight_gradients
      'in_blocks'
    """
    chosen = unset(policy, platform_layout(mesh.devices.flat[0].device_kind, policy.unit_collectives))
    return dataclasses.replace(policy, **chosen) if chosen else policy
