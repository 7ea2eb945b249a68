"""``FullyShardPolicy(weight_gradients="from_activations")`` on row lookups: an embedding table
looked up on its shard with the ids and the tokens' columns exchanged, never gathered, its
gradient never formed whole ([Note: row lookup route] in ``jshard/_step/lookup_route.py``).

The model: a ``[256, 64]`` table looked up by ``jnp.take`` (4 tokens of 16 rows, 8 tokens per
device: far fewer than its rows), averaged, and a root head; the table in a unit of its own
(freed after forward) or in the root (kept), sharded on its rows or its columns.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import collective_dtypes, train_nnx_sgd, train_sgd

import jshard as js
from jshard.flax import nnx as jnnx

STEPS = 4
V, D = 256, 64
ROUTED = js.FullyShardPolicy(weight_gradients="from_activations")


def _init():
    rng = np.random.default_rng(0)
    return {"emb": {"w": jnp.asarray(rng.normal(size=(V, D)) * 0.1, jnp.float32)},
            "head": {"w": jnp.asarray(rng.normal(size=(D, 8)) / 8, jnp.float32)}}


def _batches(tokens=4, top=V + 5):
    """Ids up to ``top`` (past the table's last row: ``mode="clip"`` takes its last row)."""
    rng = np.random.default_rng(1)
    return [{"ids": jnp.asarray(rng.integers(0, top, size=(16, tokens)), jnp.int32),
             "y": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)} for _ in range(STEPS)]


def _loss(params, batch):
    def unshard(u):
        return js.unshard(u) if isinstance(u, js.FSDPUnit) else u

    root = unshard(params)
    e = jnp.take(unshard(root["emb"])["w"], batch["ids"], axis=0, mode="clip")
    h = jnp.tanh(e.mean(1))
    return jnp.mean((h @ root["head"]["w"] - batch["y"]) ** 2)


def _train(params, grad_fn, batches):
    return train_sgd(_loss, params, grad_fn, batches)


def _sharded(mesh, policy, own_unit, dim):
    policy = js.FullyShardPolicy(weight_gradients=policy.weight_gradients, shard_placement_fn=lambda path, leaf: dim)
    params = _init()
    if own_unit:
        params = {**params, "emb": js.fully_shard(params["emb"], mesh, policy)}
    return js.fully_shard(params, mesh, policy)


def _assert_close(got, want, tol=1e-5):
    np.testing.assert_allclose(got[0], want[0], rtol=tol, atol=tol)
    for (path, a), b in zip(jax.tree.flatten_with_path(got[1])[0], jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol, err_msg=jax.tree_util.keystr(path))


def _ops(text):
    return {op: len(re.findall(rf"stablehlo\.{op}\b", text)) for op in ("all_to_all", "reduce_scatter")}


def _table_gathers(text):
    return len(re.findall(rf"stablehlo\.all_gather.*-> tensor<{V}x{D}x", text))


@pytest.fixture(scope="module")
def reference():
    losses, params, _ = _train(_init(), jax.value_and_grad, _batches())
    return losses, params


@pytest.mark.parametrize("replicate", [1, 2], ids=["fsdp", "hsdp"])
@pytest.mark.parametrize("dim", [0, 1], ids=["rows", "columns"])
@pytest.mark.parametrize("own_unit", [True, False], ids=["own-unit", "root"])
def test_parity_and_the_table_never_gathered(reference, replicate, dim, own_unit):
    """SGD with momentum, several steps, ids past the table's end clipped: the unsharded
    reference's losses and parameters, the table never gathered and its gradient not
    reduce-scattered (only the head's is), with the reduced route beside it as a control."""
    mesh = js.make_mesh(replicate=replicate)
    grad = lambda f: js.value_and_grad(f, unshard_params=False)  # noqa: E731
    losses, params, text = _train(_sharded(mesh, ROUTED, own_unit, dim), grad, _batches())
    _assert_close((losses, js.unshard(params)), reference)
    assert _table_gathers(text) == 0
    # forward: the tokens' columns back (and, sharded on rows, the shard's columns); backward: dy's
    # columns out (and the gradient's rows back to their shards)
    assert _ops(text) == {"all_to_all": 4 if dim == 0 else 2, "reduce_scatter": 1}
    reduced = _train(_sharded(mesh, js.FullyShardPolicy(), own_unit, dim), grad, _batches())
    _assert_close((reduced[0], js.unshard(reduced[1])), reference)
    assert _table_gathers(reduced[2]) == 1 and _ops(reduced[2]) == {"all_to_all": 0, "reduce_scatter": 2}


