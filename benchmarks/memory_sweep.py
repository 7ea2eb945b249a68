"""Peak memory per device: jshard against the plain GSPMD FSDP recipe, over a sweep of models.

``python -m benchmarks.memory_sweep`` (``--quick`` for two models) compiles one training
step (loss and gradients) of each model on 8 simulated CPU devices, on abstract inputs
(nothing is allocated), and reports ``memory_analysis()``'s peak per device (arguments +
outputs + temporaries - aliased) for:

- ``recipe``: what a JAX user writes by hand: every parameter with a ``NamedSharding``
  over ``fsdp`` on its first dim (the layer dim of a stacked leaf excepted), each layer
  under ``jax.checkpoint`` (in a ``lax.scan`` body when stacked, in a Python loop when
  unrolled), gradients out with the parameters' shardings; GSPMD inserts the collectives.
- ``jshard``: one unit per layer (``js.unshard`` in the loop) or one stacked unit
  (``js.scan``), the rest in the root unit, with the recipe's activation checkpointing
  (``remat_policy=nothing_saveable``): the same recomputation, so the same FLOPs.
- ``jshard_saving``: jshard's default, which keeps activations for backward (FSDP2's
  default; no recomputation), for information.

Models: tanh MLPs (``tanh(h @ w + b)``, widths 256-1024, 4 and 16 layers, batches 64 and
512) and the benchmarks' transformer (``jshard/demo/model.py``), each stacked and
unrolled. Writes ``results/memory_sweep.json``.
"""

from __future__ import annotations

import os

if "JAX_NUM_CPU_DEVICES" not in os.environ and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
    os.environ["JAX_NUM_CPU_DEVICES"] = "8"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402

import jshard as js  # noqa: E402
from jshard.demo import model as T  # noqa: E402
from jshard.report import Memory  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
VARIANTS = ("recipe", "jshard", "jshard_saving")


@dataclasses.dataclass(frozen=True)
class Model:
    """One model of the sweep: ``kind`` ``mlp`` or ``transformer``, stacked or unrolled."""

    kind: str
    stacked: bool
    layers: int
    width: int
    batch: int

    @property
    def name(self) -> str:
        return f"{self.kind} {'stacked' if self.stacked else 'unrolled'} {self.layers}x{self.width} b{self.batch}"


def _sds(*shape: int, dtype: Any = jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


# ----------------------------------------------------------------- models as (params, batch, loss pieces)


def _mlp_params(m: Model) -> dict[str, Any]:
    if m.stacked:
        return {"blocks": {"w": _sds(m.layers, m.width, m.width), "b": _sds(m.layers, m.width)}}
    return {"blocks": [{"w": _sds(m.width, m.width), "b": _sds(m.width)} for _ in range(m.layers)]}


def _mlp_layer(h: jax.Array, layer: Any) -> tuple[jax.Array, None]:
    return jnp.tanh(h @ layer["w"] + layer["b"]), None


def _transformer_config(m: Model) -> T.TransformerConfig:
    return T.TransformerConfig(vocab=128, d_model=m.width, heads=4, layers=m.layers, d_ff=4 * m.width, seq_len=64)


def _transformer_params(m: Model) -> dict[str, Any]:
    params = T.abstract_params(_transformer_config(m))
    if not m.stacked:
        blocks = params["blocks"]
        params = {**params, "blocks": [jax.tree.map(lambda x: _sds(*x.shape[1:], dtype=x.dtype), blocks)
                                       for _ in range(m.layers)]}
    return params


def _batch(m: Model) -> jax.ShapeDtypeStruct:
    if m.kind == "mlp":
        return _sds(m.batch, m.width)
    return _sds(m.batch, 65, dtype=jnp.int32)


def _loss(m: Model, run_blocks: Callable[..., Any], params: Any, batch: jax.Array, remat: str) -> jax.Array:
    """The model's loss with ``run_blocks(body, h, blocks)`` running its layers."""
    if m.kind == "transformer":
        return T.lm_loss(params, batch, _transformer_config(m), run_blocks, remat)

    def body(h, layer):
        return (jax.checkpoint(_mlp_layer) if remat == "checkpoint" else _mlp_layer)(h, layer)

    h, _ = run_blocks(body, batch, params["blocks"])
    return jnp.mean(h**2)


def _loop(body: Callable[..., Any], h: Any, blocks: list[Any], gather: Callable[[Any], Any] = lambda x: x):
    for layer in blocks:
        h, _ = body(h, gather(layer))  # jshard: each unit gathered right before its layer
    return h, None


# ----------------------------------------------------------------- the steps


def _recipe(m: Model, mesh: Any) -> Memory:
    params = _mlp_params(m) if m.kind == "mlp" else _transformer_params(m)

    def spec(path, x):
        layer_dim = 1 if m.stacked and any(getattr(k, "key", None) == "blocks" for k in path) else 0
        return PartitionSpec(*([None] * layer_dim), "fsdp") if x.ndim > layer_dim else PartitionSpec()

    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), jax.tree_util.tree_map_with_path(spec, params),
                             is_leaf=lambda s: isinstance(s, PartitionSpec))
    run = T.lax_scan_blocks if m.stacked else _loop
    step = jax.jit(
        jax.value_and_grad(lambda p, b: _loss(m, run, p, b, "checkpoint")),
        in_shardings=(shardings, NamedSharding(mesh, PartitionSpec("fsdp"))),
        out_shardings=(NamedSharding(mesh, PartitionSpec()), shardings),
    )
    return Memory.from_compiled(step.lower(params, _batch(m)).compile())


