"""``FullyShardPolicy(weight_gradients="from_activations")``: a matmul of a gathered matrix
run on the shards with the activations exchanged, its weight gradient formed from them instead
of reduced.

The model: three unrolled units of 64-wide matrices (the second sharded on its output dim) and
a root head, 16 rows in the batch (2 per device): each matrix's matmul sends fewer bytes with its
activations exchanged than gathered and reduced, so each of the three is routed; the root's head
keeps its parameters gathered (``reshard_after_forward=False`` for the root) and is reduced. The
same with Flax NNX's ``nnx.Linear`` layers, and with stacked layers in ``js.scan``, ``nnx.scan``
and Linen's ``nn.scan``.
"""

import dataclasses
import re

import flax.linen as nn_linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import collective_dtypes, head_loss, head_params, train_nnx_sgd, train_sgd

import jshard as js
from jshard.flax import linen as jlinen
from jshard.flax import nnx as jnnx
from jshard.report import matmul_flops, step_report

STEPS = 4
ROUTED = js.FullyShardPolicy(weight_gradients="from_activations")


def _init(seed=0):
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[0]), jnp.float32)

    return {"l0": {"w": normal(64, 64)}, "l1": {"w": normal(64, 64)},
            "l2": {"w": normal(64, 48), "b": normal(48) * 0.1}, "head": {"w": normal(48, 8)}}


def _batches(rows=16, seed=1):
    rng = np.random.default_rng(seed)
    return [{"x": jnp.asarray(rng.normal(size=(rows, 64)), jnp.float32),
             "y": jnp.asarray(rng.normal(size=(rows, 8)), jnp.float32)} for _ in range(STEPS)]


def _loss(params, batch):
    unshard = (lambda u: js.unshard(u)) if isinstance(params, js.FSDPUnit) else (lambda u: u)
    root = unshard(params)
    h = batch["x"]  # bf16 under a bf16 MixedPrecisionPolicy (cast_forward_inputs)
    for name in ("l0", "l1"):
        h = jnp.tanh(h @ unshard(root[name])["w"])
    l2 = unshard(root["l2"])
    h = jnp.tanh(h @ l2["w"] + l2["b"])
    return jnp.mean(((h @ root["head"]["w"]).astype(jnp.float32) - batch["y"].astype(jnp.float32)) ** 2)


def _on_outputs(path, leaf):  # l1's matrix sharded on its second dim
    return 1


def _shard(params, mesh, policy):
    on_outputs = dataclasses.replace(policy, shard_placement_fn=_on_outputs)
    units = {name: js.fully_shard(params[name], mesh, on_outputs if name == "l1" else policy)
             for name in ("l0", "l1", "l2")}
    return js.fully_shard({**params, **units}, mesh, policy)


def _train_reference():
    tx, params = optax.sgd(0.1, momentum=0.9), _init()
    state, losses = tx.init(params), []
    for batch in _batches():
        loss, grads = jax.value_and_grad(_loss)(params, batch)
        updates, state = tx.update(grads, state, params)
        params, losses = optax.apply_updates(params, updates), losses + [float(loss)]
    return losses, params


def _train(policy, mesh, **grad_kwargs):
    losses, sharded, text = _train_loss(_loss, _shard(_init(), mesh, policy),
                                        lambda f: js.value_and_grad(f, unshard_params=False, **grad_kwargs))
    return losses, js.unshard(sharded), text


