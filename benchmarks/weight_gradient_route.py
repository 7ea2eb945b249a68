"""Where a weight's gradient is formed: reduced from every device's full gradient, or computed
from gathered activations.

FSDP gathers a weight for the forward matmul ``y = x @ w`` and, in backward, reduces the full
gradient ``x^T dy`` each device forms from its own rows: a ``[K, N]`` buffer per device, then its
reduce-scatter (on v5p in torus phases, a half-size buffer beside it: [Note: torus phases] in
``jshard/_sharding/torus.py``). With few rows in the global batch, GSPMD's recipe instead forms
this device's ``K / n`` rows of the gradient from the activations of every device: the
``x[:, K_d]`` columns of every device's rows (an all-to-all) and every device's ``dy`` (an
all-gather), so the full gradient never exists. That sends ``M K (n-1)/n + M N (n-1)`` elements
per device (``M`` rows per device) against ``K N (n-1)/n``: fewer where the global batch has fewer
rows than ``K``, and it holds ``n M N`` elements where the weights route holds ``K N``.

This benchmark measures that lever on the sweep's MLP models (``benchmarks.memory_sweep``),
compiled for the sweep's target, with two hand-written ``shard_map`` FSDP training steps that
differ only in the route: both gather each matrix right before its matmul (ordered after the
previous layer), re-gather it in backward (ordered after the incoming cotangent), keep vectors
whole and apply plain SGD, like ``memory_sweep --apply-sgd --replicate-below 4096``; ``weights``
reduce-scatters the gradient in jshard's torus phases, ``activations`` computes it as above, and
``chunks`` forms and reduce-scatters it ``CHUNKS`` blocks of columns at a time, each block's
matmul after the previous block's reduction (the weights route's bytes; no full gradient).
Beside them it prints the best recipe and jshard of the sweep stored for the same target, flags
and step (``benchmarks/results/memory_sweep_<target>[_async]_replicate_below_4096_sgd.json``)::

    python -m benchmarks.weight_gradient_route --target tpu:v5p:2x2x2 [--only "tanh unrolled"]

It measures routes jshard's default does not take (its gradient reduction sees the full gradient,
not the matmul that made it; ``FullyShardPolicy(weight_gradients="from_activations")`` takes the
activations route where it sends less); docs/benchmarks.md, "Weight gradients from gathered
activations" and "Weight gradients reduced a block at a time".
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

import jshard as js
from benchmarks import memory_sweep as S
from jshard._sharding.torus import scatter_phases

AXIS = "fsdp"
ROUTES = ("weights", "activations", "chunks")
CHUNKS = 4  # column blocks of the chunks route


def _ordered(value: Any, after: jax.Array) -> Any:
    """``value`` made to wait for ``after`` (an ``optimization_barrier`` over both)."""
    return jax.lax.optimization_barrier((value, after))[0]


def _linear(route: str, phases: tuple[int, ...], dtype: Any):
    """``x @ gather(w_shard)`` with the weight gradient formed by ``route`` (see the module's doc)."""

    def gather(w_shard):
        return js.collectives.all_gather(w_shard.astype(dtype), (AXIS,), 0)

    @jax.custom_vjp
    def linear(x, w_shard):
        return x @ gather(_ordered(w_shard, x))

    def fwd(x, w_shard):
        return linear(x, w_shard), (x, w_shard)

    def bwd(res, dy):
        x, w_shard = res
        dx = dy @ gather(_ordered(w_shard, dy)).T
        if route == "weights":
            dw = js.collectives.reduce_scatter(x.T @ dy, (AXIS,), 0, phases)
        elif route == "chunks":
            dw = _reduced_in_chunks(x, dy, phases)
        else:
            columns = jax.lax.all_to_all(x, AXIS, split_axis=1, concat_axis=0, tiled=True)  # [n M, K / n]
            dw = columns.T @ jax.lax.all_gather(dy, AXIS, axis=0, tiled=True)  # [K / n, N]
        return dx, dw.astype(w_shard.dtype)

    linear.defvjp(fwd, bwd)
    return linear


def _reduced_in_chunks(x: jax.Array, dy: jax.Array, phases: tuple[int, ...]) -> jax.Array:
    """``x^T dy`` reduce-scattered ``CHUNKS`` blocks of columns at a time, each block's matmul
    ordered after the previous block's reduction: the full gradient never exists at once."""
    width, blocks, done = dy.shape[1], [], None
    for j in range(CHUNKS):
        columns = dy[:, j * width // CHUNKS : (j + 1) * width // CHUNKS]
        columns = columns if done is None else _ordered(columns, done)
        done = js.collectives.reduce_scatter(x.T @ columns, (AXIS,), 0, phases)
        blocks.append(done)
    return jnp.concatenate(blocks, axis=1)


def _layer(m: S.Model, linear):
    def layer(h, p):
        if m.kind == "tanh":
            return jnp.tanh(linear(h, p["w"]) + p["b"].astype(h.dtype)), None
        return h + linear(jax.nn.gelu(linear(h, p["w1"])), p["w2"]), None

    return jax.checkpoint(layer) if m.remat else layer


def step(m: S.Model, mesh: Any, route: str) -> tuple[Any, tuple[Any, ...]]:
    """The hand-written FSDP training step of ``m`` taking ``route``, and its abstract arguments."""
    if m.kind == "transformer":
        raise ValueError(f"{m.name}: only the sweep's MLP models are written by hand here.")
    if route not in ROUTES:
        raise ValueError(f"Unknown route {route!r}; choose one of {ROUTES}.")
    dtype = jnp.bfloat16 if m.bf16 else jnp.float32
    layer = _layer(m, _linear(route, scatter_phases(mesh, (AXIS,)), dtype))
    lead = 1 if m.stacked else 0

    def spec(x):
        return PartitionSpec(*([None] * lead), AXIS) if len(x.shape) > 1 + lead else PartitionSpec()

    params = S._params(m)
    specs = jax.tree.map(spec, params)

    def local(p, batch):
        def loss(p):
            h = batch.astype(dtype)
            if m.stacked:
                h, _ = jax.lax.scan(layer, h, p["blocks"])
            else:
                for block in p["blocks"]:
                    h, _ = layer(h, block)
            return jnp.sum(h.astype(jnp.float32) ** 2) / (m.batch * m.width)

        value, grads = jax.value_and_grad(loss)(p)
        grads = jax.tree.map(lambda g, s: g if s != PartitionSpec() else jax.lax.psum(g, AXIS), grads, specs)
        return jax.lax.psum(value, AXIS), jax.tree.map(lambda x, g: x - S.LEARNING_RATE * g, p, grads)

    body = jax.shard_map(local, mesh=mesh, in_specs=(specs, PartitionSpec(AXIS)), out_specs=(PartitionSpec(), specs),
                         check_vma=False)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    args = (jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), params, shardings),
            jax.ShapeDtypeStruct(S._batch(m).shape, jnp.float32, sharding=NamedSharding(mesh, PartitionSpec(AXIS))))
    return jax.jit(body, donate_argnums=0), args


