"""Peak memory and matmul FLOPs per device: jshard against both GSPMD FSDP recipes, over a sweep of models.

``python -m benchmarks.memory_sweep`` (``--quick`` for two models; ``--target tpu:v5p:2x2x2`` to
compile with XLA:TPU, without a TPU: see ``jshard.report.CompileTarget``) compiles one training
step (loss and gradients, parameters donated) of each model on 8 devices, on abstract inputs
(nothing is allocated), and reports ``memory_analysis()``'s peak per device (arguments +
outputs + temporaries - aliased) and the matmul FLOPs per device (``jshard.report.matmul_flops``,
loop trip counts included) for:

- ``recipe``: what a JAX user writes by hand: every parameter with a ``NamedSharding`` over
  ``fsdp`` on its first dim (the layer dim of a stacked leaf excepted), layers in a ``lax.scan``
  (stacked) or a Python loop (unrolled), gradients out with the parameters' shardings; GSPMD
  inserts the collectives.
- ``constrained``: the same plus ``with_sharding_constraint`` of every layer's input and output
  to batch sharding, which a careful user adds once they see the plain recipe's traffic.
- ``jshard``: one unit per layer (``js.unshard`` in the loop) or one stacked unit (``js.scan``),
  the rest in the root unit.

Like for like: ``remat`` models recompute each layer in backward (recipes ``jax.checkpoint``
around the layer, jshard ``remat_policy=nothing_saveable``), the others keep activations (no
checkpoint; jshard's default). ``bf16`` models compute and gather in bfloat16 from float32
parameters (recipes cast the parameters inside the loss; jshard
``MixedPrecisionPolicy(param_dtype=bfloat16)``, which reduces gradients in bfloat16 too). Models:
tanh MLPs (``tanh(h @ w + b)``), GELU MLP blocks (``h + gelu(h @ w1) @ w2``,
``w1`` 3x wider) and the benchmarks' transformer (``jshard/demo/model.py``). Writes
``results/memory_sweep.json`` (``memory_sweep_<target>.json`` for another target).

From the same compiles it reports, per variant, the step's all-gathers and how many run
asynchronously with a matmul in flight (``jshard/_report/schedule.py``) and the bytes each
device sends per step by collective kind (``collective_bytes``; where GSPMD moves activations
instead of a layer's weights, the recipe's all-to-alls), and for jshard the performance model's
analytic figure beside them (``jshard.report.step_report``'s ``analytic``).

``--libtpu-flags async`` compiles under MaxText's async-collective flags
(:data:`ASYNC_COLLECTIVE_FLAGS`, set as ``LIBTPU_INIT_ARGS`` before libtpu starts: it reads them
once per process) and writes ``memory_sweep_<target>_async.json``. ``--replicate-below N``
compiles jshard's steps with ``FullyShardPolicy(replicate_below=N)`` (leaves under ``N``
elements kept whole on every device) and adds ``_replicate_below_N`` to the file's name;
``--no-backward-prefetch`` compiles them with ``value_and_grad(backward_prefetch=False)``
(``_no_backward_prefetch``); ``--weight-gradients from_activations`` compiles them with
``FullyShardPolicy(weight_gradients="from_activations")`` (``_from_activations``). Without them jshard's
steps take FSDP2's layout, not the platform's defaults ([Note: platform defaults]: on TPU
``--replicate-below 4096 --weight-gradients from_activations+in_blocks``). ``--apply-sgd``
compiles every variant's step as a training step that applies its gradients (plain SGD, the
parameters donated and returned updated; ``_sgd``): there the parameters live until the update,
where the gradient-only step may use their donated buffers as scratch once it has read them.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import pathlib
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import jshard as js
from jshard._plan.buffers import compile_reading_assignment
from jshard._report.report import report_compiled
from jshard._report.schedule import gather_schedule
from jshard._sharding.platform_defaults import FSDP2_LAYOUT
from jshard._sharding.policies import WEIGHT_GRADIENTS
from jshard.demo import model as T
from jshard.report import CompileTarget, Memory, matmul_flops, step_collectives, wire_bytes_by_kind

RESULTS = pathlib.Path(__file__).parent / "results"
VARIANTS = ("recipe", "constrained", "jshard")
# MaxText's flags for asynchronous collectives on TPU (its docs' recommended LIBTPU_INIT_ARGS).
ASYNC_COLLECTIVE_FLAGS = ("--xla_tpu_enable_async_collective_fusion=true "
                          "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true "
                          "--xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true")
LIBTPU_FLAGS = {"none": "", "async": ASYNC_COLLECTIVE_FLAGS}


@dataclasses.dataclass(frozen=True)
class Model:
    """One model of the sweep: ``kind`` ``tanh``, ``gelu`` or ``transformer``, stacked or unrolled."""

    kind: str
    stacked: bool
    layers: int
    width: int
    batch: int
    remat: bool = True
    bf16: bool = False

    @property
    def name(self) -> str:
        return (f"{self.kind} {'stacked' if self.stacked else 'unrolled'} {self.layers}x{self.width} b{self.batch} "
                f"{'remat' if self.remat else 'kept'} {'bf16' if self.bf16 else 'fp32'}")


def _sds(*shape: int, dtype: Any = jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


# ----------------------------------------------------------------- models as (params, batch, loss)


def _layer_params(m: Model) -> dict[str, tuple[int, ...]]:
    if m.kind == "tanh":
        return {"w": (m.width, m.width), "b": (m.width,)}
    return {"w1": (m.width, 3 * m.width), "w2": (3 * m.width, m.width)}


def _mlp_layer(h: jax.Array, layer: Any) -> tuple[jax.Array, None]:
    if "b" in layer:
        return jnp.tanh(h @ layer["w"] + layer["b"]), None
    return h + jax.nn.gelu(h @ layer["w1"]) @ layer["w2"], None


def _transformer_config(m: Model) -> T.TransformerConfig:
    return T.TransformerConfig(vocab=128, d_model=m.width, heads=4, layers=m.layers, d_ff=4 * m.width, seq_len=64)


def _params(m: Model) -> dict[str, Any]:
    if m.kind == "transformer":
        params = T.abstract_params(_transformer_config(m))
        if m.stacked:
            return params
        one = jax.tree.map(lambda x: _sds(*x.shape[1:], dtype=x.dtype), params["blocks"])
        return {**params, "blocks": [one] * m.layers}
    if m.stacked:
        return {"blocks": {k: _sds(m.layers, *s) for k, s in _layer_params(m).items()}}
    return {"blocks": [{k: _sds(*s) for k, s in _layer_params(m).items()} for _ in range(m.layers)]}


def _batch(m: Model) -> jax.ShapeDtypeStruct:
    return _sds(m.batch, 65, dtype=jnp.int32) if m.kind == "transformer" else _sds(m.batch, m.width)


def _loss(m: Model, run_blocks: Callable[..., Any], params: Any, batch: jax.Array, remat: str) -> jax.Array:
    """The model's loss with ``run_blocks(body, h, blocks)`` running its layers."""
    if m.kind == "transformer":
        return T.lm_loss(params, batch, _transformer_config(m), run_blocks, remat)
    body = jax.checkpoint(_mlp_layer) if remat == "checkpoint" else _mlp_layer
    h, _ = run_blocks(body, batch.astype(jnp.bfloat16 if m.bf16 else jnp.float32), params["blocks"])
    return jnp.mean(h.astype(jnp.float32) ** 2)


