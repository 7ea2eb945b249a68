"""Token dispatch in the Mixtral-style MoE: jshard's step with ``all_to_all`` vs a GSPMD program.

``python -m benchmarks.moe_dispatch`` (``--target tpu:v5p:2x2x2`` for the TPU compiler,
``--mixed-precision`` for bf16 compute) compiles one AdamW training step of the same model
(:mod:`jshard.demo.moe`, 8 experts, top-2) two ways on ``(data N / 4, expert 4)`` and prints,
per device what the compiled programs hold (``memory_analysis``), send per step (bytes on
the wire by collective kind, ring model, as ``jshard.report`` counts them) and compute
(``cost_analysis`` FLOPs), side by side with the ratio GSPMD / ``all_to_all``:

- ``all_to_all``: :func:`jshard.demo.moe_train.build_mixtral`: jshard's step (``shard_map``
  manual over both axes), experts FSDP over ``data`` inside their expert group, dense
  weights over every device, slots sent with ``jax.lax.all_to_all`` over ``expert``.
- ``gspmd``: :func:`build_gspmd`: one ``jax.jit`` that GSPMD partitions, the parameters and
  AdamW state stored as jshard stores them (experts ``P("expert", "data")``, the rest split
  over all devices on dim 0), the batch over all devices, and the slots ``(B, E, C, d)``
  constrained to be split over ``expert`` by expert (``MoEConfig(exchange="gspmd")``): no
  explicit ``all_to_all``; GSPMD chooses the collectives, FSDP's gathers included.

Compile only: nothing runs, so a TPU topology this machine does not have works too.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jshard._plan.buffers import compile_reading_assignment
from jshard.demo.moe import Mixtral, MoEConfig, lm_loss
from jshard.demo.moe_train import (
    MIXTRAL_8X7B,
    MIXTRAL_SEQ_LEN,
    as_expert_mesh,
    build_mixtral,
    expert_mesh,
)
from jshard.report import (
    CompileTarget,
    Memory,
    PlanConfig,
    step_collectives,
    wire_bytes_by_kind,
)

SMALL = MoEConfig(vocab=512, dim=128, heads=4, layers=2, experts=8, hidden=256, capacity_factor=1.25,
                  expert_axis="expert")
SEQ_LEN = 128
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def _placed(path: Any, leaf: Any, mesh: Mesh) -> jax.ShapeDtypeStruct:
    spec = P("expert", "data") if "'experts'" in jax.tree_util.keystr(path) else P(mesh.axis_names)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))


def build_gspmd(mesh: Mesh, config: PlanConfig | None = None, cfg: MoEConfig = SMALL,
                seq_len: int = SEQ_LEN) -> tuple[Any, tuple]:
    """The GSPMD program: ``build_mixtral``'s model, placements and batch, no ``shard_map``."""
    config = config or PlanConfig()
    mesh = as_expert_mesh(mesh, cfg.experts)
    cfg = dataclasses.replace(cfg, exchange="gspmd")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Mixtral(cfg, nnx.Rngs(0))))
    params = jax.tree.map_with_path(lambda p, x: _placed(p, x, mesh), state.to_pure_dict())
    tx = optax.adamw(1e-4)
    opt_state = optax.tree_map_params(  # moments placed like their parameters, the count replicated
        tx, lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=p.sharding), jax.eval_shape(tx.init, params),
        params, transform_non_params=lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                                    sharding=NamedSharding(mesh, P())))
    compute = jnp.bfloat16 if config.mixed_precision else jnp.float32

    def loss_fn(params: dict, tokens: jax.Array) -> jax.Array:
        return lm_loss(nnx.merge(graphdef, jax.tree.map(lambda w: w.astype(compute), params)), tokens)

    def step(params: dict, opt_state: Any, tokens: jax.Array) -> tuple[dict, Any, jax.Array]:
        with jax.numpy_dtype_promotion("standard"), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

    shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state))
    tokens = jax.ShapeDtypeStruct((config.batch_per_device * mesh.size, seq_len + 1), jnp.int32,
                                  sharding=NamedSharding(mesh, P(mesh.axis_names)))
    return jax.jit(step, out_shardings=(*shardings, None), donate_argnums=(0, 1)), (params, opt_state, tokens)


def measure(step: Any, args: tuple) -> dict[str, Any]:
    """Per-device figures of one compiled step: memory, collectives by kind, FLOPs."""
    lowered = step.lower(*args)
    compiled, assignment = compile_reading_assignment(lowered)
    collectives = step_collectives(compiled.as_text(), lowered.as_text())
    memory = Memory.from_compiled(compiled, assignment)
    by_kind = wire_bytes_by_kind(collectives)
    counts = {kind: sum(c.executions for c in collectives if c.kind == kind) for kind in KINDS}
    return {"argument": memory.argument, "temp": memory.temp, "peak": memory.peak,
            "flops": float(_cost(compiled).get("flops", 0.0)),
            "collective bytes": sum(by_kind.values()),
            **{f"{kind} bytes": by_kind.get(kind, 0.0) for kind in KINDS},
            **{f"{kind} count": counts[kind] for kind in KINDS}}


def _cost(compiled: Any) -> dict:
    cost = compiled.cost_analysis()
    return cost[0] if isinstance(cost, list) else cost or {}


def compare(mesh: Mesh, config: PlanConfig, cfg: MoEConfig = SMALL, seq_len: int = SEQ_LEN) -> dict[str, dict]:
    """Both programs' :func:`measure` figures, by name."""
    return {"all_to_all": measure(*build_mixtral(mesh, config, cfg, seq_len)),
            "gspmd": measure(*build_gspmd(mesh, config, cfg, seq_len))}


def format_table(figures: dict[str, dict]) -> str:
    """One row per figure: shard_map ``all_to_all``, GSPMD, and GSPMD / all_to_all."""
    a, g = figures["all_to_all"], figures["gspmd"]
    rows = [f"{'per device':<26}{'all_to_all':>16}{'gspmd':>16}{'gspmd / a2a':>13}"]
    for key in a:
        ratio = f"{g[key] / a[key]:.3f}" if a[key] else ("-" if not g[key] else "inf")
        rows.append(f"{key:<26}{a[key]:>16,.0f}{g[key]:>16,.0f}{ratio:>13}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="cpu:8", help="cpu:8 (default) or a TPU topology, e.g. tpu:v5p:2x2x2")
    parser.add_argument("--mixed-precision", action="store_true", help="bf16 compute, fp32 masters and reductions")
    parser.add_argument("--batch-per-device", type=int, default=2)
    parser.add_argument("--mixtral", action="store_true",
                        help="the Mixtral-8x7B plan shape (seq 2048), (data N / 8, expert 8); --target tpu:v5p-256")
    args = parser.parse_args(argv)
    target = CompileTarget.parse(args.target)
    devices = target.tpu_devices() if target.platform == "tpu" else jax.devices()[: target.devices]
    cfg, seq_len, degree = (MIXTRAL_8X7B, MIXTRAL_SEQ_LEN, 8) if args.mixtral else (SMALL, SEQ_LEN, 4)
    mesh = expert_mesh(cfg.experts, devices, expert_degree=degree)
    config = PlanConfig(mixed_precision=args.mixed_precision, batch_per_device=args.batch_per_device)
    print(f"{target.describe()}, mesh {dict(mesh.shape)}, {cfg}, seq {seq_len}, batch {config.batch_per_device}"
          f"/device, {'bf16' if args.mixed_precision else 'fp32'}")
    print(format_table(compare(mesh, config, cfg, seq_len)))


if __name__ == "__main__":
    main()