def _assert_close(got, want, tol):
    np.testing.assert_allclose(got[0], want[0], rtol=tol, atol=tol)
    for (path, a), b in zip(jax.tree.flatten_with_path(got[1])[0], jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol, err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def reference():
    return _train_reference()


def _ops(text: str) -> dict[str, int]:
    return {op: len(re.findall(rf"stablehlo\.{op}\b", text)) for op in ("all_to_all", "reduce_scatter")}


def _head_gathers(text: str) -> int:
    """All-gathers whose result is the head's ``[48, 8]`` matrix."""
    return len(re.findall(r"stablehlo\.all_gather.*-> tensor<48x8x", text))


def _matrix_gathers(text: str) -> int:
    """All-gathers whose result is a 64-row matrix: the three layers' weights, gathered for compute
    (forward, and again in backward)."""
    return len(re.findall(r"stablehlo\.all_gather.*-> tensor<64x\d+x", text))


@pytest.mark.parametrize("replicate", [1, 2], ids=["fsdp", "hsdp"])
def test_parity_and_the_matmuls_routed(reference, replicate):
    """SGD with momentum, several steps: the unsharded reference's losses and parameters, with
    three matrices never gathered and their gradients formed from activations instead of
    reduce-scattered."""
    mesh = js.make_mesh(replicate=replicate)
    routed = _train(ROUTED, mesh)
    _assert_close(routed, reference, 1e-5)
    reduced = _train(js.FullyShardPolicy(), mesh)
    _assert_close(reduced, reference, 1e-5)
    assert _ops(reduced[2]) == {"all_to_all": 0, "reduce_scatter": 5}  # three matrices, a bias, the head
    # No matrix is gathered. l0 and l2 (sharded on their inputs): x's columns exchanged (an all-to-all),
    # the partial products reduce-scattered, dx sent back by an all-to-all (l2's; l0's, of the batch,
    # is not needed). l1 (on its outputs): x gathered (twice), the products sent back by an all-to-all,
    # dy's columns exchanged, dx reduce-scattered. With the bias's and the head's reduce-scatters:
    assert _ops(routed[2]) == {"all_to_all": 5, "reduce_scatter": 5}
    assert (_matrix_gathers(reduced[2]), _matrix_gathers(routed[2])) == (4, 0)


def test_the_analytic_figures_bound_a_routed_step():
    """The performance model keeps the gather and reduction figures for routed matrices: a routed
    step sends less in all, its all-to-alls included (0.21 of them), a reduced one at most what
    they say (0.79: XLA drops l0's re-gather, which only the batch's unneeded ``dx`` reads)."""
    batch, step = _batches()[0], js.value_and_grad(_loss, unshard_params=False)
    totals = {}
    for name, policy in (("reduced", js.FullyShardPolicy()), ("routed", ROUTED)):
        report = step_report(step, _shard(_init(), js.make_mesh(), policy), batch)
        a = report.analytic
        totals[name] = (sum(report.collective_bytes.values()), a.all_gather + a.reduce_scatter + a.all_reduce)
    assert totals["routed"][1] == totals["reduced"][1]
    assert totals["routed"][0] < 0.5 * totals["routed"][1]
    assert 0.7 * totals["reduced"][1] < totals["reduced"][0] <= totals["reduced"][1]


def test_mixed_precision_gathers_and_exchanges_in_param_dtype():
    """bf16 parameters: the activations are exchanged in bf16, the routed gradients are reduced
    over replicas in ``reduce_dtype`` as a reduce-scatter's are, and training follows the same
    policy with every gradient reduced."""
    mp = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
    mesh = js.make_mesh(replicate=2)
    routed = _train(dataclasses.replace(ROUTED, mp_policy=mp), mesh)
    reduced = _train(js.FullyShardPolicy(mp_policy=mp), mesh)
    _assert_close(routed, reduced, 2e-3)  # 3.9e-4 apart in the losses, 1.7e-4 in the parameters
    dtypes = collective_dtypes(routed[2])
    assert dtypes["all-to-all"] == {"bfloat16"}
    assert "float32" in dtypes["all-reduce"]


def test_not_routed_where_reducing_sends_less():
    """At 64 rows per device a 64 x 64 matrix's gradient sends fewer bytes reduced."""
    big = _batches(rows=512)[0]
    step = jax.jit(js.value_and_grad(_loss, unshard_params=False))
    assert _ops(step.lower(_shard(_init(), js.make_mesh(), ROUTED), big).as_text())["all_to_all"] == 0


@pytest.mark.parametrize("replicate,microbatches", [(1, 1), (2, 1), (2, 2)], ids=["fsdp", "hsdp", "hsdp-accumulated"])
def test_recomputed_units_routed(reference, replicate, microbatches):
    """Under a ``remat_policy`` the unrolled units' segments are routed once cut (each is
    checkpointed after): training follows the reference, each routed forward runs again in
    backward where a checkpointed unit is recomputed (the last is not), and the matmul FLOPs are
    the reduced step's under the same policy; with gradients accumulated over microbatches too."""
    mesh, policy = js.make_mesh(replicate=replicate), jax.checkpoint_policies.nothing_saveable
    routed = _train(ROUTED, mesh, remat_policy=policy, microbatches=microbatches)
    _assert_close(routed, reference, 1e-5)
    # The module's counts with l0's forward (an all-to-all, a reduce-scatter) and l1's (an
    # all-gather, an all-to-all) run again; l2's segment, the last, is not recomputed.
    assert _ops(routed[2]) == {"all_to_all": 7, "reduce_scatter": 6}
    assert _matrix_gathers(routed[2]) == 0
    batch = _batches(rows=32)[0]  # 2 rows a device a microbatch: with 1, XLA turns x^T dy into multiplies
    step = js.value_and_grad(_loss, unshard_params=False, remat_policy=policy, microbatches=microbatches)
    flops = [_flops(jax.jit(step).lower(_shard(_init(), mesh, p), batch)) for p in (ROUTED, js.FullyShardPolicy())]
    assert flops[0] == flops[1]


def _nested_loss(params, batch):  # a recomputed block: l1 gathered inside a jit in it, read transposed there
    unshard = (lambda u: js.unshard(u)) if isinstance(params, js.FSDPUnit) else (lambda u: u)
    root = unshard(params)

    @jax.checkpoint
    def block(x, l0, l1):
        w0 = unshard(l0)["w"]
        h = jax.jit(lambda x, l1: jnp.tanh(x @ unshard(l1)["w"].T))(x, l1)
        return jnp.tanh(h @ w0)

    h = block(batch["x"], root["l0"], root["l1"])
    return jnp.mean((h @ root["l2"]["w"] @ root["head"]["w"] - batch["y"]) ** 2)


def test_recomputed_block_routed_whole_or_not_at_all_looks_inside_nested_calls():
    """A block the user recomputes (``jax.checkpoint``) whose marked matrix stays gathered inside a
    nested call (l1, gathered in a ``jax.jit`` and read transposed there) is not routed at all:
    l0's matmul in it, which could be, keeps its gather too; training follows the unsharded
    reference."""
    init, mesh = _init(), js.make_mesh()
    ref = _train_loss(_nested_loss, init, jax.value_and_grad)
    sharded = js.fully_shard({**init, **{k: js.fully_shard(init[k], mesh, ROUTED) for k in ("l0", "l1")}},
                             mesh, ROUTED)
    losses, params, text = _train_loss(_nested_loss, sharded, lambda f: js.value_and_grad(f, unshard_params=False))
    _assert_close((losses, js.unshard(params)), ref[:2], 1e-5)
    assert _ops(text)["all_to_all"] == 0


def test_policy_errors():
    with pytest.raises(ValueError, match=r"must be one of \('reduced', 'from_activations', 'in_blocks', "
                                         r"'from_activations\+in_blocks'\) or None, got 'activations'"):
        js.FullyShardPolicy(weight_gradients="activations")
    for route in ("from_activations", "in_blocks", "from_activations+in_blocks"):
        message = rf"`weight_gradients='{re.escape(route)}'` .* set `unit_collectives=False`"
        with pytest.raises(ValueError, match=message):
            js.FullyShardPolicy(weight_gradients=route, unit_collectives=True)


class _MLP(nnx.Module):
    """Flax NNX as its docs write an MLP: ``nnx.Linear`` layers in a list."""

    def __init__(self, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(64, 64, rngs=rngs) for _ in range(3)])
        self.head = nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return self.head(x)