def test_mixed_precision_exchanges_tokens_in_param_dtype_and_the_gradient_in_reduce_dtype():
    """bf16 parameters, float32 reduction, HSDP: the shard's columns, the tokens' columns and
    ``dy``'s (the cotangent as it comes) go in bf16; the scatter-add sums every device's tokens in
    ``reduce_dtype``, so the gradient's rows and its replicas' all-reduce go in float32; training
    follows the same policy with the table gathered and reduced."""
    mp = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
    mesh, grad = js.make_mesh(replicate=2), lambda f: js.value_and_grad(f, unshard_params=False)  # noqa: E731
    runs = {}
    for name, route in (("routed", "from_activations"), ("reduced", "reduced")):
        policy = js.FullyShardPolicy(mp_policy=mp, weight_gradients=route)
        init = _init()
        runs[name] = _train(js.fully_shard({**init, "emb": js.fully_shard(init["emb"], mesh, policy)}, mesh, policy),
                            grad, _batches())
    _assert_close((runs["routed"][0], js.unshard(runs["routed"][1])),
                  (runs["reduced"][0], js.unshard(runs["reduced"][1])), 2e-3)
    text = runs["routed"][2]
    exchanges = re.findall(r"stablehlo\.all_to_all.*-> tensor<\S*x(bf16|f32)>", text)
    assert sorted(exchanges) == ["bf16", "bf16", "bf16", "f32"]
    assert "float32" in collective_dtypes(text)["all-reduce"]


def test_not_routed_where_gathering_sends_less():
    """320 tokens per device of a 256-row table: the gather and the reduction send less, and are kept."""
    mesh = js.make_mesh()
    batches = _batches(tokens=160)
    losses, params, text = _train(_sharded(mesh, ROUTED, True, 0), lambda f: js.value_and_grad(f), batches)
    want = _train(_init(), jax.value_and_grad, batches)
    _assert_close((losses, js.unshard(params)), want[:2])
    assert _table_gathers(text) == 1 and _ops(text) == {"all_to_all": 0, "reduce_scatter": 2}


def test_not_routed_where_the_devices_do_not_divide_the_columns():
    """A ``[256, 60]`` table sharded on its rows over 8 devices: its columns cannot be dealt out
    evenly, so it keeps the gather and the reduction, and trains as the unsharded table does."""
    rng = np.random.default_rng(2)
    init = {"emb": {"w": jnp.asarray(rng.normal(size=(V, 60)) * 0.1, jnp.float32)},
            "head": {"w": jnp.asarray(rng.normal(size=(60, 8)) / 8, jnp.float32)}}
    mesh = js.make_mesh()
    sharded = js.fully_shard({**init, "emb": js.fully_shard(init["emb"], mesh, ROUTED)}, mesh, ROUTED)
    losses, params, text = _train(sharded, lambda f: js.value_and_grad(f), _batches())
    want = _train(init, jax.value_and_grad, _batches())
    _assert_close((losses, js.unshard(params)), want[:2])
    assert len(re.findall(rf"stablehlo\.all_gather.*-> tensor<{V}x60x", text)) == 1
    assert _ops(text)["all_to_all"] == 0


BLOCKED = js.FullyShardPolicy(weight_gradients="in_blocks")


def _table_blocks(text, n):
    """Reduce-scatters of a block of 16 of the table's columns to this device's rows (``n`` devices)."""
    return len(re.findall(rf"\(tensor<{V}x{D // 4}xf32>\) -> tensor<{V // n}x{D // 4}xf32>", text))


