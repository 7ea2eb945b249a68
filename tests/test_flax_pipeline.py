"""Pipeline stages over FSDP for Flax stacks: an NNX stack made with ``nnx.vmap`` and a Linen
``nn.scan`` stack, each run as S stages over ``stage`` with the user's layer module as the body,
against the same model on one device ([Note: NNX pipeline], [Note: Linen pipeline])."""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import docs_example_output
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jshard as js
from jshard.flax import linen as jlinen
from jshard.flax import nnx as jnnx

D_IN, D, D_OUT, BATCH, LAYERS, STEPS = 5, 6, 3, 16, 5, 3
FSDP, STAGE_FSDP = js.DataParallelMeshDims(shard="fsdp"), js.DataParallelMeshDims(shard=("stage", "fsdp"))
CASES = [  # (stages, layers, microbatches, gather, schedule): L not divisible by S
    (2, 5, 4, "per_microbatch", "1f1b"),  # the adapters' layers as GPipe runs them; its schedule: test_pipeline.py
    pytest.param(2, 5, 4, "per_microbatch", "gpipe", marks=pytest.mark.slow),
    pytest.param(4, 7, 4, "once", "gpipe", marks=pytest.mark.slow),
    pytest.param(4, 7, 4, "once", "1f1b", marks=pytest.mark.slow),
]