def _nnx_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _train_nnx(model, grad_fn):
    return train_nnx_sgd(model, grad_fn, _nnx_loss, _batches())


@pytest.mark.parametrize("recomputed", [False, True], ids=["kept", "recomputed"])
def test_nnx_linear_layers_train_as_unsharded_nnx(recomputed):
    """Each ``nnx.Linear`` of an unrolled NNX MLP a unit with the option: its kernel never
    gathered (``x``'s columns exchanged, three all-to-alls, and ``dx`` sent back, two more: the
    first layer's, of the batch, is not needed; under ``nothing_saveable`` the two recomputed
    layers exchange ``x``'s columns again), training as unsharded NNX does."""
    ref_losses, ref_model, _ = _train_nnx(_MLP(nnx.Rngs(0)), nnx.value_and_grad)
    model = _MLP(nnx.Rngs(0))
    for layer in model.layers:
        jnnx.fully_shard(layer, policy=ROUTED)
    policy = jax.checkpoint_policies.nothing_saveable if recomputed else None
    losses, model, text = _train_nnx(jnnx.fully_shard(model),
                                     lambda f: jnnx.value_and_grad(f, remat_policy=policy))
    _assert_close((losses, nnx.to_pure_dict(nnx.state(jnnx.unshard(model), nnx.Param))),
                  (ref_losses, nnx.to_pure_dict(nnx.state(ref_model, nnx.Param))), 1e-5)
    assert _ops(text)["all_to_all"] == (7 if recomputed else 5)


