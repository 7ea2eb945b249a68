"""Step features: accumulation placement, policy hooks, precision casts, aux, errors."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import constant_divisors

import jshard as js
from jshard._report.hlo import hlo_collectives, lowered_collectives

X = jnp.asarray(np.random.default_rng(0).normal(size=(32, 6)), jnp.float32)


def _params():
    return {"w": jnp.asarray(np.random.default_rng(1).normal(size=(6, 5)), jnp.float32), "s": jnp.asarray(0.5)}


def _loss(p, x):
    return jnp.mean(jnp.tanh(x @ p["w"]) ** 2) * p["s"]


def _reference_grads():
    return jax.grad(_loss)(_params(), X)


def _grads(policy=None, mesh=None, **kwargs):
    sharded = js.fully_shard(_params(), mesh, policy)
    loss, grads = jax.jit(js.value_and_grad(_loss, **kwargs))(sharded, X)
    return loss, js.unshard(grads)


def _lowered(policy) -> str:
    return jax.jit(js.value_and_grad(_loss)).lower(js.fully_shard(_params(), None, policy), X).as_text()


@pytest.mark.parametrize("sync", [True, False])
def test_accumulation_reduces_per_microbatch_or_once_per_step(sync):
    sharded = js.fully_shard(_params())
    step = jax.jit(js.value_and_grad(_loss, microbatches=4, requires_gradient_sync=sync))
    collectives = hlo_collectives(step.lower(sharded, X).compile().as_text())
    scatters = [c for c in collectives if c.kind == "reduce-scatter"]
    assert len(scatters) == 1
    assert scatters[0].in_loop == sync  # inside the microbatch loop, or once after it
    _, grads = step(sharded, X)
    np.testing.assert_allclose(js.unshard(grads)["w"], _reference_grads()["w"], rtol=1e-5, atol=1e-6)


def test_hsdp_all_reduce_once_per_step():
    mesh = js.make_mesh(replicate=2)
    sharded = js.fully_shard(_params(), mesh)
    step = jax.jit(js.value_and_grad(_loss, microbatches=2, requires_all_reduce=False))
    collectives = hlo_collectives(step.lower(sharded, X).compile().as_text())
    replicas = "{{0,4},{1,5},{2,6},{3,7}}"
    over_replicas = [c for c in collectives if c.kind == "all-reduce" and c.replica_groups == replicas]
    assert over_replicas and not any(c.in_loop for c in over_replicas)
    assert any(c.kind == "reduce-scatter" and c.in_loop for c in collectives)
    np.testing.assert_allclose(js.unshard(step(sharded, X)[1])["w"], _reference_grads()["w"], rtol=1e-5, atol=1e-6)


def test_gradient_divide_factor_and_force_sum():
    ref = _reference_grads()["w"]
    _, halved = _grads(js.FullyShardPolicy(gradient_divide_factor=16.0))
    np.testing.assert_allclose(halved["w"], ref / 2, rtol=1e-5, atol=1e-6)
    _, forced = _grads(js.FullyShardPolicy(force_sum_reduction_for_comms=True))
    np.testing.assert_allclose(forced["w"], ref, rtol=1e-5, atol=1e-6)
    plain, split = (constant_divisors(_lowered(js.FullyShardPolicy(force_sum_reduction_for_comms=force)))
                    for force in (False, True))
    # each of the two gradients (w, s) is divided by 4 before its sum and by 2 after, not by 8 after
    assert split - plain == {4.0: 2, 2.0: 2} and plain - split == {8.0: 2}
    mp16 = js.MixedPrecisionPolicy(reduce_dtype=jnp.float16)
    _, fp16 = _grads(js.FullyShardPolicy(mp_policy=mp16))
    np.testing.assert_allclose(fp16["w"], ref, rtol=2e-3, atol=1e-4)


def test_custom_reduce_scatter_and_all_reduce_hook_replace_the_collectives():
    calls = collections.Counter()

    def scatter(g, axes, dim):
        calls["scatter"] += 1
        return jax.lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True) * 3.0

    def hook(g, axes):
        calls["hook", axes] += 1
        return (jax.lax.psum(g, axes) if axes else g) * 2.0

    policy = js.FullyShardPolicy(custom_reduce_scatter=scatter, all_reduce_hook=hook)
    _, grads = _grads(policy, js.make_mesh(replicate=2))
    ref = _reference_grads()
    np.testing.assert_allclose(grads["w"], ref["w"] * 6.0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads["s"], ref["s"] * 2.0, rtol=1e-5)
    assert calls["scatter"] == 1 and calls["hook", ("replicate",)] == 2


def test_int8_all_gather_error_is_within_its_bound():
    params = {"w": jnp.asarray(np.random.default_rng(2).normal(size=(40, 300)), jnp.float32)}
    sharded = js.fully_shard(params, policy=js.FullyShardPolicy(custom_all_gather=js.int8_all_gather))
    gather = jax.shard_map(lambda x: js.int8_all_gather(x, ("fsdp",), 0), mesh=js.make_mesh(),
                           in_specs=jax.P("fsdp"), out_specs=jax.P(), check_vma=False)
    exact = np.asarray(params["w"])
    err = np.abs(np.asarray(gather(sharded["w"])) - exact).reshape(8, 1500)  # one row per device's shard
    blocks = np.pad(np.abs(exact).reshape(8, 1500), ((0, 0), (0, 36))).reshape(8, 6, 256)
    bound = np.repeat(blocks.max(-1) / 254, 256, axis=1)[:, :1500]  # max|block| / 254 per element
    assert (err <= bound * (1 + 1e-6)).all() and err.max() > 0

    def loss(p, x):
        return jnp.mean((x @ js.unshard(p)["w"]) ** 2)

    x = jnp.ones((8, 40))
    quantised, _ = jax.jit(js.value_and_grad(loss, unshard_params=False))(sharded, x)
    np.testing.assert_allclose(quantised, jnp.mean((x @ params["w"]) ** 2), rtol=2e-2)


def test_mixed_precision_casts_inputs_and_outputs():
    mp = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32, output_dtype=jnp.float32)
    seen = {}

    def loss(p, x):
        seen["x"], seen["w"] = x.dtype, p["w"].dtype
        return jnp.mean(jnp.tanh(x.astype(p["w"].dtype) @ p["w"]) ** 2) * p["s"]

    sharded = js.fully_shard(_params(), policy=js.FullyShardPolicy(mp_policy=mp))
    value, grads = jax.jit(js.value_and_grad(loss))(sharded, X)
    assert seen == {"x": jnp.bfloat16, "w": jnp.bfloat16}
    assert value.dtype == jnp.float32 and grads["w"].dtype == jnp.float32
    np.testing.assert_allclose(js.unshard(grads)["w"], _reference_grads()["w"], rtol=5e-2, atol=5e-3)
    no_cast = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, cast_forward_inputs=False)
    sharded = js.fully_shard(_params(), policy=js.FullyShardPolicy(mp_policy=no_cast))
    jax.jit(js.value_and_grad(loss))(sharded, X)
    assert seen["x"] == jnp.float32


def test_aux_is_averaged_and_integer_aux_summed():
    def loss(p, x):
        value = _loss(p, x)
        return value, {"mean": value, "count": jnp.asarray(x.shape[0], jnp.int32)}

    sharded = js.fully_shard(_params())
    (value, aux), _ = jax.jit(js.value_and_grad(loss, has_aux=True, microbatches=2))(sharded, X)
    np.testing.assert_allclose(aux["mean"], value, rtol=1e-6)
    assert int(aux["count"]) == 32


def test_ignored_and_integer_leaves_get_zero_gradients():
    params = {"w": jnp.ones((6, 5)), "frozen": jnp.ones((5,)), "ids": jnp.arange(3)}
    policy = js.FullyShardPolicy(ignored_params=lambda path, leaf: "frozen" in jax.tree_util.keystr(path))
    sharded = js.fully_shard(params, policy=policy)

    def loss(p, x):
        return jnp.mean((x @ p["w"] + p["frozen"]) ** 2) + p["ids"].sum().astype(jnp.float32) * 0.0

    _, grads = jax.jit(js.value_and_grad(loss))(sharded, X)
    assert not np.asarray(grads["frozen"]).any() and grads["frozen"].shape == (5,)
    assert grads["ids"].dtype == jnp.int32 and not np.asarray(grads["ids"]).any()
    assert np.asarray(grads["w"]).any()


def test_step_errors():
    sharded = js.fully_shard(_params())
    grad_fn = js.value_and_grad(_loss)
    batch_error = (r"Batch leaf \['x'\] of shape \(12, 6\): dim 0 is split over the data-parallel mesh axes "
                   r"\('fsdp',\) \(size 8\) into 1 microbatch\(es\), so it must be a multiple of 8")
    with pytest.raises(ValueError, match=batch_error):
        js.value_and_grad(lambda p, b: _loss(p, b["x"]))(sharded, {"x": jnp.ones((12, 6))})
    with pytest.raises(ValueError, match=r"The batch of shape \(36, 6\): .* 2 microbatch\(es\), .* multiple of 16"):
        js.value_and_grad(_loss, microbatches=2)(sharded, jnp.ones((36, 6)))
    with pytest.raises(ValueError, match=r"got no FSDPUnit"):
        grad_fn(_params(), X)
    with pytest.raises(ValueError, match=r"belongs to no unit"):
        grad_fn({"unit": sharded, "loose": jnp.ones(3)}, X)
    other = js.fully_shard(_params(), js.make_mesh(devices=jax.devices()[:4]))
    with pytest.raises(ValueError, match=r"share a mesh"):
        grad_fn({"a": sharded, "b": other}, X)
    with pytest.raises(ValueError, match=r"`microbatches` must be a positive int"):
        js.value_and_grad(_loss, microbatches=0)
    with pytest.raises(ValueError, match=r"`backward_prefetch` must be a bool, got 'post'"):
        js.value_and_grad(_loss, backward_prefetch="post")

    def closes_over(p, x):
        return jnp.sum(js.unshard(sharded)["w"])

    with pytest.raises(ValueError, match=r"not passed to this step"):
        js.value_and_grad(closes_over, unshard_params=False)(js.fully_shard(_params()), X)
    with pytest.raises(ValueError, match=r"js.scan takes one FSDPUnit made with FullyShardPolicy\(scan_axis=0\)"):
        js.scan(lambda c, x: (c, None), 0.0, sharded)


@pytest.mark.parametrize("kwargs", [{}, {"unshard_params": False}, {"microbatches": 2},
                                    {"requires_gradient_sync": False}], ids=["full", "units", "micro", "deferred"])
def test_gradients_have_exactly_the_structure_and_metas_of_sharded(kwargs):
    """Inside the step the units' metas are marked (``step_reshard``); the gradients leave unmarked."""
    sharded = js.fully_shard({"block": js.fully_shard(_params()), "b": jnp.ones((3,))})

    def loss(p, x):
        if kwargs.get("unshard_params", True):
            root, block = p, p["block"]
        else:
            root = js.unshard(p)
            block = js.unshard(root["block"])
        return jnp.mean(x @ block["w"]) * block["s"] + jnp.sum(root["b"] ** 2)

    _, grads = jax.jit(js.value_and_grad(loss, **kwargs))(sharded, X)
    assert jax.tree.structure(grads) == jax.tree.structure(sharded)  # aux data included: the metas are the units'