def _mesh(stages: int = 2) -> Mesh:
    return Mesh(np.asarray(jax.devices()).reshape(stages, 8 // stages), ("stage", "fsdp"))


def _stored_shape(stages: int, layers: int) -> tuple[int, ...]:
    """A block's stored ``(L, d, d)`` kernel: ``S * ceil(L / S)`` slots, dim 1 padded to the ``fsdp`` size."""
    fsdp = 8 // stages
    return (-(-layers // stages) * stages, -(-D // fsdp) * fsdp, D)


def _batch() -> dict:
    rng = np.random.default_rng(1)
    return {"x": rng.normal(size=(BATCH, D_IN)).astype(np.float32),
            "y": rng.normal(size=(BATCH, D_OUT)).astype(np.float32)}


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.mlp = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, h):
        return h + jnp.tanh(self.mlp(self.norm(h)))


class Stacked(nnx.Module):
    """Flax's scanned stack: blocks made with ``nnx.vmap`` over split rngs; run with ``nnx.scan``
    (``policy=None``, the one-device reference) or ``jnnx.pipeline``; ``model(x, y)`` is the loss
    (under 1F1B the head and loss run inside the schedule)."""

    def __init__(self, rngs: nnx.Rngs, layers: int = LAYERS, policy: js.PipelinePolicy | None = None):
        self.w_in = nnx.Linear(D_IN, D, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return Block(rngs)

        self.blocks = create(rngs)
        self.w_out = nnx.Linear(D, D_OUT, rngs=rngs)
        self.pipeline_policy = policy

    def __call__(self, x, y=None):
        h, policy = jnp.tanh(self.w_in(x)), self.pipeline_policy
        if policy is not None and policy.schedule == "1f1b" and y is not None:
            return jnnx.pipeline(lambda h, block: block(h), h, self.blocks, policy=policy, targets=y,
                                 loss=lambda h, y: jnp.mean((self.w_out(h) - y) ** 2), head=self.w_out)
        if policy is not None:
            h = jnnx.pipeline(lambda h, block: block(h), h, self.blocks, policy=policy)
        else:
            h = nnx.scan(lambda h, block: block(h), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(h, self.blocks)
        out = self.w_out(h)
        return out if y is None else jnp.mean((out - y) ** 2)


def _nnx_loss(model, batch):
    return model(batch["x"], batch["y"])


def _assert_grads_match(got, want):
    """Gradients within 1e-5 of the one-device ones, each stored array cut to the parameter's shape
    (padding and layer slots are at the end of each dim)."""
    def check(g, w):
        np.testing.assert_allclose(np.asarray(g)[tuple(slice(n) for n in w.shape)], w, rtol=1e-5, atol=1e-6)
    jax.tree.map(check, got, want)


def _on_mesh(tree, mesh):
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: x if isinstance(x.sharding, NamedSharding) else jax.device_put(x, replicated), tree)


def _nnx_train(model, grad_fn, mesh=None):
    optimizer = nnx.Optimizer(model, optax.adamw(3e-2, weight_decay=0.1), wrt=nnx.Param)
    if mesh is not None:
        nnx.update(optimizer, _on_mesh(nnx.state(optimizer), mesh))

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = grad_fn(_nnx_loss)(model, batch)
        with jax.numpy_dtype_promotion("standard"):  # Optax's Adam raises a Python float to its int32 count
            optimizer.update(model, grads)
        return loss, grads

    losses, first = zip(*(step(model, optimizer, _batch()) for _ in range(STEPS)), strict=True)
    return [float(loss) for loss in losses], nnx.to_pure_dict(first[0])


@pytest.mark.parametrize("stages,layers,microbatches,gather,schedule", CASES)
def test_nnx_stack_runs_as_pipeline_stages(stages, layers, microbatches, gather, schedule):
    """An ``nnx.vmap`` stack of L=5 blocks (LayerNorm + Linear) as 2 stages of 3 (one padding
    layer) over (stage 2 x fsdp 4), M=4, GPipe and 1F1B (the head, its own unit, called in the
    loss inside the schedule) (slow: L=7 on (stage 4 x fsdp 2), ``gather="once"``): one step's
    gradients, the head's included, and 3 AdamW steps, fp32, losses and parameters within 1e-5
    of the same model run with ``nnx.scan`` on one device; the padding slots stay zero. The
    model unsharded (one device: a plain scan, then the loss) gives the reference's loss."""
    mesh = _mesh(stages)
    policy = js.PipelinePolicy(microbatches=microbatches, gather=gather, schedule=schedule)
    reference = Stacked(nnx.Rngs(0), layers)
    ref_losses, ref_grads = _nnx_train(reference, nnx.value_and_grad)
    model = Stacked(nnx.Rngs(0), layers, policy)
    np.testing.assert_allclose(float(_nnx_loss(model, _batch())), ref_losses[0], rtol=1e-6)
    jnnx.fully_shard(model.blocks, mesh, js.FullyShardPolicy(scan_axis=0, dp_mesh_dims=FSDP), stages="stage")
    jnnx.fully_shard(model.w_out, mesh, js.FullyShardPolicy(dp_mesh_dims=STAGE_FSDP))
    jnnx.fully_shard(model, mesh, js.FullyShardPolicy(dp_mesh_dims=STAGE_FSDP))
    kernel = model.blocks.mlp.kernel.get_value()
    assert kernel.shape == _stored_shape(stages, layers) and kernel.sharding.spec == PartitionSpec("stage", "fsdp")
    losses, grads = _nnx_train(model, jnnx.value_and_grad, mesh)
    _assert_grads_match(grads, ref_grads)  # the head's too: AdamW's steps would hide its scale
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert not np.any(np.asarray(model.blocks.mlp.kernel.get_value())[layers:])
    got = nnx.to_pure_dict(nnx.state(jnnx.unshard(model), nnx.Param))
    want = nnx.to_pure_dict(nnx.state(reference, nnx.Param))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)
    assert float(jnp.abs(model(_batch()["x"]) - reference(_batch()["x"])).max()) < 1e-5  # gathered: a plain scan
    jnnx.reshard(model)
    assert model.blocks.mlp.kernel.get_value().shape == _stored_shape(stages, layers)


def test_nnx_pipeline_misuse_is_named():
    mesh = _mesh()

    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return nnx.BatchNorm(D, rngs=rngs)

    with pytest.raises(ValueError, match=r"jnnx.pipeline runs stacks whose only state is nnx.Param, but module "
                                         r"BatchNorm holds \['mean'\]\S* of shape \(5, 6\) \(not a Param\)"):
        jnnx.pipeline(lambda h, norm: norm(h), jnp.ones((2, D)), create(nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"a stack of 5 layers laid out as pipeline stages with "
                                         r"FullyShardPolicy\(scan_axis=None\); pass FullyShardPolicy\(scan_axis=0"):
        jnnx.fully_shard(Stacked(nnx.Rngs(0)).blocks, mesh, stages="stage")
    unstaged = jnnx.fully_shard(Stacked(nnx.Rngs(0)).blocks, mesh, js.FullyShardPolicy(scan_axis=0))
    with pytest.raises(ValueError, match=r"the root module \(Block\) is sharded but not laid out as pipeline stages: "
                                         r"shard the stack with .*stages='stage'\)"):
        jnnx.pipeline(lambda h, block: block(h), jnp.ones((2, D)), unstaged)
    blocks = jnnx.fully_shard(Stacked(nnx.Rngs(0)).blocks, mesh,
                              js.FullyShardPolicy(scan_axis=0, dp_mesh_dims=FSDP), stages="stage")
    with pytest.raises(RuntimeError, match=r"the root module \(Block\) is fully sharded and was called outside the "
                                           r"step"):
        jnnx.pipeline(lambda h, block: block(h), jnp.ones((2, D)), blocks)
    model = Stacked(nnx.Rngs(0))
    jnnx.fully_shard(model.blocks, mesh, js.FullyShardPolicy(scan_axis=0, dp_mesh_dims=FSDP), stages="stage")
    jnnx.fully_shard(model.w_out, mesh, js.FullyShardPolicy(dp_mesh_dims=STAGE_FSDP))
    jnnx.fully_shard(model, mesh, js.FullyShardPolicy(dp_mesh_dims=STAGE_FSDP))

    def head_not_passed(m, b):  # the head's own unit called in the 1F1B loss, not in head=
        loss = lambda h, y: jnp.mean((m.w_out(h) - y) ** 2)  # noqa: E731
        return jnnx.pipeline(lambda h, block: block(h), jnp.ones((BATCH // 8, D)), m.blocks, targets=b["y"],
                             policy=js.PipelinePolicy(schedule="1f1b"), loss=loss)
    with pytest.raises(ValueError, match=r"`w_out` \(Linear\) was called in the loss of jnnx.pipeline under "
                                         r"PipelinePolicy\(schedule='1f1b'\) without being gathered: its parameters "
                                         r"\(Param `bias` of shape \(3,\), ...\) are sharded over mesh axis "
                                         r"\('stage', 'fsdp'\) of size 8, .* Pass it in "
                                         r"jnnx.pipeline\(..., head=...\)"):
        nnx.jit(lambda m, b: jnnx.value_and_grad(head_not_passed)(m, b)[0])(model, _batch())


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return h + jnp.tanh(nn.Dense(D, name="mlp")(nn.LayerNorm(name="norm")(h))), None


class LinenModel(nn.Module):
    """A Linen stack over ``nn.scan`` (``stack=None``, the one-device reference), or the stack class
    given; ``model(x, y)`` is the loss, computed inside the stack's schedule with ``loss_inside``."""

    layers: int = LAYERS
    stack: Any = None
    loss_inside: bool = False

    @nn.compact
    def __call__(self, x, y=None):
        h = jnp.tanh(nn.Dense(D, name="w_in")(x))
        head = nn.Dense(D_OUT, name="w_out")
        if self.stack is None:
            stack = nn.scan(LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers)
            h, _ = stack(name="blocks")(h, None)
        elif self.loss_inside and y is not None:  # the head (the root's) and the loss per microbatch
            return self.stack(name="blocks")(h, y, lambda h, y: jnp.mean((head(h) - y) ** 2))
        else:
            h = self.stack(name="blocks")(h)
        return head(h) if y is None else jnp.mean((head(h) - y) ** 2)


def _linen_loss(apply):
    return lambda p, b: apply({"params": p}, b["x"], b["y"])


def _linen_train(params, grad_fn, apply):
    tx = optax.adamw(3e-2, weight_decay=0.1)

    @jax.jit
    def step(params, state, batch):
        loss, grads = grad_fn(_linen_loss(apply))(params, batch)
        with jax.numpy_dtype_promotion("standard"):
            updates, state = tx.update(grads, state, params)
        return loss, optax.apply_updates(params, updates), state, grads

    state, losses, grads = tx.init(params), [], []
    for _ in range(STEPS):
        loss, params, state, g = step(params, state, _batch())
        losses.append(float(loss))
        grads.append(g)
    return losses, params, grads[0]


@pytest.mark.parametrize("stages,layers,microbatches,gather,schedule", CASES)
def test_linen_stack_runs_as_pipeline_stages(stages, layers, microbatches, gather, schedule):
    """An ``nn.scan`` stack of L=5 blocks (LayerNorm + Dense) as 2 stages of 3 over (stage 2 x fsdp 4),
    M=4, GPipe and 1F1B (the root's head called in the loss inside the schedule) (slow: L=7 on
    (stage 4 x fsdp 2), ``gather="once"``): one step's gradients, the head's included, and 3 AdamW
    steps, fp32, losses and parameters within 1e-5 of the ``nn.scan`` model on one device; the
    padding slots stay zero. Outside the step (``apply`` on full params) it gives the reference's loss."""
    mesh = _mesh(stages)
    policy = js.PipelinePolicy(microbatches=microbatches, gather=gather, schedule=schedule)
    reference = LinenModel(layers)
    params = reference.init(jax.random.key(0), _batch()["x"])["params"]
    ref_losses, ref_params, ref_grads = _linen_train(params, jax.value_and_grad, reference.apply)
    block = jlinen.fully_shard(LinenBlock, mesh=mesh, policy=js.FullyShardPolicy(dp_mesh_dims=FSDP))
    root = jlinen.fully_shard(LinenModel, mesh=mesh, policy=js.FullyShardPolicy(dp_mesh_dims=STAGE_FSDP))
    model = root(layers, stack=jlinen.pipeline(block, length=layers, policy=policy), loss_inside=schedule == "1f1b")
    np.testing.assert_allclose(float(_linen_loss(model.apply)(params, _batch())), ref_losses[0], rtol=1e-6)
    sharded = jlinen.shard_params(model, params, _batch()["x"])
    kernel = sharded["blocks"]["mlp"]["kernel"]
    assert kernel.shape == _stored_shape(stages, layers) and kernel.sharding.spec == PartitionSpec("stage", "fsdp")
    losses, sharded, grads = _linen_train(sharded, jlinen.value_and_grad, model.apply)
    _assert_grads_match(js.unshard(grads), ref_grads)  # the head's too: AdamW's steps would hide its scale
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert not np.any(np.asarray(sharded["blocks"]["mlp"]["kernel"])[layers:])
    full = js.unshard(sharded)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), full, ref_params)
    evaluated = model.apply({"params": full}, _batch()["x"])  # outside the step: the nn.scan
    np.testing.assert_allclose(evaluated, reference.apply({"params": ref_params}, _batch()["x"]), rtol=1e-5, atol=1e-6)


class LinenWrappedHead(nn.Module):
    """A model whose head is wrapped as its own unit and called in the stack's 1F1B loss: refused."""

    stack: Any
    head: Any

    @nn.compact
    def __call__(self, x, y):
        head = self.head(D_OUT, name="w_out")
        return self.stack(name="blocks")(x, y, lambda h, y: jnp.mean((head(h) - y) ** 2))


def test_linen_pipeline_misuse_is_named():
    mesh = _mesh()
    root = jlinen.fully_shard(LinenModel, mesh=mesh, policy=js.FullyShardPolicy(dp_mesh_dims=STAGE_FSDP))
    model = root(stack=jlinen.pipeline(LinenBlock, length=LAYERS))
    params = LinenModel().init(jax.random.key(0), _batch()["x"])["params"]
    sharded = jlinen.shard_params(model, params, _batch()["x"])
    loss_fn = lambda p, b: jnp.mean(model.apply({"params": p}, b["x"]))  # noqa: E731
    with pytest.raises(ValueError, match=r"The pipeline stack at `blocks` is not a unit of the step: .* its block "
                                         r"wrapped with jshard.flax.linen.fully_shard"):
        jax.jit(jlinen.value_and_grad(loss_fn))(sharded, _batch())
    stage_fsdp = js.FullyShardPolicy(dp_mesh_dims=STAGE_FSDP)
    block = jlinen.fully_shard(LinenBlock, mesh=mesh, policy=js.FullyShardPolicy(dp_mesh_dims=FSDP))
    model = jlinen.fully_shard(LinenWrappedHead, mesh=mesh, policy=stage_fsdp)(
        jlinen.pipeline(block, length=LAYERS, policy=js.PipelinePolicy(schedule="1f1b")),
        jlinen.fully_shard(nn.Dense, mesh=mesh, policy=stage_fsdp))
    x, y = jnp.ones((BATCH, D)), _batch()["y"]
    sharded = jlinen.shard_params(model, model.init(jax.random.key(0), x, y)["params"], x, y)
    with pytest.raises(ValueError, match=r"Linen module at `w_out` is wrapped with jshard.flax.linen.fully_shard and "
                                         r"was called in the loss of a jlinen.pipeline stack under "
                                         r"PipelinePolicy\(schedule='1f1b'\): its params \(`bias` of shape \(3,\), "
                                         r"...\) are sharded over mesh axis \('stage', 'fsdp'\) of size 8, .* Make it "
                                         r"a plain submodule of the wrapped root"):
        jax.jit(jlinen.value_and_grad(lambda p, b: model.apply({"params": p}, b[0], b[1])))(sharded, (x, y))


DOCS_BLOCKS = [("pipeline-nnx-example", "True"), ("pipeline-linen-example", "True (32, 1)")]


@pytest.mark.parametrize("marker,last", DOCS_BLOCKS)
def test_the_docs_flax_pipeline_examples_run(marker, last, capsys):
    printed = docs_example_output("docs/parallelism.md", marker, capsys)
    assert printed[:2] == ["P('stage', 'fsdp')", last]


@pytest.mark.slow  # +16 s; the default run checks the route: test_*_stack_runs_as_pipeline_stages[...-1f1b]
@pytest.mark.parametrize("one_f_one_b,after", list(zip(["pipeline-nnx-1f1b-example", "pipeline-linen-1f1b-example"],
                                                       DOCS_BLOCKS, strict=True)))
def test_the_docs_flax_1f1b_examples_continue_the_gpipe_ones(one_f_one_b, after, capsys):
    """Each 1F1B block, run after its GPipe block in the same namespace: the one-device loss and head gradients."""
    printed = docs_example_output("docs/parallelism.md", one_f_one_b, capsys, after=after[0])
    assert printed[:3] == ["P('stage', 'fsdp')", after[1], "True True"]
