"""``FullyShardPolicy(replicate_below=k)``: leaves under ``k`` elements stay whole on every device.

The test model (tests/model.py) at ``k = 16``: ``block0.b`` (15,), the stack's ``b`` (7 per
layer) and the root's ``one`` (1,) are kept whole; every matrix stays sharded.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec
from model import batches, init_params, loss_fn, shard, train_reference, train_sharded

import jshard as js
from jshard.report import step_report

STEPS = 6
WHOLE = js.FullyShardPolicy(replicate_below=16)
SMALL = {"['block0']['b']", "['stack']['b']", "['one']", "['scale']"}  # and the 0-d scale, as always


@pytest.fixture(scope="module")
def reference():
    return train_reference(init_params(), batches(STEPS))


def _close(reference, losses, sharded, tol=1e-5):
    ref_losses, ref_params = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=tol, atol=tol)
    for (path, got), want in zip(jax.tree.flatten_with_path(js.unshard(sharded))[0], jax.tree.leaves(ref_params),
                                 strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol, err_msg=str(path))


def _stored(sharded) -> dict[str, jax.Array]:
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree.flatten_with_path(sharded)[0]}


def test_small_leaves_are_stored_whole_and_the_rest_sharded():
    stored = _stored(shard(init_params(), js.make_mesh(), WHOLE))
    whole = {key for key, leaf in stored.items() if leaf.sharding.spec == PartitionSpec()}
    assert whole == SMALL
    for key in SMALL - {"['scale']"}:
        leaf = stored[key]
        assert leaf.addressable_shards[0].data.shape == leaf.shape, key  # every device holds all of it
    default = _stored(shard(init_params(), js.make_mesh()))
    assert {key for key, leaf in default.items() if leaf.sharding.spec == PartitionSpec()} == {"['scale']"}


@pytest.mark.parametrize("replicate", [1, 2], ids=["fsdp", "hsdp"])
@pytest.mark.parametrize("raf", [True, False, 2], ids=lambda r: f"raf={r}")
def test_parity_with_small_leaves_whole(reference, raf, replicate):
    policy = dataclasses.replace(WHOLE, reshard_after_forward=raf)
    losses, sharded, _, _ = train_sharded(shard(init_params(), js.make_mesh(replicate=replicate), policy),
                                          batches(STEPS))
    _close(reference, losses, sharded)


@pytest.mark.parametrize("options", [{"unit_collectives": True}, {"remat": True}, {"microbatches": 2}], ids=str)
def test_parity_with_small_leaves_whole_and_step_options(reference, options):
    policy = dataclasses.replace(WHOLE, unit_collectives=options.get("unit_collectives", False))
    kwargs = {"remat_policy": jax.checkpoint_policies.nothing_saveable} if "remat" in options else {}
    kwargs |= {"microbatches": options["microbatches"]} if "microbatches" in options else {}
    losses, sharded, _, _ = train_sharded(shard(init_params(), js.make_mesh(), policy), batches(STEPS), **kwargs)
    _close(reference, losses, sharded)


def test_mixed_precision_and_offload_train_as_with_every_leaf_sharded():
    """bf16 gathers with f32 reductions, and CPU offload: the same losses and parameters as the
    same policy with every leaf sharded (whole leaves are cast like gathered ones, and stay on
    the device under offload, as 0-d leaves do)."""
    mp = js.FullyShardPolicy(mp_policy=js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32))
    offload = js.FullyShardPolicy(offload_policy=js.CPUOffloadPolicy())
    for policy, tx in ((mp, None), (offload, js.offload_optimizer(optax.sgd(0.1, momentum=0.9)))):
        base, base_params, *_ = train_sharded(shard(init_params(), js.make_mesh(), policy), batches(STEPS), tx)
        losses, params, grads, _ = train_sharded(
            shard(init_params(), js.make_mesh(), dataclasses.replace(policy, replicate_below=16)), batches(STEPS), tx)
        np.testing.assert_allclose(losses, base, rtol=1e-5)
        got, want = jax.tree.leaves(js.unshard(params)), jax.tree.leaves(js.unshard(base_params))
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    stored = _stored(params)
    assert {stored[key].sharding.memory_kind for key in SMALL} == {"device"}
    assert {leaf.sharding.memory_kind for key, leaf in stored.items() if key not in SMALL} == {"pinned_host"}


def test_whole_leaves_are_never_gathered_and_their_gradients_all_reduced():
    """In the compiled step the matrices alone are gathered (the stack whole, on CPU) and
    reduce-scattered; the small leaves' gradients go in one all-reduce with the loss, at the
    analytic figure. With every leaf sharded the small leaves are gathered too."""
    x = {"x": jax.ShapeDtypeStruct((32, 16), jnp.float32), "y": jax.ShapeDtypeStruct((32, 15), jnp.float32)}
    matrices = {(24, 15), (16, 7), (3, 8, 7), (16, 17), (8, 15)}  # padded to 8 rows (16 for (15, 7))

    def report_and_gathers(policy):
        report = step_report(js.value_and_grad(loss_fn), shard(init_params(), js.make_mesh(), policy), x)
        return report, {shape for c in report.collectives if c.kind == "all-gather" for shape in c.shapes}

    report, gathered = report_and_gathers(WHOLE)
    assert gathered == matrices
    assert len([c for c in report.collectives if c.kind == "reduce-scatter"]) == len(matrices)
    assert report.analytic.all_reduce == 4 * 2 * 7 / 8 * (15 + 3 * 7 + 1 + 1)  # three small leaves and the 0-d
    loss = 4 * 2 * 7 / 8  # the loss scalar's own all-reduce
    assert report.collective_bytes["all-reduce"] == report.analytic.all_reduce + loss
    _, gathered = report_and_gathers(js.FullyShardPolicy())
    assert gathered == matrices | {(16,), (3, 8), (8,)}  # block0.b padded, the stack's b, one


@pytest.mark.parametrize("bad", [-1, True, 2.5, "16"])
def test_replicate_below_must_be_a_non_negative_int(bad):
    with pytest.raises(ValueError, match=r"`replicate_below` must be a non-negative int \(a number of elements\)"):
        js.FullyShardPolicy(replicate_below=bad)


def test_leaves_split_over_model_axes_stay_sharded():
    """A small bias that arrives split over a tensor-parallel axis keeps its FSDP split too;
    an unsplit one of the same size is kept whole."""
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    tp_bias = jax.device_put(jnp.ones(8), jax.sharding.NamedSharding(mesh, PartitionSpec("tp")))
    unit = js.fully_shard({"tp_bias": tp_bias, "bias": jnp.ones(8)}, mesh, WHOLE)
    assert unit["tp_bias"].sharding.spec == PartitionSpec(("fsdp", "tp"))
    assert unit["bias"].sharding.spec == PartitionSpec()


def test_born_sharded_inside_jit_gives_the_eager_layout_and_values():
    """Traced inside ``jax.jit`` (a model initialised there), the whole leaves come out whole and
    the rest sharded, with the eager values."""
    mesh = js.make_mesh()
    eager = js.fully_shard(init_params(), mesh, WHOLE)
    born = jax.jit(lambda: js.fully_shard(init_params(), mesh, WHOLE))()
    for (path, got), want in zip(jax.tree.flatten_with_path(born)[0], jax.tree.leaves(eager), strict=True):
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim), jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert born["block0"]["b"].sharding.is_fully_replicated and not born["block0"]["w"].sharding.is_fully_replicated
