"""One tanh MLP written as every kind of FSDP unit, compiled on abstract inputs.

Each layer is ``tanh(h @ w + b)`` with ``w`` of ``W x W`` float32 (1 MiB at W = 512); the
root unit owns a ``W x HEAD`` head. ``step_memory(kind, layers, policy)`` returns the
compiled step's ``memory_analysis()`` and its HLO text; no array is allocated. ``mesh`` and
``width`` place it elsewhere (a TPU topology's mesh) and make its layers wider.
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from helpers import run_nnx_blocks

import jshard as js
from jshard.flax import linen as jlinen
from jshard.flax import nnx as jnnx

W, HEAD, BATCH = 512, 8, 256
N = 8  # devices
KINDS = ("core", "nested", "nnx", "linen", "scan", "nnx_scan", "linen_scan")
STACKED = ("scan", "nnx_scan", "linen_scan")


def layer_bytes(width=W):
    """One gathered float32 layer (1 MiB at W)."""
    return width * width * 4


def activation_bytes(width=W):
    """One (local batch x width) float32 activation (64 KiB at W)."""
    return BATCH // N * width * 4


def fsdp2_bound(layers, width=W):
    """FSDP2's: about 3 gathered units + one unit's full gradient + activations + sharded grads + head."""
    layer = layer_bytes(width)
    return 4 * layer + layers * 3 * activation_bytes(width) + layers * layer // N + width * HEAD * 4 + layer // 16


def _root(policy):
    """The root unit: the blocks' mixed precision, FSDP2's default resharding (kept)."""
    return js.FullyShardPolicy(mp_policy=policy.mp_policy)


def _sds(*shape, mesh=None):
    sharding = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)


def _layer(h, w, b):
    return jnp.tanh(h @ w + b)


def _head_loss(y):
    return jnp.mean(y**2)


# ---------------------------------------------------------------- core units


def _core(layers, policy, nested, mesh, w):
    def block():
        if nested:  # the bias is a unit of its own inside the layer's unit
            inner = js.fully_shard({"b": _sds(w)}, mesh, policy)
            return js.fully_shard({"w": _sds(w, w), "inner": inner}, mesh, policy)
        return js.fully_shard({"w": _sds(w, w), "b": _sds(w)}, mesh, policy)

    params = js.fully_shard({"blocks": [block() for _ in range(layers)], "head": _sds(w, HEAD)}, mesh, _root(policy))

    def loss_fn(p, x):
        for unit in p["blocks"]:
            q = js.unshard(unit)
            b = js.unshard(q["inner"])["b"] if nested else q["b"]
            x = _layer(x, q["w"], b)
        return _head_loss(x @ js.unshard(p)["head"])

    return jax.jit(js.value_and_grad(loss_fn, unshard_params=False)), params


def _scan(layers, policy, mesh, w):
    stacked = dataclasses.replace(policy, scan_axis=0)
    stack = js.fully_shard({"w": _sds(layers, w, w), "b": _sds(layers, w)}, mesh, stacked)
    params = js.fully_shard({"blocks": stack, "head": _sds(w, HEAD)}, mesh, _root(policy))

    def loss_fn(p, x):
        x, _ = js.scan(lambda h, layer: (_layer(h, layer["w"], layer["b"]), None), x, p["blocks"])
        return _head_loss(x @ js.unshard(p)["head"])

    return jax.jit(js.value_and_grad(loss_fn, unshard_params=False)), params


# ---------------------------------------------------------------- NNX


class NnxBlock(nnx.Module):
    def __init__(self, width, rngs):
        self.lin = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.lin(x))


class NnxMLP(nnx.Module):
    def __init__(self, layers, scan, rngs, width=W):
        self.scan = scan
        if scan:

            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def create(rngs):
                return NnxBlock(width, rngs)

            self.blocks = create(rngs)
        else:
            self.blocks = nnx.List([NnxBlock(width, rngs) for _ in range(layers)])
        self.head = nnx.Linear(width, HEAD, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.head(run_nnx_blocks(self.blocks, x, self.scan))


def _nnx(layers, policy, scan, mesh, w):
    model = nnx.eval_shape(lambda: NnxMLP(layers, scan, nnx.Rngs(0), w))
    if scan:
        jnnx.fully_shard(model.blocks, mesh, dataclasses.replace(policy, scan_axis=0))
    else:
        for block in model.blocks:
            jnnx.fully_shard(block, mesh, policy)
    jnnx.fully_shard(model, mesh, _root(policy))
    graphdef, state = nnx.split(model)

    def step(state, x):
        return jnnx.value_and_grad(lambda m, x: _head_loss(m(x)))(nnx.merge(graphdef, state), x)

    return jax.jit(step), state


# ---------------------------------------------------------------- Linen


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(x.shape[-1])(x))


class LinenScanBlock(LinenBlock):
    def __call__(self, x, _):
        return super().__call__(x), None


class LinenMLP(nn.Module):
    layers: int
    scan: bool
    policy: js.FullyShardPolicy
    mesh: Any = None

    @nn.compact
    def __call__(self, x):
        if self.scan:
            block = jlinen.fully_shard(LinenScanBlock, mesh=self.mesh, policy=self.policy)
            stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers)
            x, _ = stack(name="blocks")(x, None)
        else:
            block = jlinen.fully_shard(LinenBlock, mesh=self.mesh, policy=self.policy)
            for i in range(self.layers):
                x = block(name=f"block_{i}")(x)
        return nn.Dense(HEAD, use_bias=False, name="head")(x)


def _linen(layers, policy, scan, mesh, w):
    model = jlinen.fully_shard(LinenMLP, mesh=mesh, policy=_root(policy))(layers, scan, policy, mesh)
    x = jnp.zeros((1, w), jnp.float32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), x)["params"])
    sharded = jlinen.shard_params(model, params, x)
    loss_fn = lambda p, x: _head_loss(model.apply({"params": p}, x))  # noqa: E731
    return jax.jit(jlinen.value_and_grad(loss_fn)), sharded


# ---------------------------------------------------------------- compile


def build(kind, layers, policy, mesh=None, width=W):
    if kind in ("core", "nested"):
        return _core(layers, policy, kind == "nested", mesh, width)
    if kind == "scan":
        return _scan(layers, policy, mesh, width)
    if kind in ("nnx", "nnx_scan"):
        return _nnx(layers, policy, kind == "nnx_scan", mesh, width)
    return _linen(layers, policy, kind == "linen_scan", mesh, width)


def step_memory(kind, layers, policy, mesh=None, width=W, compiler_options=None):
    """``compiler_options``: handed to ``compile`` (``{"xla_dump_to": DIR}`` for XLA's buffer assignment)."""
    step, params = build(kind, layers, policy, mesh, width)
    compiled = step.lower(params, _sds(BATCH, width, mesh=mesh)).compile(compiler_options=compiler_options)
    return compiled.memory_analysis(), compiled.as_text()
