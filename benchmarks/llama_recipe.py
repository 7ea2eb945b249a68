"""The NNX Llama of ``jshard/demo/llama3.py`` trained by jshard and by the GSPMD recipe, compile only.

``python -m benchmarks.llama_recipe --target tpu:v5p:2x2x2 --size small`` compiles one AdamW
training step of the demo's Llama (bf16 compute, every layer recomputed) two ways on the same
mesh and prints each program's peak per device, its matmul FLOPs and what it sends by kind:

- ``jshard``: the demo's own builder (``llama3.build_nnx_model``: the stacked blocks one unit
  under ``nnx.scan``, the root a unit, ``MixedPrecisionPolicy(bf16, reduce float32)``,
  ``remat_policy=nothing_saveable``); ``--reduce-dtype bfloat16`` reduces its gradients in
  bf16, as the recipe's GSPMD program does (it all-reduces the bf16 outputs of its
  weight-gradient matmuls);
- ``recipe``: the same module with plain ``nnx.Param`` leaves, each sharded over the mesh on
  its largest dim the devices divide (a stack's layer dim excepted), the batch sharded, the
  scan body under ``nnx.remat(policy=nothing_saveable)``: what a JAX user writes by hand.

Sizes: ``tiny`` (the tests' shape), ``small`` (dim 1024, 8 layers, 8 heads, 4 KV heads,
vocabulary 32768, 1024 tokens a sequence) and ``1b`` (dim 2048, 16 layers, 2048 tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from benchmarks.memory_sweep import compiled_figures, target_mesh
from jshard._sharding.policies import WEIGHT_GRADIENTS
from jshard.demo import llama3
from jshard.demo.plan import standard_promotion
from jshard.report import CompileTarget, PlanConfig

SIZES = {
    "tiny": llama3.TINY,
    "small": llama3.LlamaConfig(vocab=32768, dim=1024, ffn=4096, layers=8, heads=8, kv_heads=4, seq_len=1024),
    "1b": llama3.LlamaConfig(vocab=32768, dim=2048, ffn=8192, layers=16, heads=16, kv_heads=8, seq_len=2048),
}
REMAT = jax.checkpoint_policies.nothing_saveable


def _fsdp_spec(mesh: Any, path: Any, leaf: Any) -> PartitionSpec:
    """The leaf's largest dim the devices divide, over all of them (a stack's layer dim excepted)."""
    n = mesh.devices.size
    first = 1 if any(getattr(k, "key", None) == "blocks" for k in path) else 0
    dims = [d for d in range(first, leaf.ndim) if leaf.shape[d] % n == 0]
    if not dims:
        return PartitionSpec()
    return PartitionSpec(*([None] * max(dims, key=lambda d: leaf.shape[d])), mesh.axis_names)


def recipe_step(mesh: Any, cfg: llama3.LlamaConfig, batch_per_device: int) -> tuple[Any, tuple[Any, ...]]:
    """The hand-written GSPMD training step of ``cfg`` and its abstract arguments."""
    cfg = dataclasses.replace(cfg, dtype="bfloat16")
    model = nnx.eval_shape(lambda: llama3.Llama(cfg, nnx.Rngs(0)))
    optimizer = nnx.eval_shape(lambda m: nnx.Optimizer(m, optax.adamw(1e-4), wrt=nnx.Param), model)
    graphdef, state = nnx.split((model, optimizer))
    shardings = jax.tree_util.tree_map_with_path(lambda p, x: NamedSharding(mesh, _fsdp_spec(mesh, p, x)), state)
    rows = NamedSharding(mesh, PartitionSpec(mesh.axis_names))

    def loss_fn(model, tokens):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat(policy=REMAT)
        def run(x, block):
            return block(x)

        return llama3.next_token_loss(model.head(model.norm(run(model.embed(tokens[:, :-1]), model.blocks))), tokens)

    def step(state, tokens):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    jitted = jax.jit(standard_promotion(step), in_shardings=(shardings, rows),
                     out_shardings=(shardings, NamedSharding(mesh, PartitionSpec())), donate_argnums=0)
    tokens = jax.ShapeDtypeStruct((batch_per_device * mesh.devices.size, cfg.seq_len + 1), jnp.int32)
    return jitted, (state, tokens)


def jshard_step(mesh: Any, cfg: llama3.LlamaConfig, batch_per_device: int, reduce_dtype: Any = jnp.float32,
                weight_gradients: str = "reduced") -> tuple[Any, tuple[Any, ...]]:
    """The demo's jshard training step of ``cfg`` (gradients reduced in ``reduce_dtype``, formed by
    ``FullyShardPolicy(weight_gradients=...)``) and its abstract arguments."""
    config = PlanConfig(batch_per_device=batch_per_device, remat="full", mixed_precision=True, replicate_below=0,
                        weight_gradients=weight_gradients)  # FSDP2's layout unless a route is named
    step, args, _ = llama3.build_nnx_model(mesh, config, cfg, reduce_dtype=reduce_dtype)
    return step, args


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="cpu:8", help="cpu:8 (default) or a TPU topology, e.g. tpu:v5p:2x2x2")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--batch-per-device", type=int, default=1)
    parser.add_argument("--reduce-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="jshard's gradient reduction dtype (the demo's float32; the recipe's is bfloat16)")
    parser.add_argument("--weight-gradients", choices=WEIGHT_GRADIENTS, default="reduced",
                        help="jshard's FullyShardPolicy(weight_gradients=...): from_activations also looks the "
                             "embedding up on its shard")
    args = parser.parse_args(argv)
    target = CompileTarget.parse(args.target)
    mesh = target_mesh(target)
    cfg = SIZES[args.size]
    print(f"NNX Llama {args.size} (dim {cfg.dim}, {cfg.layers} layers, vocabulary {cfg.vocab}, {cfg.seq_len} tokens), "
          f"batch {args.batch_per_device} per device, jshard reducing in {args.reduce_dtype}, weight gradients "
          f"{args.weight_gradients}, "
          f"compiled by {target.describe()}")
    builds = {"recipe": lambda: recipe_step(mesh, cfg, args.batch_per_device),
              "jshard": lambda: jshard_step(mesh, cfg, args.batch_per_device, jnp.dtype(args.reduce_dtype),
                                                 args.weight_gradients)}
    results = {}
    for name, build in builds.items():
        results[name] = r = compiled_figures(*build())
        sent = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in r["collective_bytes"].items() if v)
        print(f"{name}: peak {r['peak_bytes'] / 2**20:.1f} MiB, matmul {r['flops'] / 1e9:.3f} GFLOP, "
              f"sends MiB: {sent}", flush=True)
    ratio = results["jshard"]["peak_bytes"] / results["recipe"]["peak_bytes"]
    print(f"jshard / recipe: peak {ratio:.2f}, FLOPs {results['jshard']['flops'] / results['recipe']['flops']:.2f}")
    return results


if __name__ == "__main__":
    main()