def _layer(h, layer):  # a tanh layer (w), a GELU block (up, down), or one whose up is read transposed
    if "w" in layer:
        return jnp.tanh(h @ layer["w"]), None
    up = h @ layer["up"] if "up" in layer else h @ layer["up_t"].T
    return h + jax.nn.gelu(up) @ layer["down"], None


def _stacked_loss(params, batch):
    stack, head = (params["stack"], params["head"]) if not isinstance(params, js.FSDPUnit) else (
        js.unshard(params)["stack"], js.unshard(params)["head"])
    scan = js.scan if isinstance(stack, js.FSDPUnit) else jax.lax.scan
    h, _ = scan(_layer, batch["x"], stack)
    return jnp.mean((h @ head["w"] - batch["y"]) ** 2)


def _stacked_init(layers=3, kind="gelu"):
    rng = np.random.default_rng(2)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=(layers, *shape)) / np.sqrt(shape[0]), jnp.float32)

    stack = {"tanh": lambda: {"w": normal(64, 64)}, "gelu": lambda: {"up": normal(64, 96), "down": normal(96, 64)},
             "gelu_t": lambda: {"up_t": normal(96, 64), "down": normal(96, 64)}}[kind]()
    return {"stack": stack, "head": {"w": jnp.asarray(rng.normal(size=(64, 8)) / 8, jnp.float32)}}


def _stacked_units(init, mesh, policy=ROUTED):
    return js.fully_shard({"stack": js.fully_shard(init["stack"], mesh, dataclasses.replace(policy, scan_axis=0)),
                           "head": init["head"]}, mesh, policy)


def _train_loss(loss_fn, params, grad_fn):
    return train_sgd(loss_fn, params, grad_fn, _batches())


def _train_stacked(params, grad_fn):
    return _train_loss(_stacked_loss, params, grad_fn)


def test_stacked_layers_routed_inside_the_loop():
    """Layers stacked under ``js.scan``: each iteration's two matmuls run on the shards with their
    activations exchanged (in the loop body) and training follows the unsharded ``lax.scan``
    reference."""
    init = _stacked_init()
    ref = _train_stacked(init, lambda f: jax.value_and_grad(f))
    losses, params, text = _train_stacked(_stacked_units(init, js.make_mesh()),
                                          lambda f: js.value_and_grad(f, unshard_params=False))
    _assert_close((losses, js.unshard(params)), ref[:2], 1e-5)
    # up and down in the loop: x's columns and dx exchanged, the products reduce-scattered; the head reduced
    assert _ops(text) == {"all_to_all": 4, "reduce_scatter": 3}


# Under nothing_saveable: x's columns exchanged and the products reduce-scattered in forward, again
# where the recomputation needs them, and dx exchanged; the head's gradient reduce-scattered.
RECOMPUTED_OPS = {"tanh": {"all_to_all": 3, "reduce_scatter": 3},
                  "gelu": {"all_to_all": 6, "reduce_scatter": 4},  # down's product is not recomputed
                  "gelu_t": {"all_to_all": 0, "reduce_scatter": 3}}  # up read transposed: neither routed


@pytest.mark.parametrize("kind", sorted(RECOMPUTED_OPS))
def test_recomputed_layers_routed_whole_or_not_at_all(kind):
    """Under a ``remat_policy`` a stacked layer (its checkpoint) is routed where every matmul of a
    gathered matrix in it can be (a tanh layer, a GELU block), and not at all where one cannot (a
    GELU block whose first matrix is read transposed: its second is left gathered too); training
    follows ``jax.checkpoint(layer)`` in ``lax.scan`` with the same policy, with the recipe's
    matmul FLOPs."""
    policy = jax.checkpoint_policies.nothing_saveable
    init = _stacked_init(kind=kind)

    def reference(f):  # the recipe's recomputation: each layer under jax.checkpoint
        def loss(p, batch):
            h, _ = jax.lax.scan(jax.checkpoint(_layer, policy=policy), batch["x"], p["stack"])
            return jnp.mean((h @ p["head"]["w"] - batch["y"]) ** 2)
        return jax.value_and_grad(loss)

    ref = _train_stacked(init, reference)
    losses, params, text = _train_stacked(_stacked_units(init, js.make_mesh()),
                                          lambda f: js.value_and_grad(f, unshard_params=False, remat_policy=policy))
    _assert_close((losses, js.unshard(params)), ref[:2], 1e-5)
    assert _ops(text) == RECOMPUTED_OPS[kind]
    ours = jax.jit(js.value_and_grad(_stacked_loss, unshard_params=False, remat_policy=policy))
    recipe = jax.jit(reference(_stacked_loss))
    batch = _batches()[0]
    assert 8 * _flops(ours.lower(_stacked_units(init, js.make_mesh()), batch)) == _flops(recipe.lower(init, batch))


