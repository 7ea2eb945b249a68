"""Optax as users write it, under js.shard_optimizer: every public transformation, masks, labels, Muon.

The cases (parameters (15, 13), (7,), (1,); 5 steps; each transformation built as a user
would) live in ``benchmarks/optax_transformations.py``, which also prints the table in
docs/optax.md. The default run covers a representative set on both meshes; the slow run
(``-m slow``) every transformation Optax exports, found at run time.
"""

import pathlib
import re

import flax.core
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jshard as js
from benchmarks import optax_transformations as T
from jshard.checkpoint import CheckpointManager
from jshard.flax import nnx as jnnx
from jshard.state_dict import full_state_dict, load_full_state_dict

MESHES = {"fsdp8": lambda: js.make_mesh(), "hsdp2x4": lambda: js.make_mesh(replicate=2)}
# One of each kind of state: masked, partitioned, Muon's, per-dim (SM3), factored, wrapped parameters,
# extra arguments (linesearch); the slow run has every transformation on both meshes.
REPRESENTATIVE = ["optax.masked", "optax.multi_transform", "optax.contrib.muon", "optax.sm3", "optax.adafactor",
                  "optax.lookahead", "optax.scale_by_backtracking_linesearch"]
ON_HSDP = ["optax.contrib.muon"]
TOLERANCE = 1e-5  # relative to 1 + |parameter|: some transformations (identity, add_noise) grow parameters


def _check(name, mesh_name):
    ref, _ = T.run_unsharded(name)
    got, state = T.run_sharded(name, MESHES[mesh_name]())
    assert T.max_relative_error(js.unshard(got), ref) <= TOLERANCE, name
    for record in T.parameter_sized(state):  # Adam's mu, Muon's momentum...: sharded like their parameter
        assert not record.leaf.sharding.is_fully_replicated, (name, record.name)
    assert all(np.size(x) < 1024 for x in jax.tree.leaves(state) if isinstance(x, jax.Array)
               and x.sharding.is_fully_replicated), name  # only small leaves stay whole on every device


@pytest.mark.parametrize("name", REPRESENTATIVE)
def test_representative_transformations_match_one_device(name):
    _check(name, "fsdp8")


@pytest.mark.parametrize("name", ON_HSDP)
def test_representative_transformations_match_one_device_on_hsdp(name):
    _check(name, "hsdp2x4")


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("name", [n for n in T.discovered() if n not in T.UNSUPPORTED])
def test_every_public_transformation_matches_one_device(name, mesh_name):
    _check(name, mesh_name)


def test_every_public_transformation_is_built_or_listed_as_unsupported():
    """Found at run time, so one that a later Optax adds is tested (or this fails and says what to add)."""
    names = T.discovered()
    assert len(names) > 100 and {"optax.adamw", "optax.contrib.muon", "optax.masked"} <= set(names)
    for name in names:
        if name not in T.UNSUPPORTED:
            assert isinstance(T.build(name), optax.GradientTransformation), name
    assert set(T.UNSUPPORTED) <= set(names)


def _train(tx, steps=3, container=dict):
    """``steps`` updates, unsharded on one device and sharded on 8; returns both final parameters."""
    stx = js.shard_optimizer(tx)

    def step(tx, grad_of, p, s):
        updates, s = tx.update(grad_of(p), s, p)
        return optax.apply_updates(p, updates), s

    plain_step = jax.jit(lambda p, s: step(tx, jax.grad(T.loss), p, s))
    sharded_step = jax.jit(lambda p, s: step(stx, lambda p: js.reshard(jax.grad(T.loss)(js.unshard(p)), p), p, s))
    params = jax.device_put(container(T.init_params()), jax.devices()[0])
    sharded = js.fully_shard(container(T.init_params()))
    with jax.numpy_dtype_promotion("standard"):
        state, sstate = tx.init(params), stx.init(sharded)
        for _ in range(steps):
            params, state = plain_step(params, state)
            sharded, sstate = sharded_step(sharded, sstate)
    return params, js.unshard(sharded)


@pytest.mark.parametrize(
    "make",
    [
        lambda: optax.adamw(1e-2, mask=T.MASK),
        lambda: (optax.adamw(1e-2, mask=flax.core.freeze(T.MASK)), flax.core.freeze),
        lambda: optax.adamw(1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
        lambda: optax.chain(optax.masked(optax.add_decayed_weights(1e-2), T.MASK),
                            optax.multi_transform({"mat": optax.adam(1e-2), "vec": optax.sgd(1e-2, 0.9)}, T.LABELS)),
        lambda: optax.multi_transform({"mat": optax.adam(1e-2), "vec": optax.set_to_zero()},
                                      lambda p: jax.tree.map(lambda x: "mat" if x.ndim > 1 else "vec", p)),
    ],
    ids=["mask-dict", "mask-frozendict", "mask-callable", "chain-masked-labels", "labels-callable"],
)
def test_masks_and_labels_written_for_the_users_tree(make):
    """As Optax's docs write them; the FrozenDict mask goes with FrozenDict parameters (Linen's)."""
    made = make()
    tx, container = (made, dict) if isinstance(made, optax.GradientTransformation) else made
    want, got = _train(tx, container=container)
    assert T.max_relative_error(got, want) <= TOLERANCE


def test_a_mask_that_cannot_match_names_the_transformation_and_the_fix():
    tx = js.shard_optimizer(optax.masked(optax.sgd(0.1), {"w": True, "typo": False}))
    with pytest.raises(ValueError, match=r"(?s)shard_optimizer\(masked\).*write masks and labels for that tree"):
        tx.init(js.fully_shard(T.init_params()))


def test_updates_that_are_not_updates_of_the_parameters_are_refused():
    tx = js.shard_optimizer(optax.measure_with_ema(optax.tree.norm, 0.9))
    params = js.fully_shard(T.init_params())
    with jax.numpy_dtype_promotion("standard"), pytest.raises(ValueError, match=r"(?s)neither the updates' nor"):
        tx.update(params, tx.init(params), params)


@pytest.mark.parametrize("name", ["optax.contrib.muon", "optax.multi_transform"])
def test_state_restores_bit_exact_onto_other_meshes(name, tmp_path):
    """Saved on 8 devices; restored (CheckpointManager, and the full state dict) onto HSDP 2 x 4 and 1 device."""
    _, state = T.run_sharded(name, js.make_mesh())
    with CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, {"opt_state": state})
    saved = full_state_dict(state)
    for mesh in (js.make_mesh(replicate=2), js.make_mesh(devices=jax.devices()[:1])):
        with jax.numpy_dtype_promotion("standard"):
            like = js.shard_optimizer(T.build(name)).init(js.fully_shard(T.init_params(), mesh))
        with CheckpointManager(tmp_path) as ckpt:
            restored = ckpt.restore({"opt_state": like})["opt_state"]
        for got in (restored, load_full_state_dict(saved, like)):
            assert jax.tree.structure(got) == jax.tree.structure(like)
            for a, b in zip(jax.tree.leaves(full_state_dict(got)), jax.tree.leaves(saved), strict=True):
                np.testing.assert_array_equal(a, b)