def _loop(body: Callable[..., Any], h: Any, blocks: list[Any], gather: Callable[[Any], Any] = lambda x: x):
    for layer in blocks:
        h, _ = body(h, gather(layer))  # jshard: each unit gathered right before its layer
    return h, None


# ----------------------------------------------------------------- the steps

LEARNING_RATE = 0.01


def _applying_sgd(value_and_grad: Callable[..., Any]) -> Callable[..., Any]:
    """A step that returns the loss and the parameters updated by plain SGD instead of the gradients."""

    def step(params, batch):
        loss, grads = value_and_grad(params, batch)
        return loss, jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)

    return step


def compiled_figures(step: Callable[..., Any], args: tuple[Any, ...], jshard: bool = False) -> dict[str, Any]:
    """Peak and matmul FLOPs of the compiled step, its all-gathers, what it sends per device per step
    by collective kind and, for jshard's (``jshard``), the analytic figure beside it (all from the one
    compile)."""
    lowered = step.lower(*args)
    lowered_text = lowered.as_text()
    compiled, assignment = compile_reading_assignment(lowered)
    text = compiled.as_text()
    gathers = gather_schedule(text)
    out = {"peak_bytes": Memory.from_compiled(compiled, assignment).peak, "flops": matmul_flops(text),
           "gathers": len(gathers),
           "gathers_overlapped": sum(g.matmuls_overlapped > 0 for g in gathers),
           "collective_bytes": wire_bytes_by_kind(step_collectives(text, lowered_text))}
    if jshard:
        analytic = report_compiled(compiled, lowered_text, args, compiled_text=text).analytic
        out["analytic_bytes"] = {"all-gather": analytic.all_gather, "reduce-scatter": analytic.reduce_scatter,
                                 "all-reduce": analytic.all_reduce}
    return out