def _flops(lowered) -> float:
    """Matmul FLOPs of the compiled program (per device; loop trips counted)."""
    return matmul_flops(lowered.compile().as_text())


class _Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(64, 64, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.lin(x))


class _ScannedMLP(nnx.Module):
    """Flax NNX as its docs write a stack: blocks made by ``nnx.vmap``, run by ``nnx.scan``."""

    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return _Block(rngs)

        self.blocks = create(rngs)
        self.head = nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return block(x)

        return self.head(forward(x, self.blocks))


def test_nnx_scan_layers_routed_inside_the_loop():
    """The same through ``nnx.scan``: the stacked kernels never gathered in the loop (``x``'s
    columns and ``dx`` exchanged), training as unsharded NNX does."""
    ref_losses, ref_model, _ = _train_nnx(_ScannedMLP(nnx.Rngs(0)), nnx.value_and_grad)
    model = _ScannedMLP(nnx.Rngs(0))
    jnnx.fully_shard(model.blocks, policy=dataclasses.replace(ROUTED, scan_axis=0))
    losses, model, text = _train_nnx(jnnx.fully_shard(model), jnnx.value_and_grad)
    _assert_close((losses, nnx.to_pure_dict(nnx.state(jnnx.unshard(model), nnx.Param))),
                  (ref_losses, nnx.to_pure_dict(nnx.state(ref_model, nnx.Param))), 1e-5)
    assert _ops(text)["all_to_all"] == 2


class _LinenLayer(nn_linen.Module):
    @nn_linen.compact
    def __call__(self, x, _):
        return jnp.tanh(nn_linen.Dense(64, name="dense")(x)), None