def test_scan_in_the_global_view_runs_the_full_stack():
    stack = {"w": jnp.ones((3, 4, 4)) * 0.5}
    sharded = js.fully_shard(stack, policy=js.FullyShardPolicy(scan_axis=0))
    out, _ = js.scan(lambda h, layer: (h @ layer["w"], None), jnp.ones((2, 4)), sharded)
    ref, _ = jax.lax.scan(lambda h, layer: (h @ layer["w"], None), jnp.ones((2, 4)), stack)
    np.testing.assert_allclose(out, ref)


def test_lowered_dtypes_of_bf16_reduce():
    mp = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16)
    sharded = js.fully_shard(_params(), policy=js.FullyShardPolicy(mp_policy=mp))
    lowered = jax.jit(js.value_and_grad(_loss)).lower(sharded, X)
    found = set(lowered_collectives(lowered.as_text()))
    assert ("all-gather", "bfloat16") in found and ("reduce-scatter", "bfloat16") in found


def test_the_ordering_dependence_is_exactly_zero_even_for_non_finite_sources():
    """_remat.depend adds a zero read from its sources: never NaN, also under vmap (batched sources)."""
    from jshard._step.remat import depend

    x = jnp.arange(12.0).reshape(3, 4)
    sources = jnp.array([[1.0, 2.0], [jnp.inf, 5.0], [jnp.nan, 1.0]])
    assert jnp.array_equal(depend(x, [sources[2]]), x)
    assert jnp.array_equal(jax.vmap(lambda x, s: depend(x, [s]))(x, sources), x)
    assert jnp.array_equal(jax.vmap(lambda s: depend(x[0], [s]))(sources), jnp.broadcast_to(x[0], (3, 4)))
