"""[Note: stacks cast before the loop]: on TPU the step hands its loss each stacked unit's shards
cast to their compute dtype, so the loop over the stack (``js.scan``, ``nnx.scan``, ``nn.scan``)
gathers bf16 slices and stacks bf16 gradients, with values bit for bit those of the cast in each
iteration. The TPU rule is forced on these CPU devices; what it saves is measured on the TPU
compiler (tests/test_tpu_compiler.py)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model import batches, init_params, shard, train_sharded

import jshard as js
import jshard._step.unit_gather as unit_gather
from jshard.flax import linen as jlinen
from jshard.flax import nnx as jnnx

L, W = 4, 16
FRONT_ENDS = ["js.scan", "nnx.scan", "nn.scan"]


def _weights() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(L, W, W)) / np.sqrt(W)


def _loss(h: jax.Array) -> jax.Array:
    return jnp.mean(h.astype(jnp.float32) ** 2)


class NnxLayer(nnx.Module):
    def __init__(self, w: jax.Array):
        self.w = nnx.Param(w)

    def __call__(self, h):
        return jnp.tanh(h @ self.w)


class NnxStack(nnx.Module):
    def __init__(self, weights: jax.Array):
        self.blocks = nnx.vmap(lambda w: NnxLayer(w), in_axes=0, out_axes=0)(weights)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(h, layer):
            return layer(h)

        return run(x, self.blocks)


class LinenLayer(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return jnp.tanh(h @ self.param("w", nn.initializers.zeros, (W, W))).astype(h.dtype), None


class LinenStack(nn.Module):
    mp: js.MixedPrecisionPolicy

    @nn.compact
    def __call__(self, x):
        layer = jlinen.fully_shard(LinenLayer, policy=js.FullyShardPolicy(mp_policy=self.mp))  # stacked: scan_axis=0
        stack = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=L)
        return stack(name="blocks")(x, None)[0]


def stack_step(front: str, mp: js.MixedPrecisionPolicy):
    """``(step, params)``: the gradient step of ``L`` stacked ``(W, W)`` tanh layers written with
    ``front``'s loop (``step(params, x) -> (loss, grads)``, grads shaped like params)."""
    weights = jnp.asarray(_weights(), jnp.float32)
    stacked, root = js.FullyShardPolicy(scan_axis=0, mp_policy=mp), js.FullyShardPolicy(mp_policy=mp)
    if front == "js.scan":
        sharded = js.fully_shard({"blocks": js.fully_shard({"w": weights}, policy=stacked)}, policy=root)

        def loss(p, x):
            return _loss(js.scan(lambda h, layer: (jnp.tanh(h @ layer["w"]), None), x, js.unshard(p)["blocks"])[0])

        return js.value_and_grad(loss, unshard_params=False), sharded
    if front == "nnx.scan":
        model = NnxStack(weights)
        jnnx.fully_shard(model.blocks, policy=stacked)
        jnnx.fully_shard(model, policy=root)
        graphdef, state = nnx.split(model)
        grad_fn = jnnx.value_and_grad(lambda m, x: _loss(m(x)))
        return lambda state, x: grad_fn(nnx.merge(graphdef, state), x), state
    model = jlinen.fully_shard(LinenStack, policy=root)(mp=mp)
    params = {"blocks": {"w": weights}}
    sharded = jlinen.shard_params(model, params, jnp.ones((1, W)))
    return jlinen.value_and_grad(lambda p, x: _loss(model.apply({"params": p}, x))), sharded


def _loop_operand_dtypes(step, *args, shape):
    """The dtypes of every ``scan`` operand and result of ``shape`` in the step's jaxpr (nested ones too)."""
    found = set()

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "scan":
                found.update(v.aval.dtype.name for v in (*eqn.invars, *eqn.outvars)
                             if getattr(v.aval, "shape", None) == shape)
            for param in eqn.params.values():
                for sub in param if isinstance(param, tuple) else (param,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        visit(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        visit(sub)

    visit(jax.make_jaxpr(step)(*args).jaxpr)
    return found


@pytest.mark.parametrize("front", FRONT_ENDS)
@pytest.mark.parametrize("tpu, reduce_dtype, loop_dtypes", [(True, None, {"bfloat16"}),
                                                            (True, jnp.float32, {"float32"}),
                                                            (False, None, {"float32"})],
                         ids=["tpu-bf16-all", "tpu-f32-reduce", "cpu-bf16-all"])
def test_a_stack_reduced_in_param_dtype_enters_and_leaves_its_loop_in_it_on_tpu(monkeypatch, front, tpu,
                                                                                 reduce_dtype, loop_dtypes):
    """On TPU, with gradients reduced in ``param_dtype``, the weight's shard stack (per device
    ``(L, W / 8, W)``) goes into the forward loop in bfloat16 and the backward loop stacks its
    gradients in bfloat16, whichever loop runs the stack; reduced in float32, both stay float32,
    and so does every stack on XLA:CPU. The gradient comes back in the leaf's float32."""
    monkeypatch.setattr(unit_gather, "_compiler_holds_cast_stacks", lambda axes: tpu)
    mp = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=reduce_dtype)
    step, params = stack_step(front, mp)
    x = jnp.ones((32, W))
    assert _loop_operand_dtypes(step, params, x, shape=(L, W // 8, W)) == loop_dtypes
    assert {g.dtype for g in jax.tree.leaves(step(params, x)[1])} == {jnp.dtype(jnp.float32)}


def _sgd(step, params, steps=3):
    step = jax.jit(step)
    losses = []
    for i in range(steps):
        loss, grads = step(params, jnp.asarray(np.random.default_rng(i).normal(size=(32, W)), jnp.float32))
        losses.append(float(loss))
        params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
    return losses, jax.tree.leaves(params)


def _same_bits(runs):
    (losses, leaves), (losses_in, leaves_in) = runs
    assert losses == losses_in
    for a, b in zip(leaves, leaves_in, strict=True):
        assert a.dtype == b.dtype and bool((a == b).all())


@pytest.mark.parametrize("front", FRONT_ENDS)
def test_a_stack_cast_before_its_loop_trains_bit_for_bit_as_one_cast_in_it(monkeypatch, front):
    """The cast moved out of the loop changes no value: three SGD steps in bf16 with the TPU rule
    and without it, whichever loop runs the stack."""
    runs = []
    for tpu in (True, False):
        monkeypatch.setattr(unit_gather, "_compiler_holds_cast_stacks", lambda axes, tpu=tpu: tpu)
        runs.append(_sgd(*stack_step(front, js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16))))
    _same_bits(runs)


@pytest.mark.parametrize("policy", [{}, {"unit_collectives": True}, {"reshard_after_forward": 2}],
                         ids=["per-leaf", "unit-collectives", "group-copies"])
def test_a_stack_cast_before_its_loop_trains_bit_for_bit_under_every_gather(monkeypatch, policy):
    """The same for the test model (a stack of (7, 7) layers beside unrolled units and a root)
    under each way a unit is gathered: per leaf, one flat buffer per unit, group copies."""
    runs = []
    for tpu in (True, False):
        monkeypatch.setattr(unit_gather, "_compiler_holds_cast_stacks", lambda axes, tpu=tpu: tpu)
        mp = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16)
        sharded = shard(init_params(), js.make_mesh(), js.FullyShardPolicy(mp_policy=mp, **policy))
        losses, params, grads, _ = train_sharded(sharded, batches(3))
        runs.append((losses, jax.tree.leaves(params) + jax.tree.leaves(grads)))
    _same_bits(runs)
