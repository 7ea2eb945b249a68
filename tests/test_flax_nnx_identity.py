"""A sharded NNX module is known by its path in the model, never by a process-wide counter:
two identically built models have equal graphdefs, so a rebuilt model hits ``nnx.jit``'s cache,
and prefetch targets are found where they are."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jshard.flax import nnx as jnnx

EVENTS: list = []


def _record_gather(x, axes, dim):
    if x.ndim == 2:  # a kernel
        EVENTS.append("gather")
    return jax.lax.all_gather(x, axes, axis=dim, tiled=True)


class Block(nnx.Linear):
    def __call__(self, x):
        EVENTS.append("call")
        return super().__call__(x)


class Stack(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(8, 8, rngs=rngs) for _ in range(3)])

    def __call__(self, x):
        for block in self.blocks:
            x = jnp.tanh(block(x))
        return x


class Outer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.encoder = Stack(rngs)
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.encoder(x))


def _built(prefetch_before_root: bool = False) -> Outer:
    """An Outer with every block, the encoder and the root sharded; block 0 prefetches block 1."""
    model = Outer(nnx.Rngs(0))
    for block in model.encoder.blocks:
        jnnx.fully_shard(block)
    jnnx.fully_shard(model.encoder)
    if prefetch_before_root:  # set while the encoder was the outermost sharded module
        model.encoder.blocks[0].set_modules_to_forward_prefetch([model.encoder.blocks[1]])
    jnnx.fully_shard(model)
    if not prefetch_before_root:
        model.encoder.blocks[0].set_modules_to_forward_prefetch([model.encoder.blocks[1]])
    model.encoder.blocks[2].set_modules_to_backward_prefetch([model.encoder.blocks[1]])
    return model


def _loss(model, x):
    return jnp.mean(model(x) ** 2)


def test_identically_built_models_have_equal_graphdefs():
    first, second = nnx.split(_built())[0], nnx.split(_built())[0]
    assert first == second and hash(first) == hash(second)


def test_a_rebuilt_model_hits_nnx_jits_cache():
    traces = []

    @nnx.jit
    def step(model, x):
        traces.append(1)
        return jnnx.value_and_grad(_loss)(model, x)

    x = jnp.ones((8, 8))
    step(_built(), x)
    step(_built(), x)
    assert len(traces) == 1


@pytest.mark.parametrize("prefetch_before_root", [False, True])
def test_prefetch_targets_are_found_by_their_path(prefetch_before_root):
    model = _built(prefetch_before_root)
    assert model.encoder.blocks[0].fsdp_state.forward_prefetch == (("encoder", "blocks", 1),)
    for block in model.encoder.blocks:
        block.set_custom_all_gather(_record_gather)
    EVENTS.clear()
    jax.eval_shape(jnnx.value_and_grad(_loss), model, jnp.ones((8, 8)))
    forward = EVENTS[: 6]  # the backward's re-gathers are traced after
    assert forward == ["gather", "gather", "call", "call", "gather", "call"]  # block 1 gathered with block 0


def test_a_target_outside_a_sharded_model_is_refused():
    model = _built()
    with pytest.raises(ValueError, match=r"modules\[0\] \(FSDPOuter\) is the outermost sharded module of "
                                         r"its model.*after jshard\.flax\.nnx\.fully_shard was applied"):
        model.encoder.blocks[0].set_modules_to_forward_prefetch([model])
