"""The Mixtral-style model of :mod:`jshard.demo.moe` sharded with jshard, and its training step.

One mesh, two axes: ``("data", "expert")``. Each layer's expert weights ``(E, d, f)`` are
placed split over ``expert`` on dim 0 and then made a unit with
``DataParallelMeshDims(shard="data")``: FSDP over the data-parallel devices of each expert
group (``P("expert", "data")``, padded where ``data`` does not divide the dim). Everything
else (embedding, attention, norms, routers, head) is one unit sharded over all devices
(``shard=("data", "expert")``). ``js.value_and_grad`` splits the batch over both axes; inside
the loss the MoE layers exchange tokens with ``all_to_all`` over ``expert``
([Note: step axes]).

Example:
  >>> import jax, optax
  >>> from jshard.demo.moe import MoEConfig
  >>> from jshard.demo.moe_train import expert_mesh, init_params, shard_mixtral, train_step
  >>> cfg = MoEConfig(vocab=16, dim=8, heads=2, layers=1, experts=4, hidden=12, expert_axis="expert")
  >>> mesh = expert_mesh(cfg.experts)
  >>> dict(mesh.shape)
  {'data': 2, 'expert': 4}
  >>> graphdef, params = init_params(cfg, seed=0)
  >>> sharded = shard_mixtral(params, mesh)
  >>> sharded["blocks"][0]["moe"]["experts"]["w_gate"].sharding.spec
  P('expert', 'data')
  >>> tx = js.shard_optimizer(optax.sgd(1e-2, momentum=0.9))
  >>> step = jax.jit(train_step(graphdef, tx))
  >>> sharded, state, loss = step(sharded, tx.init(sharded), jax.numpy.zeros((8, 9), jax.numpy.int32))
  >>> float(loss) > 0
  True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jshard as js
from jshard.demo.moe import Mixtral, MoEConfig, lm_loss


def expert_mesh(experts: int, devices: Any = None, expert_degree: int | None = None) -> Mesh:
    """``(data, expert)`` mesh over ``devices`` (default all); the expert degree defaults to ``gcd(experts, N)``."""
    devices = np.asarray(jax.devices() if devices is None else devices).reshape(-1)
    m = expert_degree or math.gcd(experts, devices.size)
    if devices.size % m or experts % m:
        raise ValueError(f"Expert degree {m} must divide both the {devices.size} devices and the {experts} experts; "
                         f"pick a common divisor such as {math.gcd(experts, devices.size)}.")
    return Mesh(devices.reshape(devices.size // m, m), ("data", "expert"))


def as_expert_mesh(mesh: Mesh, experts: int) -> Mesh:
    """``mesh`` if it is already ``(data, expert)``, else :func:`expert_mesh` over its devices (for plan builders)."""
    return mesh if mesh.axis_names == ("data", "expert") else expert_mesh(experts, mesh.devices)


def init_params(cfg: MoEConfig, seed: int = 0) -> tuple[Any, dict]:
    """The model's graph definition and its parameters as a plain dict (``nnx.split``, pure values)."""
    graphdef, state = nnx.split(Mixtral(cfg, nnx.Rngs(seed)))
    return graphdef, state.to_pure_dict()


def shard_mixtral(params: dict, mesh: Mesh, mp_policy: js.MixedPrecisionPolicy | None = None) -> dict:
    """Expert weights: split over ``expert`` on dim 0, FSDP over ``data``; the rest FSDP over every device."""
    mp = mp_policy or js.MixedPrecisionPolicy()
    on_data = js.FullyShardPolicy(dp_mesh_dims=js.DataParallelMeshDims(shard="data"), mp_policy=mp)
    split = NamedSharding(mesh, P("expert"))
    blocks = {}
    for i, block in params["blocks"].items():
        experts = {name: _place(w, split) for name, w in block["moe"]["experts"].items()}
        blocks[i] = {**block, "moe": {**block["moe"], "experts": js.fully_shard(experts, mesh, on_data)}}
    dense = js.FullyShardPolicy(dp_mesh_dims=js.DataParallelMeshDims(shard=("data", "expert")), mp_policy=mp)
    return js.fully_shard({**params, "blocks": blocks}, mesh, dense)