def measure(m: S.Model, mesh: Any) -> dict[str, Any]:
    """Each route's compiled figures (peak, matmul FLOPs, bytes sent by kind) for ``m``."""
    return {route: S.compiled_figures(*step(m, mesh, route)) for route in ROUTES}


def stored_sweep(target: str, libtpu_flags: str) -> pathlib.Path:
    """The stored ``memory_sweep --apply-sgd --replicate-below 4096`` for this target and flags."""
    flags = "" if libtpu_flags == "none" else f"_{libtpu_flags}"
    return S.RESULTS / f"memory_sweep_{target.replace(':', '_')}{flags}_replicate_below_4096_sgd.json"


def stored_rows(sweep: pathlib.Path) -> dict[str, dict[str, Any]]:
    """The stored sweep's rows by model name (none where it was not stored)."""
    return {r["name"]: r for r in json.loads(sweep.read_text())["models"]} if sweep.exists() else {}


def _stored(row: dict[str, Any] | None) -> dict[str, float]:
    if row is None:
        return {}
    return {"recipe": row["peak_bytes"][S.best_recipe(row)], "jshard": row["peak_bytes"]["jshard"]}


def table(results: list[dict[str, Any]], with_stored: bool) -> str:
    mib = 2.0**20
    head = "| model | " + ("best recipe | jshard | " if with_stored else "") + \
        "weights route | activations route | chunks route | FLOPs activations / weights | " \
        "sent MiB: weights / activations / chunks |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        w, a, c = r["weights"], r["activations"], r["chunks"]
        stored = [f"{r['stored'][k] / mib:.2f}" if k in r["stored"] else "-" for k in ("recipe", "jshard")]
        sent = " / ".join(f"{sum(x['collective_bytes'].values()) / mib:.2f}" for x in (w, a, c))
        lines.append(f"| {r['model']} | " + (" | ".join(stored) + " | " if with_stored else "")
                     + f"{w['peak_bytes'] / mib:.2f} | {a['peak_bytes'] / mib:.2f} | {c['peak_bytes'] / mib:.2f} | "
                     f"{a['flops'] / w['flops']:.2f} | {sent} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="the MLP models whose name contains this text")
    parser.add_argument("--quick", action="store_true", help="one small model (a smoke test)")
    parser.add_argument("--out", default=None, help="write the figures as JSON to this file")
    S.add_compile_arguments(parser)
    args = parser.parse_args(argv)
    target, said = S.compile_target(args)
    mesh = S.target_mesh(target)
    chosen = [S.Model("tanh", False, 4, 256, 64)] if args.quick else \
        [m for m in S.models(False) if m.kind != "transformer" and args.only in m.name]
    sweep = stored_sweep(args.target, args.libtpu_flags)
    stored = stored_rows(sweep)
    results = [{"model": m.name, **measure(m, mesh), "stored": _stored(stored.get(m.name))} for m in chosen]
    print(said)
    print(table(results, sweep.exists()))
    out = {"target": args.target, "models": results}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
