"""One tanh MLP written as every kind of FSDP unit, compiled on abstract inputs.

Each layer is ``tanh(h @ w + b)`` with ``w`` of ``W x W`` float32 (1 MiB at W = 512); the
root unit owns a ``W x HEAD`` head. ``step_memory(kind, layers, policy)`` returns the
compiled step's ``memory_analysis()`` and its HLO text; no array is allocated.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from helpers import run_nnx_blocks

import jshard as js
from jshard.flax import linen as jlinen
from jshard.flax import nnx as jnnx

W, HEAD, BATCH = 512, 8, 256
KINDS = ("core", "nested", "nnx", "linen", "scan", "nnx_scan", "linen_scan")
STACKED = ("scan", "nnx_scan", "linen_scan")


def _root(policy):
    """The root unit: the blocks' mixed precision, FSDP2's default resharding (kept)."""
    return js.FullyShardPolicy(mp_policy=policy.mp_policy)


def _sds(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _layer(h, w, b):
    return jnp.tanh(h @ w + b)


def _head_loss(y):
    return jnp.mean(y**2)


# ---------------------------------------------------------------- core units


def _core(layers, policy, nested):
    def block():
        if nested:  # the bias is a unit of its own inside the layer's unit
            inner = js.fully_shard({"b": _sds(W)}, policy=policy)
            return js.fully_shard({"w": _sds(W, W), "inner": inner}, policy=policy)
        return js.fully_shard({"w": _sds(W, W), "b": _sds(W)}, policy=policy)

    params = js.fully_shard({"blocks": [block() for _ in range(layers)], "head": _sds(W, HEAD)}, policy=_root(policy))

    def loss_fn(p, x):
        for unit in p["blocks"]:
            q = js.unshard(unit)
            b = js.unshard(q["inner"])["b"] if nested else q["b"]
            x = _layer(x, q["w"], b)
        return _head_loss(x @ js.unshard(p)["head"])

    return jax.jit(js.value_and_grad(loss_fn, unshard_params=False)), params


def _scan(layers, policy):
    stacked = dataclasses.replace(policy, scan_axis=0)
    stack = js.fully_shard({"w": _sds(layers, W, W), "b": _sds(layers, W)}, policy=stacked)
    params = js.fully_shard({"blocks": stack, "head": _sds(W, HEAD)}, policy=_root(policy))

    def loss_fn(p, x):
        x, _ = js.scan(lambda h, layer: (_layer(h, layer["w"], layer["b"]), None), x, p["blocks"])
        return _head_loss(x @ js.unshard(p)["head"])

    return jax.jit(js.value_and_grad(loss_fn, unshard_params=False)), params


# ---------------------------------------------------------------- NNX


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(W, W, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.lin(x))


class NnxMLP(nnx.Module):
    def __init__(self, layers, scan, rngs):
        self.scan = scan
        if scan:

            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def create(rngs):
                return NnxBlock(rngs)

            self.blocks = create(rngs)
        else:
            self.blocks = nnx.List([NnxBlock(rngs) for _ in range(layers)])
        self.head = nnx.Linear(W, HEAD, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.head(run_nnx_blocks(self.blocks, x, self.scan))


def _nnx(layers, policy, scan):
    model = nnx.eval_shape(lambda: NnxMLP(layers, scan, nnx.Rngs(0)))
    if scan:
        jnnx.fully_shard(model.blocks, policy=dataclasses.replace(policy, scan_axis=0))
    else:
        for block in model.blocks:
            jnnx.fully_shard(block, policy=policy)
    jnnx.fully_shard(model, policy=_root(policy))
    graphdef, state = nnx.split(model)

    def step(state, x):
        return jnnx.value_and_grad(lambda m, x: _head_loss(m(x)))(nnx.merge(graphdef, state), x)

    return jax.jit(step), state


# ---------------------------------------------------------------- Linen


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(W)(x))


class LinenScanBlock(LinenBlock):
    def __call__(self, x, _):
        return super().__call__(x), None


class LinenMLP(nn.Module):
    layers: int
    scan: bool
    policy: js.FullyShardPolicy

    @nn.compact
    def __call__(self, x):
        if self.scan:
            block = jlinen.fully_shard(LinenScanBlock, policy=self.policy)
            stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers)
            x, _ = stack(name="blocks")(x, None)
        else:
            block = jlinen.fully_shard(LinenBlock, policy=self.policy)
            for i in range(self.layers):
                x = block(name=f"block_{i}")(x)
        return nn.Dense(HEAD, use_bias=False, name="head")(x)


def _linen(layers, policy, scan):
    model = jlinen.fully_shard(LinenMLP, policy=_root(policy))(layers, scan, policy)
    x = jnp.zeros((1, W), jnp.float32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), x)["params"])
    sharded = jlinen.shard_params(model, params, x)
    loss_fn = lambda p, x: _head_loss(model.apply({"params": p}, x))  # noqa: E731
    return jax.jit(jlinen.value_and_grad(loss_fn)), sharded


# ---------------------------------------------------------------- compile


def build(kind, layers, policy):
    if kind in ("core", "nested"):
        return _core(layers, policy, kind == "nested")
    if kind == "scan":
        return _scan(layers, policy)
    if kind in ("nnx", "nnx_scan"):
        return _nnx(layers, policy, kind == "nnx_scan")
    return _linen(layers, policy, kind == "linen_scan")


def step_memory(kind, layers, policy):
    step, params = build(kind, layers, policy)
    compiled = step.lower(params, _sds(BATCH, W)).compile()
    return compiled.memory_analysis(), compiled.as_text()