def _jshard(m: Model, mesh: Any, saving: bool) -> Memory:
    params = _mlp_params(m) if m.kind == "mlp" else _transformer_params(m)
    if m.stacked:
        blocks = js.fully_shard(params["blocks"], mesh, js.FullyShardPolicy(scan_axis=0))
        run = js.scan
    else:
        blocks = [js.fully_shard(layer, mesh) for layer in params["blocks"]]

        def run(body, h, units):
            return _loop(body, h, units, js.unshard)

    sharded = js.fully_shard({**params, "blocks": blocks}, mesh)
    # js.scan needs a block its policy cannot override (see jshard.demo.model.recompute_in_backward);
    # unrolled, the step's remat_policy does the recomputation (it overrides the jax.checkpoint).
    remat = "custom_vjp" if m.kind == "transformer" and m.stacked and not saving else "checkpoint"

    def loss_fn(p, b):
        return _loss(m, run, js.unshard(p), b, remat)

    policy = None if saving else jax.checkpoint_policies.nothing_saveable
    step = jax.jit(js.value_and_grad(loss_fn, unshard_params=False, remat_policy=policy))
    return Memory.from_compiled(step.lower(sharded, _batch(m)).compile())


def measure(m: Model, mesh: Any) -> dict[str, int]:
    """Peak bytes per device of each variant's step."""
    return {
        "recipe": _recipe(m, mesh).peak,
        "jshard": _jshard(m, mesh, saving=False).peak,
        "jshard_saving": _jshard(m, mesh, saving=True).peak,
    }


def models(quick: bool) -> list[Model]:
    if quick:
        return [Model("mlp", False, 4, 256, 64), Model("mlp", True, 4, 256, 64)]
    mlps = [Model("mlp", s, layers, width, batch)
            for s, layers, width, batch in itertools.product((True, False), (4, 16), (256, 512, 1024), (64, 512))]
    transformers = [Model("transformer", s, layers, width, batch)
                    for s, (layers, width), batch in itertools.product((True, False), ((4, 128), (8, 256)), (16, 64))]
    return mlps + transformers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two small models (a smoke test)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS, help="folder for memory_sweep.json")
    args = parser.parse_args(argv)
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    rows = []
    print("| model | recipe MiB | jshard MiB | jshard / recipe | jshard_saving MiB |")
    print("|---|---|---|---|---|")
    for m in models(args.quick):
        peaks = measure(m, mesh)
        rows.append({**dataclasses.asdict(m), "name": m.name, "peak_bytes": peaks})
        mib = {k: v / 2**20 for k, v in peaks.items()}
        ratio = peaks["jshard"] / peaks["recipe"]
        print(f"| {m.name} | {mib['recipe']:.2f} | {mib['jshard']:.2f} | {ratio:.2f} | {mib['jshard_saving']:.2f} |",
              flush=True)
    worst = max(r["peak_bytes"]["jshard"] / r["peak_bytes"]["recipe"] for r in rows)
    print(f"worst jshard / recipe peak: {worst:.3f} over {len(rows)} models")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory_sweep.json").write_text(json.dumps({"quick": args.quick, "models": rows}, indent=1))


if __name__ == "__main__":
    main()