def recipe_step(m: Model, mesh: Mesh, constrained: bool, apply_sgd: bool = False) -> tuple[Any, tuple[Any, ...]]:
    """A recipe's step for ``m`` (``constrained``: with the batch-sharding constraints; ``apply_sgd``:
    returning the updated parameters) and its abstract arguments."""
    params = _params(m)

    def spec(path, x):
        layer_dim = 1 if m.stacked and any(getattr(k, "key", None) == "blocks" for k in path) else 0
        return PartitionSpec(*([None] * layer_dim), "fsdp") if x.ndim > layer_dim else PartitionSpec()

    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), jax.tree_util.tree_map_with_path(spec, params),
                             is_leaf=lambda s: isinstance(s, PartitionSpec))
    run = T.lax_scan_blocks if m.stacked else _loop
    if constrained:
        batch_sharded = NamedSharding(mesh, PartitionSpec("fsdp"))
        pin = lambda h: jax.lax.with_sharding_constraint(h, batch_sharded)  # noqa: E731
        plain = run
        run = lambda body, h, blocks: plain(lambda h, layer: (pin(body(pin(h), layer)[0]), None), h, blocks)  # noqa: E731

    def loss(p, b):
        if m.bf16:
            p = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)
        return _loss(m, run, p, b, "checkpoint" if m.remat else "none")

    grad_step = jax.value_and_grad(loss)
    step = jax.jit(_applying_sgd(grad_step) if apply_sgd else grad_step,
                   in_shardings=(shardings, NamedSharding(mesh, PartitionSpec("fsdp"))),
                   out_shardings=(NamedSharding(mesh, PartitionSpec()), shardings), donate_argnums=0)
    return step, (params, _batch(m))


def jshard_step(m: Model, mesh: Mesh, backward_prefetch: bool = True, apply_sgd: bool = False,
                **policy: Any) -> tuple[Any, tuple[Any, ...]]:
    """jshard's step for ``m`` and its abstract arguments; ``policy``: more ``FullyShardPolicy`` fields, FSDP2's
    layout where it names none (``replicate_below=0``, ``weight_gradients="reduced"``, whatever the platform's
    defaults); ``backward_prefetch``: :func:`jshard.value_and_grad`'s; ``apply_sgd``: returning the updated
    parameters."""
    policy = {**FSDP2_LAYOUT, **policy}
    params = _params(m)
    mp = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16) if m.bf16 else \
        js.MixedPrecisionPolicy()
    if m.stacked:
        blocks = js.fully_shard(params["blocks"], mesh, js.FullyShardPolicy(scan_axis=0, mp_policy=mp, **policy))
        run = js.scan
    else:
        layer_policy = js.FullyShardPolicy(mp_policy=mp, **policy)
        blocks = [js.fully_shard(layer, mesh, layer_policy) for layer in params["blocks"]]

        def run(body, h, units):
            return _loop(body, h, units, js.unshard)

    sharded = js.fully_shard({**params, "blocks": blocks}, mesh, js.FullyShardPolicy(mp_policy=mp, **policy))

    def loss_fn(p, b):
        return _loss(m, run, js.unshard(p), b, "none")

    remat = jax.checkpoint_policies.nothing_saveable if m.remat else None
    grad_step = js.value_and_grad(loss_fn, unshard_params=False, remat_policy=remat,
                                  backward_prefetch=backward_prefetch)
    step = jax.jit(_applying_sgd(grad_step) if apply_sgd else grad_step, donate_argnums=0)
    return step, (sharded, _batch(m))


