"""Every public Optax transformation under ``js.shard_optimizer``: error and state bytes per device.

``python -m benchmarks.optax_transformations`` (about 8 minutes here) trains the parameters
``SHAPES`` for ``STEPS`` steps with each transformation, unsharded on one device and
sharded on 8 devices (a 1-D mesh and an HSDP mesh of 2 x 4), and prints per transformation
the largest relative difference of the parameters, the state bytes per device against the
unsharded state's, and the state leaves that stay replicated. ``discovered()`` lists the
functions of ``optax`` and ``optax.contrib`` whose return annotation is a gradient
transformation, so one added by a later Optax release shows up by itself; ``build(name)``
makes it (a learning rate where one is required), ``UNSUPPORTED`` says which cannot run on
sharded parameters and why. ``tests/test_optax_transformations.py`` runs the same cases.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import pathlib
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib

import jshard as js
from jshard._state.stored_leaves import stored_leaves

SHAPES = {"w": (15, 13), "v": (7,), "b": (1,)}
MASK = {"w": True, "v": True, "b": False}
MATRICES = {"w": True, "v": False, "b": False}
LABELS = {"w": "mat", "v": "vec", "b": "vec"}
STEPS = 5


def init_params() -> dict:
    rng = np.random.default_rng(0)
    return {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in SHAPES.items()}


TARGET = {k: v * 0.5 + 0.25 for k, v in init_params().items()}


def loss(params: dict) -> jax.Array:
    """A quadratic loss on the plain tree (what ``value_fn`` and ``measure`` receive)."""
    return sum(jnp.sum((params[k] - TARGET[k]) ** 2) * (i + 1) for i, k in enumerate(sorted(params)))


def _inner() -> optax.GradientTransformation:
    return optax.sgd(1e-2, momentum=0.9)


UNSUPPORTED = {
    "optax.contrib.differentially_private_aggregate": "needs per-example gradients (a batch dim on every "
    "gradient leaf); jshard's step returns the gradient of the batch mean",
    "optax.contrib.dpsgd": "differentially_private_aggregate inside (per-example gradients)",
    "optax.with_extra_args_support": "not a transformation of its own: wraps one (shard_optimizer applies it)",
    "optax.measure_with_ema": "its updates are a measurement of the updates (a scalar), not updates of the "
    "parameters; shard_optimizer refuses it with an error saying so",
}

FACTORIES: dict[str, Callable[[], optax.GradientTransformation]] = {
    "optax.adaptive_grad_clip": lambda: optax.adaptive_grad_clip(0.5),
    "optax.add_noise": lambda: optax.add_noise(0.1, 0.5, 0),
    "optax.apply_if_finite": lambda: optax.apply_if_finite(_inner(), 3),
    "optax.chain": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
    "optax.clip": lambda: optax.clip(0.1),
    "optax.clip_by_block_rms": lambda: optax.clip_by_block_rms(0.1),
    "optax.clip_by_global_norm": lambda: optax.clip_by_global_norm(0.5),
    "optax.conditionally_mask": lambda: optax.conditionally_mask(_inner(), lambda step: step % 2 == 0),
    "optax.conditionally_transform": lambda: optax.conditionally_transform(_inner(), lambda step: step % 2 == 0),
    "optax.ema": lambda: optax.ema(0.9),
    "optax.flatten": lambda: optax.flatten(optax.adam(1e-2)),
    "optax.freeze": lambda: optax.chain(optax.freeze(MASK), optax.sgd(1e-2)),
    "optax.inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2),
    "optax.inject_stateful_hyperparams": lambda: optax.inject_stateful_hyperparams(optax.adamw)(
        learning_rate=optax.linear_schedule(1e-2, 1e-3, 4)),
    "optax.lookahead": lambda: optax.lookahead(optax.adam(1e-2), 2, 0.5),
    "optax.masked": lambda: optax.masked(optax.adamw(1e-2), MASK),
    "optax.multi_transform": lambda: optax.multi_transform({"mat": optax.adam(1e-2), "vec": optax.sgd(1e-2)}, LABELS),
    "optax.named_chain": lambda: optax.named_chain(("clip", optax.clip(1.0)), ("adam", optax.adam(1e-2))),
    "optax.partition": lambda: optax.partition({"mat": optax.adam(1e-2), "vec": optax.sgd(1e-2)}, LABELS),
    "optax.scale": lambda: optax.scale(-1e-2),
    "optax.scale_by_backtracking_linesearch": lambda: optax.chain(
        optax.sgd(1e-2), optax.scale_by_backtracking_linesearch(max_backtracking_steps=5)),
    "optax.scale_by_schedule": lambda: optax.scale_by_schedule(optax.linear_schedule(-1e-2, -1e-3, 4)),
    "optax.scale_by_zoom_linesearch": lambda: optax.chain(
        optax.sgd(1e-2), optax.scale_by_zoom_linesearch(max_linesearch_steps=5)),
    "optax.selective_transform": lambda: optax.selective_transform(_inner(), freeze_mask=MASK),
    "optax.snapshot": lambda: optax.chain(optax.snapshot("norm", lambda u: optax.tree.norm(u)), optax.sgd(1e-2)),
    "optax.stateless": lambda: optax.stateless(lambda u, p: jax.tree.map(lambda g: -1e-2 * g, u)),
    "optax.stateless_with_tree_map": lambda: optax.stateless_with_tree_map(lambda g, p: -1e-2 * g),
    "optax.trace": lambda: optax.trace(0.9),
    "optax.contrib.mechanize": lambda: optax.contrib.mechanize(optax.sgd(1e-2)),
    "optax.contrib.scale_by_muon": lambda: optax.masked(optax.contrib.scale_by_muon(
        weight_dimension_numbers=lambda u: jax.tree.map(lambda _: optax.contrib.MuonDimensionNumbers(), u)), MATRICES),
    "optax.contrib.sam": lambda: optax.contrib.sam(optax.sgd(1e-2), optax.sgd(1e-2)),
    "optax.contrib.schedule_free": lambda: optax.contrib.schedule_free(optax.sgd(1e-2), 1e-2),
    "optax.contrib.split_real_and_imaginary": lambda: optax.contrib.split_real_and_imaginary(_inner()),
}

# Transformations whose update takes the loss (and its function) as extra arguments.
NEEDS_VALUE = {"optax.polyak_sgd", "optax.scale_by_polyak", "optax.lbfgs", "optax.scale_by_zoom_linesearch",
               "optax.scale_by_backtracking_linesearch", "optax.contrib.reduce_on_plateau", "optax.contrib.momo",
               "optax.contrib.momo_adam", "optax.contrib.sophia"}


def discovered() -> list[str]:
    """Public functions of ``optax`` and ``optax.contrib`` annotated to return a transformation."""
    names = []
    for module in (optax, optax.contrib):
        for name in dir(module):
            fn = getattr(module, name)
            if name.startswith("_") or not inspect.isfunction(fn):
                continue
            try:
                returns = str(inspect.signature(fn).return_annotation)
            except (TypeError, ValueError):
                continue
            if "Transformation" in returns:
                names.append(f"{module.__name__}.{name}")
    return sorted(set(names))


def build(name: str) -> optax.GradientTransformation:
    """The transformation ``name``: from ``FACTORIES``, else with a learning rate if it needs one."""
    with warnings.catch_warnings():  # deprecations and key warnings are Optax's to its users
        warnings.simplefilter("ignore")
        return _build(name)


def _build(name: str) -> optax.GradientTransformation:
    if name in FACTORIES:
        return FACTORIES[name]()
    module, attr = name.rsplit(".", 1)
    fn = getattr(optax.contrib if module == "optax.contrib" else optax, attr)
    required = [p.name for p in inspect.signature(fn).parameters.values()
                if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if set(required) - {"learning_rate"}:
        raise KeyError(f"{name} needs {required}: add it to FACTORIES (or UNSUPPORTED, with the reason)")
    return fn(**({"learning_rate": 1e-2} if required else {}))


def _extra(name: str, grads: Any, plain_params: Any) -> dict[str, Any]:
    if name not in NEEDS_VALUE:
        return {}
    extra = {"value": loss(plain_params)}
    if "linesearch" in name or name == "optax.lbfgs":
        extra.update(grad=grads, value_fn=loss)
    if name == "optax.contrib.sophia":
        extra = {"obj_fn": loss}
    return extra


LOOKAHEAD = "optax.lookahead"  # trains LookaheadParams(fast, slow) on gradients of `fast`, as Optax's docs do


def _initial(name: str, mesh: Any = None) -> Any:
    if name != LOOKAHEAD:
        return init_params() if mesh is None else js.fully_shard(init_params(), mesh)
    if mesh is None:
        return optax.LookaheadParams.init_synced(init_params())
    fast, slow = js.fully_shard(init_params(), mesh), js.fully_shard(init_params(), mesh)
    return js.fully_shard(optax.LookaheadParams(fast, slow), mesh)


def _trained(name: str, params: Any) -> Any:
    return params.fast if name == LOOKAHEAD else params


def run_unsharded(name: str) -> tuple[Any, Any]:
    """``STEPS`` updates of ``name`` on the plain parameters, on one device."""
    tx = optax.with_extra_args_support(build(name))
    params = jax.device_put(_initial(name), jax.devices()[0])
    with jax.numpy_dtype_promotion("standard"):
        state = tx.init(params)

        @jax.jit
        def step(p, s):
            grads = jax.grad(loss)(_trained(name, p))
            updates, s = tx.update(grads, s, p, **_extra(name, grads, _trained(name, p)))
            return optax.apply_updates(p, updates), s

        for _ in range(STEPS):
            params, state = step(params, state)
    return params, state


def run_sharded(name: str, mesh: Any) -> tuple[Any, Any]:
    """The same on ``js.fully_shard`` parameters, through ``js.shard_optimizer``."""
    tx = js.shard_optimizer(build(name))
    params = _initial(name, mesh)
    with jax.numpy_dtype_promotion("standard"):
        state = tx.init(params)

        @jax.jit
        def step(p, s):
            plain = js.unshard(_trained(name, p))
            grads = js.reshard(jax.grad(loss)(plain), _trained(name, p))
            updates, s = tx.update(grads, s, p, **_extra(name, grads, plain))
            return optax.apply_updates(p, updates), s

        for _ in range(STEPS):
            params, state = step(params, state)
    return params, state


def max_relative_error(got: Any, want: Any) -> float:
    """The largest ``|got - want| / (1 + |want|)`` over every leaf (parameters may grow large).

    Equal infinities (a diverging optimizer) agree; a NaN on either side is an infinite error
    (a comparison with NaN proves nothing, and Python's ``max`` would skip it unless it came first).
    """
    def error(g, w):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if np.isnan(g).any() or np.isnan(w).any():
            return math.inf
        with np.errstate(invalid="ignore", over="ignore"):
            worst = float(np.max(np.where(g == w, 0.0, np.abs(g - w) / (1 + np.abs(w))), initial=0.0))
        return math.inf if math.isnan(worst) else worst  # unequal infinities: inf / inf

    return max(error(g, w) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))


def device_bytes(tree: Any) -> int:
    """Bytes of ``tree`` on the first device (every device holds as much)."""
    device = jax.devices()[0]
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)
               for s in x.addressable_shards if s.device == device)


def replicated_state(state: Any) -> list[str]:
    """Paths of the state leaves with more than one element stored whole on every device."""
    return [r.name for r in stored_leaves(state) if isinstance(r.leaf, jax.Array) and r.leaf.size > 1
            and r.leaf.sharding.is_fully_replicated]


def parameter_sized(state: Any) -> list[Any]:
    """The stored state leaves that mirror a parameter: under its key, of its shape (these must be
    sharded like it)."""
    return [r for r in stored_leaves(state) if r.path and getattr(r.path[-1], "key", None) in SHAPES
            and r.shape == SHAPES[r.path[-1].key]]


def measure(name: str, mesh: Any) -> dict[str, Any]:
    ref, ref_state = run_unsharded(name)
    got, state = run_sharded(name, mesh)
    return {"error": max_relative_error(js.unshard(got), ref), "state_bytes": device_bytes(state),
            "unsharded_state_bytes": sum(x.nbytes for x in jax.tree.leaves(ref_state) if hasattr(x, "nbytes")),
            "replicated": replicated_state(state)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    meshes = {"fsdp8": js.make_mesh(), "hsdp2x4": js.make_mesh(replicate=2)}
    rows = {}
    print("| transformation | max rel. error (fsdp 8 / hsdp 2x4) | state bytes per device / unsharded | replicated |")
    print("|---|---|---|---|")
    for name in discovered():
        if name in UNSUPPORTED:
            continue
        results = {m: measure(name, mesh) for m, mesh in meshes.items()}
        rows[name] = results
        r = results["fsdp8"]
        print(f"| `{name}` | {r['error']:.1e} / {results['hsdp2x4']['error']:.1e} | {r['state_bytes']} / "
              f"{r['unsharded_state_bytes']} | {', '.join(r['replicated']) or '-'} |", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "optax_transformations.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