class _LinenMLP(nn_linen.Module):
    """Flax Linen as its docs write a stack: ``nn.scan`` over a layer, then a head."""

    layer: type = _LinenLayer

    @nn_linen.compact
    def __call__(self, x):
        stack = nn_linen.scan(self.layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        x, _ = stack(name="blocks")(x, None)
        return nn_linen.Dense(8, name="head")(x)


def _train_linen(model, params, grad_fn):
    def loss_fn(p, batch):
        return jnp.mean((model.apply({"params": p}, batch["x"]) - batch["y"]) ** 2)

    return _train_loss(loss_fn, params, grad_fn)


def test_linen_nn_scan_layers_routed_inside_the_loop():
    """The same through Linen's ``nn.scan``: the stacked kernels never gathered in the loop,
    training as unsharded Linen does."""
    x = _batches()[0]["x"]
    init = _LinenMLP().init(jax.random.key(0), x)["params"]
    ref = _train_linen(_LinenMLP(), init, jax.value_and_grad)
    model = jlinen.fully_shard(_LinenMLP)(layer=jlinen.fully_shard(_LinenLayer, policy=ROUTED))
    losses, params, text = _train_linen(model, jlinen.shard_params(model, init, x), jlinen.value_and_grad)
    _assert_close((losses, js.unshard(params)), ref[:2], 1e-5)
    assert _ops(text)["all_to_all"] == 2


BLOCKED = js.FullyShardPolicy(weight_gradients="in_blocks")


@pytest.mark.parametrize("replicate", [1, 2], ids=["fsdp", "hsdp"])
def test_parity_with_the_gradients_reduced_in_blocks(reference, replicate):
    """``weight_gradients="in_blocks"``: the unsharded reference's losses and parameters, each
    matrix's gradient formed and reduce-scattered in 4 blocks of its unsharded dim (l1's, sharded
    on its outputs, of its inputs), the root's head too (kept gathered: gathered once), the bias's
    whole; nothing exchanged."""
    blocked = _train(BLOCKED, js.make_mesh(replicate=replicate))
    _assert_close(blocked, reference, 1e-5)
    assert _ops(blocked[2]) == {"all_to_all": 0, "reduce_scatter": 4 * 4 + 1}
    assert _head_gathers(blocked[2]) == 1


BOTH = js.FullyShardPolicy(weight_gradients="from_activations+in_blocks")


@pytest.mark.parametrize("recomputed", [False, True], ids=["kept", "recomputed"])
def test_routed_where_that_sends_less_else_in_blocks(reference, recomputed):
    """``"from_activations+in_blocks"``: at 2 rows a device the three matrices are routed, as with
    ``from_activations``; the root's head, kept gathered, is gathered once and its gradient formed
    in 4 blocks, under jshard's policy and under a ``remat_policy`` (the head's matmul in the last
    segment, its gather in the first); training follows the reference. At 64 rows a device,
    where gathering sends less, every matrix's gradient is formed in blocks, as ``in_blocks``."""
    grad = {"remat_policy": jax.checkpoint_policies.nothing_saveable} if recomputed else {}
    both, routed = _train(BOTH, js.make_mesh(), **grad), _train(ROUTED, js.make_mesh(), **grad)
    _assert_close(both, reference, 1e-5)
    ops = _ops(routed[2])
    assert _ops(both[2]) == {"all_to_all": ops["all_to_all"], "reduce_scatter": ops["reduce_scatter"] + 3}
    assert (_matrix_gathers(both[2]), _head_gathers(both[2])) == (0, 1)
    big = _batches(rows=512)[0]
    step = jax.jit(js.value_and_grad(_loss, unshard_params=False))
    lowered = [_ops(step.lower(_shard(_init(), js.make_mesh(), p), big).as_text()) for p in (BOTH, BLOCKED)]
    assert lowered[0] == lowered[1] == {"all_to_all": 0, "reduce_scatter": 4 * 4 + 1}


@pytest.mark.parametrize("remat", [None, jax.checkpoint_policies.nothing_saveable], ids=["kept", "recomputed"])
def test_a_matrix_kept_gathered_is_gathered_once_with_its_gradient_in_blocks(remat):
    """The root's head (``[64, 512]``), kept gathered, with ``weight_gradients="in_blocks"``: its
    gradient is reduce-scattered in 4 blocks, and it is gathered once, as the reduced route gathers
    it, under jshard's policy (which re-gathers what is not saved by name) and under a
    ``remat_policy`` (where the unit before it, recomputed, keeps the reduced route)."""
    mesh, x = js.make_mesh(), jax.ShapeDtypeStruct((16, 64), jnp.float32)
    texts = {}
    for policy in (js.FullyShardPolicy(weight_gradients="reduced"), BLOCKED):
        step = jax.jit(js.value_and_grad(head_loss, unshard_params=False, remat_policy=remat))
        texts[policy.weight_gradients] = step.lower(head_params(mesh, policy, 64, 512), x).as_text()
    head_gathers = {route: len(re.findall(r"stablehlo\.all_gather.*-> tensor<64x512x", text))
                    for route, text in texts.items()}
    assert head_gathers == {"reduced": 1, "in_blocks": 1}
    head_blocks = len(re.findall(r"\(tensor<64x128xf32>\) -> tensor<8x128xf32>", texts["in_blocks"]))
    assert (head_blocks, _ops(texts["in_blocks"])["reduce_scatter"]) == (4, 5 if remat else 8)  # l0: 1 or 4


def test_a_matrix_kept_gathered_and_read_twice_keeps_its_reduction():
    """The root's head read by two matmuls: blocking either would gather it again beside the gather
    the other reads, so both keep it (one gather, its gradient reduced whole)."""
    mesh = js.make_mesh()

    def loss(params, x):
        root = js.unshard(params)
        h = jnp.tanh(x @ js.unshard(root["l0"])["w"])
        return jnp.mean(jax.nn.logsumexp(h @ root["head"]["w"], axis=-1) + (h @ root["head"]["w"])[:, 0])

    params, x = head_params(mesh, BLOCKED, 64, 512), jax.ShapeDtypeStruct((16, 64), jnp.float32)
    text = jax.jit(js.value_and_grad(loss, unshard_params=False)).lower(params, x).as_text()
    assert len(re.findall(r"stablehlo\.all_gather.*-> tensor<64x512x", text)) == 1
    assert len(re.findall(r"\(tensor<64x512xf32>\) -> tensor<8x512xf32>", text)) == 1


def test_a_dim_neither_4_nor_2_equal_blocks_fit_is_reduced_in_aligned_blocks():
    """The root's head with 3075 outputs (neither 4 nor 2 equal blocks) and
    ``weight_gradients="in_blocks"``: its gradient is reduce-scattered in blocks of 1024, 1024, 1024
    and 3 columns (``BLOCK_ALIGN`` wide but the last), and the loss and every gradient are the
    reduced route's."""
    mesh = js.make_mesh()
    k0, k1, k2 = jax.random.split(jax.random.key(0), 3)
    raw = {"l0": {"w": jax.random.normal(k0, (64, 64)) / 8}, "head": {"w": jax.random.normal(k1, (64, 3075)) / 8}}
    x = jax.random.normal(k2, (16, 64))
    out = {}
    for policy in (js.FullyShardPolicy(weight_gradients="reduced"), BLOCKED):
        params = js.fully_shard({"l0": js.fully_shard(raw["l0"], mesh, policy), "head": raw["head"]}, mesh, policy)
        step = jax.jit(js.value_and_grad(head_loss, unshard_params=False))
        loss, grads = step(params, x)
        out[policy.weight_gradients] = (loss, js.unshard(grads), step.lower(params, x).as_text())
    _assert_close(out["in_blocks"][:2], out["reduced"][:2], 1e-5)
    blocks = re.findall(r"\(tensor<64x(\d+)xf32>\) -> tensor<8x\1xf32>", out["in_blocks"][2])
    assert sorted(blocks, key=int) == ["3"] + ["16"] * 4 + ["1024"] * 3  # l0's [64, 64]: 4 equal blocks


@pytest.mark.parametrize("recomputed", [False, True], ids=["kept", "recomputed"])
def test_stacked_layers_reduce_their_gradients_in_blocks(recomputed):
    """GELU blocks stacked under ``js.scan`` with ``weight_gradients="in_blocks"``: each layer's two
    matrices' gradients are reduce-scattered in 4 blocks in the loop body (the root's head, kept
    gathered, in 4 blocks too), and
    training follows ``lax.scan`` with its matmul FLOPs. Recomputed (``nothing_saveable``, against
    ``jax.checkpoint(layer)`` with the same policy) a layer keeps the reduced route: the block
    route's backward would gather each matrix a third time ([Note: weight gradient blocks])."""
    policy = jax.checkpoint_policies.nothing_saveable if recomputed else None
    init = _stacked_init()

    def reference(f):
        layer = jax.checkpoint(_layer, policy=policy) if recomputed else _layer

        def loss(p, batch):
            h, _ = jax.lax.scan(layer, batch["x"], p["stack"])
            return jnp.mean((h @ p["head"]["w"] - batch["y"]) ** 2)
        return jax.value_and_grad(loss)

    ref = _train_stacked(init, reference)
    grad = lambda f: js.value_and_grad(f, unshard_params=False, remat_policy=policy)  # noqa: E731
    losses, params, text = _train_stacked(_stacked_units(init, js.make_mesh(), BLOCKED), grad)
    _assert_close((losses, js.unshard(params)), ref[:2], 1e-5)
    assert _ops(text) == {"all_to_all": 0, "reduce_scatter": 2 * (1 if recomputed else 4) + 4}
    batch = _batches()[0]
    ours = jax.jit(grad(_stacked_loss)).lower(_stacked_units(init, js.make_mesh(), BLOCKED), batch)
    assert 8 * _flops(ours) == _flops(jax.jit(reference(_stacked_loss)).lower(init, batch))


def test_gradients_reduced_in_blocks_in_reduce_dtype():
    """bf16 parameters, float32 reduction, HSDP: every block is reduce-scattered in float32, and
    training follows the same policy with every gradient reduced whole."""
    mp = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
    mesh = js.make_mesh(replicate=2)
    blocked = _train(dataclasses.replace(BLOCKED, mp_policy=mp), mesh)
    reduced = _train(js.FullyShardPolicy(mp_policy=mp), mesh)
    _assert_close(blocked, reduced, 2e-3)
    assert collective_dtypes(blocked[2])["reduce-scatter"] == {"float32"}