def test_multisteps_state_restores_bit_exact(tmp_path):
    tx = js.shard_optimizer(optax.MultiSteps(optax.adamw(1e-2, mask=T.MASK), every_k_schedule=2))
    params = js.fully_shard(T.init_params())
    update = jax.jit(lambda p, s: tx.update(js.reshard(jax.grad(T.loss)(js.unshard(p)), p), s, p)[1])
    with jax.numpy_dtype_promotion("standard"):
        state = tx.init(params)
        for _ in range(3):  # mid-accumulation: the accumulated gradient is in the state
            state = update(params, state)
        like = tx.init(js.fully_shard(T.init_params(), js.make_mesh(replicate=2)))
    with CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, state)
        restored = ckpt.restore(like)
    for a, b in zip(jax.tree.leaves(full_state_dict(restored)), jax.tree.leaves(full_state_dict(state)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_state_leaves_have_the_unsharded_states_key_paths():
    params = T.init_params()
    tx = optax.adamw(1e-2, mask=T.MASK)
    with jax.numpy_dtype_promotion("standard"):
        sharded = js.shard_optimizer(tx).init(js.fully_shard(params))
        unsharded = tx.init(params)

    def keys(tree):
        return [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]

    assert keys(full_state_dict(sharded)) == keys(unsharded)


def test_mirrored_state_keeps_the_parameters_units():
    """Adam's mu has the parameters' units and metas: jax.tree.map(f, params, mu) works."""
    params = js.fully_shard({**T.init_params(), "block": js.fully_shard({"w": jnp.ones((9, 4))})})
    with jax.numpy_dtype_promotion("standard"):
        mu = js.shard_optimizer(optax.adam(1e-2)).init(params)[0].mu
    assert jax.tree.structure(mu) == jax.tree.structure(params)
    jax.tree.map(lambda p, m: p + m, params, mu)


class _NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(13, 15, rngs=rngs)
        self.b = nnx.Linear(15, 7, rngs=rngs)

    def __call__(self, x):
        return self.b(jax.nn.relu(self.a(x)))


def _nnx_losses(tx_fn, sharded):
    model = _NNXModel(nnx.Rngs(0))
    if sharded:
        model = jnnx.fully_shard(model)
    optimizer = nnx.Optimizer(model, jnnx.shard_optimizer(model, tx_fn()) if sharded else tx_fn(), wrt=nnx.Param)
    grad_fn = (jnnx.value_and_grad if sharded else nnx.value_and_grad)(lambda m, x: jnp.mean(m(x) ** 2))

    @nnx.jit
    def step(model, optimizer, x):
        loss, grads = grad_fn(model, x)
        optimizer.update(model, grads)
        return loss

    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 13)), jnp.float32)
    with jax.numpy_dtype_promotion("standard"):
        return [float(step(model, optimizer, x)) for _ in range(4)]


@pytest.mark.parametrize(
    "tx_fn",
    [
        pytest.param(lambda: optax.adamw(1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
                     marks=pytest.mark.slow, id="mask"),
        pytest.param(lambda: optax.multi_transform({"mat": optax.adam(1e-2), "vec": optax.sgd(1e-2)},
                                                   lambda p: jax.tree.map(lambda x: "mat" if x.ndim > 1 else "vec", p)),
                     marks=pytest.mark.slow, id="labels"),  # muon is a multi_transform with labels too
        pytest.param(lambda: optax.contrib.muon(1e-2), id="muon"),
        pytest.param(lambda: optax.adafactor(1e-2), id="adafactor"),
    ],
)
def test_nnx_optimizer_with_jnnx_shard_optimizer_matches_the_unsharded_model(tx_fn):
    """nnx.Optimizer(model, jnnx.shard_optimizer(model, tx), wrt=nnx.Param): Adafactor and Muon read
    shapes, so on the padded Params alone they would differ (Adafactor measured 0.2755 vs 0.2628)."""
    np.testing.assert_allclose(_nnx_losses(tx_fn, True), _nnx_losses(tx_fn, False), rtol=1e-5)


def test_the_docs_example_runs():
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "optax.md").read_text()
    code = re.search(r"<!-- optax-example -->\s*```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "docs/optax.md", "exec"), namespace)
    assert namespace["sharded"]["w"].shape == (16, 13)  # still sharded and padded after both optimizers
