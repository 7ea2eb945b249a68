"""Communication hooks are typed protocols (FSDP2's ``AllGather`` / ``ReduceScatter``): a policy's
hook is the collective the step runs, and a hook that cannot be called as one is refused."""

import collections

import jax
import jax.numpy as jnp
import pytest

import jshard as js
from jshard._report.hlo import lowered_collectives


class Bfloat16AllGather:
    """A js.AllGather that sends bfloat16 over the wire."""

    def __call__(self, shard, axes, dim):
        return js.collectives.all_gather(shard.astype(jnp.bfloat16), axes, dim).astype(shard.dtype)


class Bfloat16ReduceScatter:
    """A js.ReduceScatter that sums in bfloat16."""

    def __call__(self, grad, axes, dim):
        return js.collectives.reduce_scatter(grad.astype(jnp.bfloat16), axes, dim).astype(grad.dtype)


class Bfloat16AllReduce:
    """A js.AllReduce that sums in bfloat16."""

    def __call__(self, grad_shard, axes):
        return js.collectives.all_reduce(grad_shard.astype(jnp.bfloat16), axes).astype(grad_shard.dtype)


def _collectives(policy):
    """``(kind, dtype)`` counts of one HSDP step's lowered program, for one float32 unit."""
    sharded = js.fully_shard({"w": jnp.ones((16, 8))}, js.make_mesh(replicate=2), policy)

    def loss(p, x):
        return jnp.mean((x @ js.unshard(p)["w"]) ** 2)

    lowered = jax.jit(js.value_and_grad(loss, unshard_params=False)).lower(sharded, jnp.ones((8, 16)))
    return collections.Counter(lowered_collectives(lowered.as_text()))


def test_the_built_in_collectives_satisfy_the_protocols():
    assert all(isinstance(f, js.AllGather) for f in (js.collectives.all_gather, js.int8_all_gather,
                                                      js.float8_all_gather, Bfloat16AllGather()))
    assert isinstance(js.collectives.reduce_scatter, js.ReduceScatter)
    assert isinstance(js.collectives.all_reduce, js.AllReduce)


def test_custom_hooks_are_the_collectives_the_step_runs():
    plain = _collectives(js.FullyShardPolicy())
    custom = _collectives(js.FullyShardPolicy(custom_all_gather=Bfloat16AllGather(),
                                              custom_reduce_scatter=Bfloat16ReduceScatter(),
                                              all_reduce_hook=Bfloat16AllReduce()))
    assert not any(dtype == "bfloat16" for _, dtype in plain)
    for kind in ("all-gather", "reduce-scatter"):
        assert plain[kind, "float32"] >= 1 and custom[kind, "bfloat16"] == plain[kind, "float32"], kind
        assert not custom[kind, "float32"], kind
    assert custom["all-reduce", "bfloat16"] == 1  # the gradient over the replicate axis; the loss stays float32
    assert custom["all-reduce", "float32"] == plain["all-reduce", "float32"] - 1


@pytest.mark.parametrize("field, hook, message", [
    ("custom_all_gather", lambda shard: shard, r"`custom_all_gather` must be called as hook\(shard, axes, dim\), "
                                               r"as a js\.AllGather is, but <lambda>\(shard\) cannot"),
    ("custom_reduce_scatter", lambda g, axes, dim, phases: g, r"`custom_reduce_scatter` must be called as "
                                                              r"hook\(grad, axes, dim\).*missing.*phases"),
    ("all_reduce_hook", "psum", r"`all_reduce_hook` must be a js\.AllReduce \(a callable\) or None, got 'psum'"),
])
def test_a_hook_that_cannot_be_called_as_its_protocol_is_refused(field, hook, message):
    with pytest.raises(ValueError, match=message):
        js.FullyShardPolicy(**{field: hook})
