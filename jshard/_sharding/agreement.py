"""Every process shards the same unit: what must agree, checked at each ``fully_shard``.

See [Note: agreement across processes] in ``jshard/_multiprocess/agreement.py``.
"""

from __future__ import annotations

import dataclasses

import jax

from jshard._multiprocess.agreement import Description, same_on_all_processes
from jshard._sharding.layout import LeafLayout
from jshard._sharding.unit import UnitMeta


def _describe_value(value: object) -> str:
    if callable(value) and not isinstance(value, type):
        func = getattr(value, "func", value)  # functools.partial
        return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', type(func).__name__)}"
    return repr(value)


def _describe_policy(policy: object) -> dict[str, str]:
    out = {}
    for field in dataclasses.fields(policy):
        value = getattr(policy, field.name)
        if dataclasses.is_dataclass(value):
            out.update({f"{field.name}.{k}": v for k, v in _describe_policy(value).items()})
        else:
            out[field.name] = _describe_value(value)
    return out


def _describe_layout(layout: LeafLayout | None) -> str:
    if layout is None:
        return "a sub-unit"
    text = f"shape {layout.shape} {layout.dtype}"
    if layout.ignored:
        return text + ", ignored"
    return text + ("" if layout.dim is None else f", sharded on dim {layout.dim} padded to {layout.padded}")


def describe_unit(paths: list[tuple], meta: UnitMeta) -> Description:
    """What must agree across processes for one ``fully_shard`` call: mesh, policy, leaves."""
    mesh = meta.mesh
    return {
        "mesh": {
            "shape": str(dict(mesh.shape)),
            "device ids": str(mesh.device_ids.tolist()),
            "axis types": str(tuple(str(t) for t in mesh.axis_types)),
        },
        "policy field": _describe_policy(meta.policy),
        "leaf": {jax.tree_util.keystr(p): _describe_layout(lay) for p, lay in zip(paths, meta.layouts, strict=True)},
    }


UNIT_FIX = (
    "Every process must build the same model and policy (same code, config and arguments, e.g. the "
    "same model size and dtypes on every host): fix the configuration of the process that differs."
)


def check_unit(paths: list[tuple], meta: UnitMeta) -> None:
    """Raise on every process unless all processes shard the same unit here (see the Note)."""
    if jax.process_count() > 1:
        same_on_all_processes("fully_shard", describe_unit(paths, meta), UNIT_FIX)