@pytest.mark.parametrize("replicate, own_unit, remat", [(1, True, None), (2, False, None),
                                                        (1, False, jax.checkpoint_policies.nothing_saveable)],
                         ids=["fsdp-own-unit", "hsdp-root", "root-recomputed"])
def test_gradients_in_blocks_scatter_a_block_of_columns_at_a_time(reference, replicate, own_unit, remat):
    """``weight_gradients="in_blocks"``, the table sharded on its rows: it is gathered once, for
    forward (backward needs only the ids), and its gradient is scatter-added and reduce-scattered 4
    blocks of 16 columns at a time, nothing exchanged; the unsharded reference's training, in a
    unit of its own or in the root, under a ``remat_policy`` too. Sharded on its columns it keeps
    the gather and the reduction."""
    mesh = js.make_mesh(replicate=replicate)
    grad = lambda f: js.value_and_grad(f, unshard_params=False, remat_policy=remat)  # noqa: E731
    losses, params, text = _train(_sharded(mesh, BLOCKED, own_unit, 0), grad, _batches())
    _assert_close((losses, js.unshard(params)), reference)
    assert (_table_gathers(text), _table_blocks(text, 8 // replicate), _ops(text)["all_to_all"]) == (1, 4, 0)
    columns = jax.jit(grad(_loss)).lower(_sharded(mesh, BLOCKED, own_unit, 1), _batches()[0]).as_text()
    whole = rf"\(tensor<{V}x{D}xf32>\) -> tensor<{V}x{D // (8 // replicate)}xf32>"  # the gradient's reduce-scatter
    assert _table_gathers(columns) == 1 and len(re.findall(whole, columns)) == 1


def test_routed_where_that_sends_less_else_in_blocks():
    """``weight_gradients="from_activations+in_blocks"``: at 8 tokens a device the table is looked
    up on its shard (never gathered); at 320, where gathering sends less, its gradient is formed
    in blocks instead; both train as the unsharded table does."""
    mesh, both = js.make_mesh(), js.FullyShardPolicy(weight_gradients="from_activations+in_blocks")
    for tokens, gathers, blocks, exchanges in ((4, 0, 0, 4), (160, 1, 4, 0)):
        batches = _batches(tokens=tokens)
        losses, params, text = _train(_sharded(mesh, both, True, 0), lambda f: js.value_and_grad(f), batches)
        _assert_close((losses, js.unshard(params)), _train(_init(), jax.value_and_grad, batches)[:2])
        assert (_table_gathers(text), _table_blocks(text, 8), _ops(text)["all_to_all"]) == (gathers, blocks, exchanges)


@pytest.mark.parametrize("dim, replicate, microbatches", [(0, 1, 1), (1, 1, 1), (0, 2, 2)],
                         ids=["rows", "columns", "rows-hsdp-accumulated"])
def test_routed_under_a_remat_policy(reference, dim, replicate, microbatches):
    """Under ``nothing_saveable`` the unrolled code is cut into segments, each routed whole or
    not at all for its matmuls; a lookup is routed either way (its residuals are the ids); with
    gradients accumulated over microbatches too."""
    policy = jax.checkpoint_policies.nothing_saveable
    grad = lambda f: js.value_and_grad(f, remat_policy=policy, microbatches=microbatches)  # noqa: E731
    mesh = js.make_mesh(replicate=replicate)
    losses, params, text = _train(_sharded(mesh, ROUTED, True, dim), grad, _batches())
    _assert_close((losses, js.unshard(params)), reference)
    assert _table_gathers(text) == 0


def _tied_loss(params, batch):
    """The table looked up and read again as the head (``h @ table.T``, a matmul the route leaves
    gathered): the lookup's gradient, routed, and the matmul's, reduced, add up."""
    table = js.unshard(params["emb"])["w"] if isinstance(params["emb"], js.FSDPUnit) else params["emb"]["w"]
    h = jnp.tanh(jnp.take(table, batch["ids"], axis=0, mode="clip").mean(1))
    return jnp.mean(((h @ table.T)[:, :8] - batch["y"]) ** 2)


@pytest.mark.parametrize("route", ["from_activations", "in_blocks"])
def test_a_tied_table_keeps_its_gather_for_the_matmul(route):
    """Parity with the unsharded step where the table is also the head: its matmul keeps the gather
    and the reduction; its lookup is routed from activations, or with gradients in blocks left as
    it is (blocking it would gather the table once more and save nothing: the head's gradient is
    whole)."""
    mesh, policy = js.make_mesh(), js.FullyShardPolicy(weight_gradients=route)
    params = _init()
    want = train_sgd(_tied_loss, params, jax.value_and_grad, _batches())
    units = {"emb": js.fully_shard(params["emb"], mesh, policy), "head": params["head"]}
    losses, got, text = train_sgd(_tied_loss, js.fully_shard(units, mesh, policy),
                                    lambda f: js.value_and_grad(f, unshard_params=False), _batches())
    _assert_close((losses, js.unshard(got)), want[:2])
    assert _table_gathers(text) == 2  # for the head's matmul, forward and backward, as reduced
    # the lookup on the shard, or as reduced; the matmul's gradient reduced
    assert _ops(text) == {"all_to_all": 4 if route == "from_activations" else 0, "reduce_scatter": 1}


class _Tagger(nnx.Module):
    """An ``nnx.Embed`` (its ``jnp.take`` inside a ``jit``) and a linear head, as Flax writes them."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.head = nnx.Linear(D, 8, rngs=rngs)

    def __call__(self, ids):
        return self.head(jnp.tanh(self.embed(ids).mean(1)))


def _train_nnx(model, grad_fn):
    def loss_fn(model, batch):
        return jnp.mean((model(batch["ids"]) - batch["y"]) ** 2)

    return train_nnx_sgd(model, grad_fn, loss_fn, _batches(top=V))


def test_nnx_embed_trains_as_unsharded_nnx():
    """``nnx.Embed`` in a unit of its own with the option, the model the root: trains as unsharded
    NNX does, its table never gathered."""
    ref_losses, ref_model, _ = _train_nnx(_Tagger(nnx.Rngs(0)), nnx.value_and_grad)
    model = _Tagger(nnx.Rngs(0))
    jnnx.fully_shard(model.embed, policy=ROUTED)
    losses, model, text = _train_nnx(jnnx.fully_shard(model), jnnx.value_and_grad)
    _assert_close((losses, nnx.to_pure_dict(nnx.state(jnnx.unshard(model), nnx.Param))),
                  (ref_losses, nnx.to_pure_dict(nnx.state(ref_model, nnx.Param))))
    assert _table_gathers(text) == 0 and _ops(text)["all_to_all"] == 4


def test_hugging_face_gpt2_trains_as_unsharded():
    """Hugging Face's Flax GPT-2, its code unchanged (``nn.Embed`` for tokens and positions, the
    token table tied to the head through ``attend``), the root unit routed: trains as the unsharded
    model does; both tables are looked up on their shards (24 tokens a device, 64 rows each), the
    token table stays gathered for the head's matmul."""
    import transformers
    from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2Block

    from jshard.flax import linen as jlinen

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
    with jax.numpy_dtype_promotion("standard"):  # Hugging Face's code mixes dtypes implicitly
        model = transformers.FlaxGPT2LMHeadModel(config, seed=0)
    ids = jax.random.randint(jax.random.key(1), (16, 12), 0, 64)

    def loss_fn(params, input_ids):
        logits = model(input_ids, params=params).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], input_ids[:, 1:]).mean()

    units = jlinen.ModuleUnits(FlaxGPT2Block, root_policy=ROUTED)
    with jax.numpy_dtype_promotion("standard"):
        params = jlinen.shard_params(lambda p, i: model(i, params=p), model.params, ids, units=units)
        losses, params, text = train_sgd(loss_fn, params, lambda f: jlinen.value_and_grad(f, units=units),
                                         [ids] * STEPS)
        ref_losses, ref, _ = train_sgd(loss_fn, model.params, jax.value_and_grad, [ids] * STEPS)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(js.unshard(params)), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert len(re.findall(r"stablehlo\.all_gather.*-> tensor<64x32x", text)) == 1  # wte, for the head
    assert _ops(text)["all_to_all"] == 8  # wte and wpe looked up on their shards
