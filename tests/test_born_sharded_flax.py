"""Born sharded through the Flax adapters and Optax: an NNX model built under ``nnx.jit``, a Linen
``model.init`` under ``jax.jit``, and the optimizer state made there, all split like the eager route."""

import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax_behaviour import ZEROS_DROP_THE_SPLIT, zeros_follow_explicit_types

import jshard as js
from jshard.flax import linen as jlinen
from jshard.flax import nnx as jnnx


def assert_same_placement_and_values(traced, eager):
    assert jax.tree.structure(traced) == jax.tree.structure(eager)  # units, metas and layouts included
    for (path, x), y in zip(jax.tree.leaves_with_path(traced), jax.tree.leaves(eager), strict=True):
        where = jax.tree_util.keystr(path)
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (where, x.sharding, y.sharding)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=where)


def assert_state_split_like(state, params):
    """Adam's mu and nu (every state leaf but the counts) are split over "fsdp" like the parameters."""
    mirrored = [x for x in jax.tree.leaves(state) if x.ndim]
    assert len(mirrored) == 2 * len([x for x in jax.tree.leaves(params) if x.ndim])
    for x in mirrored:
        assert "fsdp" in jax.tree.leaves(tuple(x.sharding.spec)), (x.shape, x.sharding)


class Block(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(20, 36, rngs=rngs)
        self.down = nnx.Linear(36, 20, rngs=rngs)


class Model(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])
        self.head = nnx.Linear(20, 10, rngs=rngs)


@pytest.mark.parametrize("wrap", ["shard_optimizer", "plain"])
def test_nnx_model_built_under_nnx_jit_is_split_with_its_optimizer(wrap):
    mesh = js.make_mesh()

    def build():
        model = Model(nnx.Rngs(0))
        for block in model.blocks:
            jnnx.fully_shard(block, mesh)
        model = jnnx.fully_shard(model, mesh)
        tx = jnnx.shard_optimizer(model, optax.adam(1e-3)) if wrap == "shard_optimizer" else optax.adam(1e-3)
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    (model, optimizer), (eager, _) = nnx.jit(build)(), build()
    assert model.blocks[0].up.kernel.get_value().sharding.spec[0] == "fsdp"
    params = nnx.state(model, nnx.Param)
    assert_same_placement_and_values(params, nnx.state(eager, nnx.Param))
    if wrap == "plain" and not zeros_follow_explicit_types():
        pytest.xfail(ZEROS_DROP_THE_SPLIT)
    assert_state_split_like(nnx.state(optimizer, nnx.optimizer.OptState), params)


class MLP(nn.Module):
    mesh: jax.sharding.Mesh

    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = jlinen.fully_shard(nn.Dense, mesh=self.mesh)(36, name=f"block{i}")(x)
        return nn.Dense(10)(x)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_linen_init_under_jit_is_split_with_its_optimizer(axis_type):
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(axis_type,))
    model, x = jlinen.fully_shard(MLP, mesh=mesh)(mesh), jnp.ones((8, 20))
    tx = js.shard_optimizer(optax.adam(1e-3))

    def build(key):
        params = jlinen.shard_params(model, model.init(key, x)["params"], x)
        return params, tx.init(params)

    key = jax.random.key(0)
    (params, state), (eager, _) = jax.jit(build)(key), build(key)
    assert_same_placement_and_values(params, eager)
    assert_state_split_like(state, params)


def hf_snippet() -> str:
    text = (pathlib.Path(__file__).parents[1] / "docs" / "born_sharded.md").read_text()
    return re.search(r"<!-- hf-born-sharded -->\s*```python\n(.*?)```", text, re.S).group(1)


def test_hugging_face_init_weights_under_jit_is_split_like_the_eager_route():
    """docs/born_sharded.md's block on a tiny GPT-2, against init_weights on one device, then shard_params.

    The unsharded init is jitted too: run op by op, Hugging Face's ``normal * std`` rounds differently from
    XLA's fused kernel (1 ulp), whatever the sharding."""
    import transformers
    from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2Block

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=61, n_positions=16)
    input_ids = jnp.zeros((8, 12), jnp.int32)
    scope = {"model_class": transformers.FlaxGPT2LMHeadModel, "config": config, "Layer": FlaxGPT2Block,
             "input_ids": input_ids}
    with jax.numpy_dtype_promotion("standard"):
        exec(hf_snippet(), scope)
        model, units = scope["model"], scope["units"]
        eager = jlinen.shard_params(lambda p, ids: model(ids, params=p),
                                    jax.jit(model.init_weights, static_argnums=1)(jax.random.key(0), input_ids.shape),
                                    input_ids, units=units)
    params = scope["params"]
    assert jax.tree.structure(params) == jax.tree.structure(eager)  # the same units, with the same layouts
    assert params["transformer"]["h"]["0"]["attn"]["c_attn"]["kernel"].sharding.spec[0] == "fsdp"
    assert_same_placement_and_values(params, eager)


class TensorParallelMLP(nn.Module):
    mesh: jax.sharding.Mesh

    @nn.compact
    def __call__(self, x):
        kernel_init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "tp"))
        h = jlinen.fully_shard(nn.Dense, mesh=self.mesh)(32, kernel_init=kernel_init, name="up")(x)
        return nn.Dense(4)(h)


def test_linen_params_split_over_tp_by_their_metadata_keep_it_under_jit():
    """The kernel boxed over "tp" gets the FSDP split too, as eagerly (main gave P(None, 'tp') under jit)."""
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    model, x = jlinen.fully_shard(TensorParallelMLP, mesh=mesh)(mesh), jnp.ones((8, 16))

    def build(key):
        return jlinen.shard_params(model, model.init(key, x)["params"], x)

    key = jax.random.key(0)
    params, eager = jax.jit(build)(key), build(key)
    assert tuple(params["up"]["kernel"].sharding.spec) == tuple(eager["up"]["kernel"].sharding.spec) == ("fsdp", "tp")
    assert_same_placement_and_values(params, eager)