def shard_mixtral_nnx(model: Mixtral, mesh: Mesh, mp_policy: js.MixedPrecisionPolicy | None = None) -> Mixtral:
    """:func:`shard_mixtral`'s layout through the NNX adapter, in place: each ``Experts`` module a unit
    over ``data`` with its Params first placed over ``expert``, then the model over every device.

    Example:
      >>> cfg = MoEConfig(vocab=16, dim=8, heads=2, layers=1, experts=4, hidden=12, expert_axis="expert")
      >>> model = shard_mixtral_nnx(Mixtral(cfg, nnx.Rngs(0)), expert_mesh(cfg.experts))
      >>> model.blocks[0].moe.experts.w_up.get_value().sharding.spec
      P('expert', 'data')
    """
    from jshard.flax import nnx as jnnx

    mp = mp_policy or js.MixedPrecisionPolicy()
    on_data = js.FullyShardPolicy(dp_mesh_dims=js.DataParallelMeshDims(shard="data"), mp_policy=mp)
    split = NamedSharding(mesh, P("expert"))
    for block in model.blocks:
        for param in (block.moe.experts.w_gate, block.moe.experts.w_up, block.moe.experts.w_down):
            param.set_value(_place(param.get_value(), split))
        jnnx.fully_shard(block.moe.experts, mesh, on_data)
    dense = js.FullyShardPolicy(dp_mesh_dims=js.DataParallelMeshDims(shard=("data", "expert")), mp_policy=mp)
    return jnnx.fully_shard(model, mesh, dense)


def _place(w: Any, sharding: NamedSharding) -> Any:
    if isinstance(w, jax.ShapeDtypeStruct):  # planning: abstract leaves stay abstract
        return jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=sharding)
    return jax.device_put(w, sharding)


def train_step(graphdef: Any, optimizer: optax.GradientTransformation, *, sharded: bool = True) -> Callable:
    """The NNX model's ``step(params, opt_state, tokens) -> (params, opt_state, loss)`` (:func:`loss_step`).

    ``graphdef`` says where the experts live: from a config with ``expert_axis="expert"`` for the
    sharded step, with ``expert_axis=None`` for the one-device reference.
    """

    def loss_fn(params: dict, tokens: jax.Array) -> jax.Array:
        return lm_loss(nnx.merge(graphdef, params), tokens)

    return loss_step(loss_fn, optimizer, sharded=sharded)