def variant_step(m: Model, mesh: Mesh, variant: str, apply_sgd: bool = False,
                 **jshard_options: Any) -> tuple[Any, tuple[Any, ...]]:
    """The step of one of :data:`VARIANTS` for ``m`` and its abstract arguments (``apply_sgd``: a
    training step returning the updated parameters; ``jshard_options``: :func:`jshard_step`'s keyword
    arguments, for jshard's)."""
    if variant == "jshard":
        return jshard_step(m, mesh, apply_sgd=apply_sgd, **jshard_options)
    if variant in ("recipe", "constrained"):
        return recipe_step(m, mesh, constrained=variant == "constrained", apply_sgd=apply_sgd)
    raise ValueError(f"Unknown variant {variant!r}; choose one of {VARIANTS}.")


def measure(m: Model, mesh: Mesh, variants: tuple[str, ...] = VARIANTS, **jshard_options: Any) -> dict[str, Any]:
    """Per variant's step (``variants``: which to compile): peak bytes and matmul FLOPs per device, its
    all-gathers (``gathers``) and how many of them are asynchronous with a matmul in flight
    (``gathers_overlapped``), what it sends per device per step by collective kind
    (``collective_bytes``: a recipe's all-to-alls are GSPMD moving activations instead of weights),
    and jshard's ``analytic_bytes`` (the performance model's). ``jshard_options``:
    :func:`variant_step`'s keyword arguments (``apply_sgd``, and :func:`jshard_step`'s)."""
    results = {v: compiled_figures(*variant_step(m, mesh, v, **jshard_options), jshard=v == "jshard") for v in variants}
    fields = ("peak_bytes", "flops", "gathers", "gathers_overlapped", "collective_bytes")
    out: dict[str, Any] = {key: {v: r[key] for v, r in results.items()} for key in fields}
    if "jshard" in results:
        out["analytic_bytes"] = results["jshard"]["analytic_bytes"]
    return out


def models(quick: bool) -> list[Model]:
    if quick:
        return [Model("tanh", False, 4, 256, 64), Model("gelu", True, 4, 256, 64, remat=False, bf16=True)]
    mlps = [Model(kind, stacked, layers, width, batch, remat, bf16)
            for kind, stacked, (layers, width, batch), remat, bf16 in itertools.product(
                ("tanh", "gelu"), (True, False), ((4, 512, 64), (8, 1536, 512)), (True, False), (False, True))]
    transformers = [Model("transformer", stacked, layers, width, batch, remat)
                    for stacked, (layers, width), batch, remat in itertools.product(
                        (True, False), ((4, 128), (8, 256)), (16, 64), (True, False))]
    return mlps + transformers


def target_mesh(target: CompileTarget) -> Mesh:
    """A 1-D ``fsdp`` mesh (Auto axes, as the recipes want) over the target's devices, in the
    order :func:`jshard.make_mesh` gives them: row-major over a TPU torus (which a topology's own
    device list is not from 4x4x4 up, nor ``jax.make_mesh``'s on a v5p 2x2x2 from jax 0.11 on:
    [Note: torus phases]); on jax 0.10 the order ``jax.make_mesh`` gives, which the stored sweeps used."""
    devices = target.tpu_devices() if target.platform == "tpu" else jax.devices()[: target.devices]
    return Mesh(js.make_mesh(devices=devices).devices, ("fsdp",), axis_types=(AxisType.Auto,))


