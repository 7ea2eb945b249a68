"""One step, one state: the step owns what lives for it; units keep only their static facts."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jshard as js
from jshard._sharding.step_state import IdentityMap, ShardedState, active_step
from jshard._sharding.unit import UnitMeta
from jshard.flax import nnx as jnnx

X = jnp.ones((8, 4))


def _params():
    return {"w": jnp.ones((4, 4)), "b": jnp.ones((4,))}


def test_the_step_owns_which_units_take_part_and_how_each_reshards():
    block = js.fully_shard(_params())
    root = js.fully_shard({"block": block, "head": jnp.ones((4, 2))})
    twin = js.fully_shard(_params())  # built equal to `block`, not passed to the step
    assert twin.meta == block.meta and twin.meta is not block.meta
    seen = {}

    def loss(p, x):
        step = active_step()
        seen["root"] = step.unit(p.meta).reshard_after_forward  # the root keeps its parameters
        seen["block"] = step.unit(p["block"].meta).reshard_after_forward  # inner units free them
        with pytest.raises(ValueError, match="not passed to this step"):
            step.unit(twin.meta)
        full = js.unshard(p)
        return jnp.mean(x @ js.unshard(full["block"])["w"] @ full["head"])

    _, grads = jax.jit(js.value_and_grad(loss, unshard_params=False))(root, X)
    assert seen == {"root": False, "block": True}
    assert active_step() is None  # the state lived for the step's trace only
    assert [f.name for f in dataclasses.fields(UnitMeta)] == ["mesh", "axes", "policy", "layouts"]
    assert jax.tree.structure(grads) == jax.tree.structure(root)


def test_identity_map_tells_equal_keys_apart_and_keeps_its_keys_alive():
    found = IdentityMap()
    for i in range(100):
        found[[i]] = i  # no other reference: a map keyed by bare id() would see ids reused
    assert len(found) == 100 and sorted(found.values()) == list(range(100))
    a, b = [0], [0]
    found[a] = "a"
    assert a in found and b not in found
    del found[a]
    assert a not in found


class Block(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.lin(x)


class Model(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_nnx_modules_hold_their_gathers_in_the_step_state():
    model = Model(nnx.Rngs(0))
    for block in model.blocks:
        jnnx.fully_shard(block)
    jnnx.fully_shard(model)
    model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1]])
    seen = []

    def loss(m, x):
        step = active_step()
        blocks = list(m.blocks)

        def held(module):
            return step.held[module].state if module in step.held else None

        def spy(module, x):  # each block's forward: its own state and the other block's
            seen.append((blocks.index(module), held(module), held(blocks[1 - blocks.index(module)])))
            return module.lin(x)

        blocks[0].unshard()
        seen.append(held(blocks[0]))
        Block.__call__ = spy
        try:
            y = m(x)  # the first block uses its explicit gather (and so prefetches nothing)
            blocks[0].reshard()
            seen.append(held(blocks[0]))
            y = y + m(x)  # now the first block gathers for its forward and prefetches the second
        finally:
            Block.__call__ = call
        return jnp.mean(y)

    call = Block.__call__
    nnx.jit(jnnx.value_and_grad(loss))(model, X)  # traced once: the states are seen at trace time
    unsharded, forward, prefetched = ShardedState.UNSHARDED, ShardedState.FORWARD, ShardedState.PREFETCHED
    assert seen == [unsharded, (0, unsharded, None), (1, forward, unsharded), None,
                    (0, forward, prefetched), (1, forward, None)]