def loss_step(loss_fn: Callable[[Any, jax.Array], jax.Array], optimizer: optax.GradientTransformation, *,
              sharded: bool = True) -> Callable:
    """The training step of any ``loss_fn(params, tokens)`` (the NNX model's, or :mod:`jshard.demo.moe_jax`'s).

    Example:
      >>> from jshard.demo import moe_jax
      >>> cfg = MoEConfig(vocab=16, dim=8, heads=2, layers=1, experts=4, hidden=12)
      >>> tx = optax.sgd(0.1)
      >>> step = jax.jit(loss_step(lambda p, t: moe_jax.lm_loss(p, t, cfg), tx, sharded=False))
      >>> params = moe_jax.init_params(cfg, jax.random.key(0))
      >>> _, _, loss = step(params, tx.init(params), jax.numpy.zeros((2, 5), jax.numpy.int32))
      >>> loss.shape
      ()
    """
    grad_fn = js.value_and_grad(loss_fn) if sharded else jax.value_and_grad(loss_fn)

    def step(params: Any, opt_state: Any, tokens: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = grad_fn(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


DEMO_SEQ_LEN = 32  # characters per sequence in the demo; the model is MoEConfig's defaults


def train_demo(experts: int, steps: int, vocab: int, batches: Callable[[int, int], Iterator[np.ndarray]], *,
               lr: float = 3e-3, seed: int = 0, batch: int | None = None) -> list[float]:
    """``python -m jshard.demo --experts E``: the small MoE over all devices; returns the losses.

    ``batches(batch, seq_len)`` yields ``(batch, seq_len + 1)`` token windows of the demo's text.
    """
    mesh = expert_mesh(experts)
    cfg = MoEConfig(vocab=8 * math.ceil(vocab / 8), experts=experts, expert_axis="expert")
    graphdef, params = init_params(cfg, seed)
    sharded = shard_mixtral(params, mesh)
    tx = js.shard_optimizer(optax.adamw(lr))
    step = jax.jit(train_step(graphdef, tx))
    state = tx.init(sharded)
    batch = mesh.size * math.ceil((batch or 2 * mesh.size) / mesh.size)
    data = NamedSharding(mesh, P(("data", "expert")))
    windows = batches(batch, DEMO_SEQ_LEN)
    count = sum(x.size for x in jax.tree.leaves(params))
    print(f"jshard demo: {count / 1e6:.2f}M-parameter Mixtral-style MoE, {experts} experts (top-{cfg.top_k}), "
          f"{mesh.size} {jax.devices()[0].platform.upper()} devices as mesh {dict(mesh.shape)}, "
          f"batch {batch} x {DEMO_SEQ_LEN} characters")
    losses = []
    for i in range(steps):
        sharded, state, loss = step(sharded, state, jax.device_put(next(windows), data))
        losses.append(float(loss))
        if i == 0 or (i + 1) % max(1, steps // 10) == 0:
            print(f"step {i + 1}/{steps}: loss {losses[-1]:.4f}")
    print(f"loss: {losses[0]:.4f} at step 1 -> {losses[-1]:.4f} at step {steps}")
    return losses


MIXTRAL_8X7B = MoEConfig(vocab=32000, dim=4096, heads=32, layers=32, experts=8, hidden=14336, capacity_factor=1.25,
                         aux_weight=0.02, expert_axis="expert")
MIXTRAL_SEQ_LEN = 2048


def build_mixtral(mesh: Mesh, config: Any = None, cfg: MoEConfig = MIXTRAL_8X7B,
                  seq_len: int = MIXTRAL_SEQ_LEN) -> tuple[Callable, tuple]:
    """Plan builder: ``python -m jshard.report plan jshard.demo.moe_train:build_mixtral --devices 256``.

    A Mixtral-8x7B shape (d 4096, f 14336, 8 experts, 32 layers, vocabulary 32000; multi-head
    attention, not Mixtral's grouped-query one), AdamW, on the planner's devices as
    ``(data N / 8, expert 8)``; abstract, nothing allocated.
    """
    import jax.numpy as jnp

    from jshard.report import PlanConfig, abstract_result

    config = config or PlanConfig()
    default = PlanConfig().for_devices(mesh.devices.flat[0].device_kind)  # what its units get unasked
    unread = {name: getattr(config, name)
              for name in ("reshard_after_forward", "remat", "offload", "replicate_below", "weight_gradients")
              if getattr(config, name) not in (getattr(PlanConfig(), name), getattr(default, name))}
    if unread:
        raise ValueError(f"build_mixtral reads only batch_per_device and mixed_precision of its PlanConfig, "
                         f"not {unread}: plan it without them.")
    mesh = as_expert_mesh(mesh, cfg.experts)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Mixtral(cfg, nnx.Rngs(0))))
    mp = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32) if config.mixed_precision \
        else None
    params = shard_mixtral(state.to_pure_dict(), mesh, mp)
    tx = js.shard_optimizer(optax.adamw(1e-4))
    opt_state = abstract_result(tx.init, params)
    step = train_step(graphdef, tx)

    def traced(*args: Any) -> Any:
        with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes Python floats with int32 counts
            return step(*args)

    tokens = jax.ShapeDtypeStruct((config.batch_per_device * mesh.size, seq_len + 1), jnp.int32,
                                  sharding=NamedSharding(mesh, P(("data", "expert"))))
    return jax.jit(traced, donate_argnums=(0, 1)), (params, opt_state, tokens)