def add_compile_arguments(parser: argparse.ArgumentParser) -> None:
    """``--target`` and ``--libtpu-flags``, as the sweep's benchmarks take them."""
    parser.add_argument("--target", default="cpu:8", help="cpu:8 (default) or a TPU topology, e.g. tpu:v5p:2x2x2")
    parser.add_argument("--libtpu-flags", choices=sorted(LIBTPU_FLAGS), default="none",
                        help="async: compile under MaxText's async-collective flags (LIBTPU_INIT_ARGS)")


def compile_target(args: argparse.Namespace) -> tuple[CompileTarget, str]:
    """The parsed ``--target``, with ``--libtpu-flags`` set as ``LIBTPU_INIT_ARGS`` first (before the
    topology starts libtpu, which reads them once), and the line saying what compiles."""
    if args.libtpu_flags != "none":
        flags = f"{os.environ.get('LIBTPU_INIT_ARGS', '')} {LIBTPU_FLAGS[args.libtpu_flags]}"
        os.environ["LIBTPU_INIT_ARGS"] = flags.strip()
    target = CompileTarget.parse(args.target)
    said = f"compiled by {target.describe()}" + (f" with LIBTPU_INIT_ARGS={os.environ['LIBTPU_INIT_ARGS']}"
                                                 if args.libtpu_flags != "none" else "")
    return target, said


def summary(rows: list[dict[str, Any]]) -> str:
    """The sweep's last line: the worst ratio of jshard's peak to the best recipe's, how many models
    are above it (at two decimals), and in how many of those the best recipe moves activations
    (sends all-to-alls: GSPMD computing a weight's gradient from gathered activations).

    Example:
      >>> row = {"peak_bytes": {"recipe": 2.0, "constrained": 4.0, "jshard": 3.0},
      ...        "collective_bytes": {"recipe": {"all-to-all": 1.0}, "constrained": {"all-to-all": 0.0}}}
      >>> summary([row])
      'worst jshard / best recipe peak: 1.500 over 1 models; above it: 1, where the best recipe moves activations: 1'
    """
    above = [r for r in rows if above_recipe(r)]
    routed = sum(r["collective_bytes"][best_recipe(r)].get("all-to-all", 0.0) > 0 for r in above)
    return (f"worst jshard / best recipe peak: {max(map(_peak_ratio, rows)):.3f} over {len(rows)} models; "
            f"above it: {len(above)}, where the best recipe moves activations: {routed}")


def options_suffix(replicate_below: int, weight_gradients: str, backward_prefetch: bool, apply_sgd: bool) -> str:
    """The part of a stored sweep's name that says jshard's options and the step (after target and flags).

    Example:
      >>> options_suffix(4096, "from_activations", True, True)
      '_replicate_below_4096_from_activations_sgd'
    """
    return ((f"_replicate_below_{replicate_below}" if replicate_below else "")
            + ("" if weight_gradients == "reduced" else f"_{weight_gradients}")
            + ("" if backward_prefetch else "_no_backward_prefetch") + ("_sgd" if apply_sgd else ""))


def above_recipe(result: dict[str, Any]) -> bool:
    """Whether jshard's peak is above the best recipe's (:func:`exceeds`)."""
    return exceeds(result["peak_bytes"]["jshard"], result["peak_bytes"][best_recipe(result)])


def exceeds(jshard: int, recipe: int) -> bool:
    """Whether a jshard peak is above a recipe's, to two decimals of their ratio (the tables' rule).

    Example:
      >>> exceeds(1004, 1000), exceeds(1006, 1000)
      (False, True)
    """
    return round(jshard / recipe, 2) > 1


def best_recipe(result: dict[str, Any]) -> str:
    """The recipe variant with the lower peak."""
    return min(("recipe", "constrained"), key=lambda v: result["peak_bytes"][v])


def _peak_ratio(result: dict[str, Any]) -> float:
    """jshard's peak over the best recipe's."""
    return result["peak_bytes"]["jshard"] / result["peak_bytes"][best_recipe(result)]


def _sent(by_kind: dict[str, float]) -> str:
    return " / ".join(f"{by_kind.get(k, 0.0) / 2**20:.2f}" for k in ("all-gather", "reduce-scatter", "all-reduce"))


