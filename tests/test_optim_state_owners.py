"""shard_optimizer ties each Optax state leaf to its parameter by the state's structure.

Names and shapes are no evidence: two parameters may share both. A state leaf sits in a copy
of the parameters' tree (or of one of its subtrees), and that place says whose it is; where
the structure fits several parameters placed differently, the answer is an error.
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jshard as js
from jshard._state.stored_leaves import stored_leaves
from jshard.optim import shard_optimizer


def _split_on(dim):
    return js.FullyShardPolicy(shard_placement_fn=lambda path, leaf: dim)


def _two_ws(enc_dim=1, dec_dim=0):
    """Two parameters named ``w``, of one shape, at different paths, split on dims ``enc_dim`` and ``dec_dim``."""
    w = jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8)
    policies = {dim: _split_on(dim) for dim in (enc_dim, dec_dim)}  # one policy where the dims are one
    return js.fully_shard({"enc": js.fully_shard({"w": w}, policy=policies[enc_dim]),
                           "dec": js.fully_shard({"w": w + 1}, policy=policies[dec_dim])})


def _init(tx, params):
    with jax.numpy_dtype_promotion("standard"):
        return shard_optimizer(tx).init(params)


def _on_dec(inner):
    """A transformation that keeps ``inner``'s state for ``params['dec']`` only, as a tree of its own."""

    def init(params):
        return inner.init(params["dec"])

    def update(updates, state, params=None):
        dec, state = inner.update(updates["dec"], state, None if params is None else params["dec"])
        return {**updates, "dec": dec}, state

    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("tx", [optax.adam(1e-2), optax.masked(optax.adam(1e-2), {"enc": True, "dec": False}),
                                optax.sm3(1e-2)], ids=["adam", "masked", "sm3"])
def test_state_of_same_named_same_shaped_parameters_follows_its_own(tx):
    params = _two_ws()
    placed = {"['enc']['w']": params["enc"]["w"].sharding, "['dec']['w']": params["dec"]["w"].sharding}
    assert not placed["['enc']['w']"].is_equivalent_to(placed["['dec']['w']"], 2)
    state = [r for r in stored_leaves(_init(tx, params)) if r.name.endswith(tuple(placed))]
    assert state, "no state leaf of either parameter"
    for record in state:
        if record.shape == (16, 8):  # Adam's moments mirror their parameter
            assert record.leaf.sharding.is_equivalent_to(placed[record.name[-len("['enc']['w']"):]], 2), record.name


def test_a_state_leaf_that_ends_like_another_parameter_belongs_to_its_own():
    """SM3's accumulator ``mu[1][0]`` of parameter ``[1]`` (8, 8) ends with the key path and shape of
    parameter ``[0]`` (8,); it is ``[1]``'s, so below ``min_size_to_shard`` it stays whole."""
    state = {r.name: r for r in stored_leaves(_init(optax.sm3(1e-2), js.fully_shard([jnp.ones(8), jnp.ones((8, 8))])))}
    assert state["[0].mu[1][0]"].leaf.sharding.is_fully_replicated
    assert state["[0].mu[1][1]"].leaf.sharding.is_fully_replicated
    assert state["[0].mu[0][0]"].leaf.sharding.spec == P("fsdp")  # [0]'s own accumulator mirrors it


def test_the_state_of_parameters_that_are_one_array_mirrors_it():
    params = js.fully_shard(jnp.ones((16, 8)))
    state = _init(optax.adam(1e-2), params)
    assert jax.tree.leaves(state[0].mu)[0].sharding.is_equivalent_to(jax.tree.leaves(params)[0].sharding, 2)
    assert jax.tree.leaves(state[0].count)[0].sharding.is_fully_replicated


def test_a_state_that_fits_parameters_placed_differently_is_an_error():
    with pytest.raises(ValueError, match=r"(?s)state leaf \[0\]\.mu\['w'\] of shape \(16, 8\).*placed differently "
                                         r"\(\['dec'\]\['w'\], \['enc'\]\['w'\].*optax\.masked.*parameters alike"):
        _init(_on_dec(optax.adam(1e-2)), _two_ws())


def test_a_state_that_fits_parameters_placed_alike_takes_their_placement():
    state = _init(_on_dec(optax.adam(1e-2)), _two_ws(enc_dim=0, dec_dim=0))
    assert jax.tree.leaves(state[0].mu["w"])[0].sharding.spec == P("fsdp", None)
