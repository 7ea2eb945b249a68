"""The settings a :class:`FullyShardPolicy` leaves to the platform, filled in per mesh.

[Note: platform defaults] Two of a unit's settings trade memory for nothing else the step keeps
(bytes on the wire and matmul FLOPs stay at or below FSDP2's) and which way the trade goes depends
on the compiler: ``replicate_below`` (vectors kept whole) and ``weight_gradients`` (how a matrix's
gradient is formed). Left ``None`` (the default), :func:`for_mesh` fills them in from the mesh's
devices when ``fully_shard`` builds the unit, so the unit's policy always holds concrete values:

- TPU v4, v5e, v5p and v6e (``device_kind`` in :data:`TPU_KINDS`): vectors under 4096 elements
  whole and weight gradients ``"from_activations+in_blocks"``. Measured where users train: the
  Llama-3-8B NNX plan (``--mixed-precision --remat full``, 256 TensorCores) peaks at 4099.1 MiB
  per device against FSDP2's layout's 5064.3 on ``v5p-256``, 3587.0 against 7948.2 on
  ``v6e-256``, 4049.2 against 8470.7 on ``v5e-256`` and 4107.4 against 5020.2 on ``v4-256``, and
  the demo's Llama ``small`` (8 chips, reduced in bfloat16) against the hand-written recipe at
  0.98 / 1.06 / 0.79 of its peak on v6e / v5e / v4 where FSDP2's layout reads 1.29 / 1.31 / 0.98.
  On the 48-model training-step sweep (``benchmarks.memory_sweep --apply-sgd``, v5p 2x2x2): 1
  model above the best hand-written recipe instead of FSDP2's layout's 7, geometric mean of the
  peak ratios 0.569 against 0.805, collective bytes 0.26 of the recipes' against 0.93, FLOPs no
  higher in any. The sweep's small models read otherwise on v6e and v4 (32 and 33 rows above the
  recipe against 7 and 14), where XLA:TPU keeps their temporaries on chip and the recipe's read
  none: whole vectors then add 1-2% of arguments to a program of nothing else
  (docs/benchmarks.md, "jshard's defaults per platform").
- Everything else (GPUs and CPUs, not measured against the recipe on their compiler): FSDP2's
  layout, every leaf sharded and its gradient reduced.

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
# ... and on the TPUs measured (see the Note): v4, v5e ("v5 lite"), v5p ("v5") and v6e ("v6 lite").
TPU_LAYOUT = {"replicate_below": 4096, "weight_gradients": "from_activations+in_blocks"}
TPU_KINDS = frozenset({"TPU v4", "TPU v5 lite", "TPU v5", "TPU v5p", "TPU v6 lite"})


def platform_layout(device_kind: str, unit_collectives: bool = False) -> dict[str, int | str]:
    """``replicate_below`` and ``weight_gradients`` for devices of ``device_kind`` (see the Note above).

    Example:
      >>> from jshard._sharding.platform_defaults import platform_layout
      >>> platform_layout("TPU v5")
      {'replicate_below': 4096, 'weight_gradients': 'from_activations+in_blocks'}
      >>> platform_layout("cpu")
      {'replicate_below': 0, 'weight_gradients': 'reduced'}
    """
    layout = dict(TPU_LAYOUT if device_kind in TPU_KINDS else FSDP2_LAYOUT)
    return {**layout, "weight_gradients": "reduced"} if unit_collectives else layout


def unset(settings: Any, layout: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``layout`` that ``settings`` (a policy, a plan's configuration) leaves ``None``.

    Example:
      >>> import jshard as js
      >>> from jshard._sharding.platform_defaults import TPU_LAYOUT, unset
      >>> unset(js.FullyShardPolicy(replicate_below=0), TPU_LAYOUT)
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