def _all_to_all(result: dict[str, Any], variant: str) -> str:
    return f"{result['collective_bytes'][variant].get('all-to-all', 0.0) / 2**20:.2f}"


def _overlapped(result: dict[str, Any], variant: str) -> str:
    return f"{result['gathers_overlapped'][variant]} / {result['gathers'][variant]}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two small models (a smoke test)")
    parser.add_argument("--only", default="", help="run the models whose name matches this regular expression")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS, help="folder for memory_sweep.json")
    parser.add_argument("--replicate-below", type=int, default=0,
                        help="jshard's FullyShardPolicy(replicate_below=N): leaves under N elements kept whole")
    parser.add_argument("--weight-gradients", default="reduced", choices=WEIGHT_GRADIENTS,
                        help="jshard's FullyShardPolicy(weight_gradients=...)")
    parser.add_argument("--no-backward-prefetch", action="store_true",
                        help="jshard's value_and_grad(backward_prefetch=False)")
    parser.add_argument("--apply-sgd", action="store_true",
                        help="compile training steps that apply the gradients (plain SGD) instead of returning them")
    parser.add_argument("--merge", action="store_true",
                        help="keep the stored rows of the models not run (with --only: a sweep in parts)")
    add_compile_arguments(parser)
    args = parser.parse_args(argv)
    target, said = compile_target(args)
    mesh = target_mesh(target)
    rows = []
    print(said)
    print("| model | recipe MiB | constrained MiB | jshard MiB | peak / best recipe | FLOPs / recipe | "
          "jshard sends MiB (AG / RS / AR) | analytic | recipes' all-to-all MiB | "
          "gathers overlapped: jshard (recipes) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m in [m for m in models(args.quick) if re.search(args.only, m.name)]:
        result = measure(m, mesh, replicate_below=args.replicate_below, weight_gradients=args.weight_gradients,
                         backward_prefetch=not args.no_backward_prefetch, apply_sgd=args.apply_sgd)
        rows.append({**dataclasses.asdict(m), "name": m.name, **result})
        mib = {k: v / 2**20 for k, v in result["peak_bytes"].items()}
        flops_ratio = result["flops"]["jshard"] / max(result["flops"]["recipe"], 1.0)
        print(f"| {m.name} | {mib['recipe']:.2f} | {mib['constrained']:.2f} | {mib['jshard']:.2f} | "
              f"{_peak_ratio(result):.2f} | {flops_ratio:.2f} | {_sent(result['collective_bytes']['jshard'])} | "
              f"{_sent(result['analytic_bytes'])} | {_all_to_all(result, 'recipe')} / "
              f"{_all_to_all(result, 'constrained')} | {_overlapped(result, 'jshard')} "
              f"({_overlapped(result, 'recipe')}, {_overlapped(result, 'constrained')}) |", flush=True)
    print(summary(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    name = "memory_sweep" if args.target == "cpu:8" else f"memory_sweep_{args.target.replace(':', '_')}"
    name += "" if args.libtpu_flags == "none" else f"_{args.libtpu_flags}"
    name += options_suffix(args.replicate_below, args.weight_gradients, not args.no_backward_prefetch, args.apply_sgd)
    path = args.out / f"{name}.json"
    if args.merge and path.exists():
        run = {r["name"] for r in rows}
        order = [m.name for m in models(args.quick)]
        kept = [r for r in json.loads(path.read_text())["models"] if r["name"] not in run]
        rows = sorted(kept + rows, key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))
    result = {"quick": args.quick, "target": args.target, "models": rows}
    if args.replicate_below:
        result["replicate_below"] = args.replicate_below
    if args.weight_gradients != "reduced":
        result["weight_gradients"] = args.weight_gradients
    if args.no_backward_prefetch:
        result["backward_prefetch"] = False
    if args.apply_sgd:
        result["apply_sgd"] = True
    if args.libtpu_flags != "none":
        result["libtpu_init_args"] = os.environ["LIBTPU_INIT_ARGS"]
    path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
