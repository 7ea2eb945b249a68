"""jshard.flax.nnx: FSDP2's module controls, hooks, prefetch, evaluation and errors, on small models.

Most tests read the lowered program (no compile).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import constant_divisors, max_diff

import jshard as js
from jshard._report.hlo import hlo_collectives, lowered_collectives
from jshard.flax import nnx as jnnx

EVENTS: list = []


class Rec(nnx.Linear):
    """A Linear that records its calls (at trace time)."""

    def __call__(self, x):
        EVENTS.append(("call", self.in_features))
        return super().__call__(x)


def record_gather(x, axes, dim):
    EVENTS.append(("gather", x.shape))
    return js.collectives.all_gather(x, axes, dim)


def forward_events() -> list:
    """Calls and kernel gathers of the forward trace (the gathers' VJP rules trace them again later)."""
    last = max(i for i, e in enumerate(EVENTS) if e[0] == "call")
    return [e for e in EVENTS[: last + 1] if e[0] == "call" or len(e[1]) == 2]


class Tiny(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.blocks = nnx.List([Rec(8, 16, rngs=rngs), Rec(16, 24, rngs=rngs), Rec(24, 8, rngs=rngs)])
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = jnp.tanh(block(x))
        return self.head(x)


def tiny_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


TINY_BATCH = {"x": jnp.linspace(-1.0, 1.0, 16 * 8).reshape(16, 8), "y": jnp.ones((16, 2))}


def tiny(policy=None) -> Tiny:
    model = Tiny(nnx.Rngs(0))
    for block in model.blocks:
        jnnx.fully_shard(block, policy=policy)
    return jnnx.fully_shard(model)


def lowered_text(model, microbatches: int = 1) -> str:
    graphdef, state = nnx.split(model)

    def step(state, batch):
        return jnnx.value_and_grad(tiny_loss, microbatches=microbatches)(nnx.merge(graphdef, state), batch)

    EVENTS.clear()
    return jax.jit(step).lower(state, TINY_BATCH).as_text()


def lowered(model, microbatches: int = 1) -> list[tuple[str, str]]:
    return lowered_collectives(lowered_text(model, microbatches))


def grads(model, microbatches: int = 1):
    return nnx.jit(lambda m, b: jnnx.value_and_grad(tiny_loss, microbatches=microbatches)(m, b))(model, TINY_BATCH)


def count(collectives, kind: str) -> int:
    return sum(k == kind for k, _ in collectives)


def test_reshard_after_forward_setter_removes_backward_gathers():
    model = tiny()
    gathers = count(lowered(model), "all-gather")
    model.set_reshard_after_forward(False)
    assert all(m.policy.reshard_after_forward is False for m in [model, *model.blocks])
    assert count(lowered(model), "all-gather") < gathers  # backward reuses the forward gathers
    model.blocks[0].set_reshard_after_forward(True, recurse=False)
    assert model.blocks[0].policy.reshard_after_forward is True and model.policy.reshard_after_forward is False
    with pytest.raises(ValueError, match=r"`reshard_after_forward=3` must divide the shard size"):
        model.set_reshard_after_forward(3)


def test_custom_collective_hooks():
    model = tiny()
    seen = []
    model.blocks[0].set_custom_all_gather(js.int8_all_gather)
    model.blocks[1].set_custom_reduce_scatter(
        lambda g, axes, dim: seen.append("rs") or js.collectives.reduce_scatter(g, axes, dim)
    )
    model.set_all_reduce_hook(lambda g, axes: seen.append(("ar", axes)) or g)
    collectives = lowered(model)
    assert ("all-gather", "int8") in collectives
    assert "rs" in seen and ("ar", ()) in seen
    with pytest.raises(ValueError, match="`stream` is not applicable"):
        model.set_all_reduce_hook(lambda g, axes: g, stream=object())


def test_gradient_divide_factor_and_force_sum_reduction():
    model = tiny()
    _, before = grads(model)
    plain = constant_divisors(lowered_text(model))
    model.set_force_sum_reduction_for_comms(True)
    split = constant_divisors(lowered_text(model))
    # gradients are divided by 4 before their sum and by 2 after, not by 8 after (lowered functions are shared:
    # the divisions are counted once per function, not per leaf)
    assert set(split - plain) == {4.0, 2.0} and set(plain - split) == {8.0}
    model.blocks[2].set_gradient_divide_factor(2 * len(jax.devices()))
    _, after = grads(model)
    kernel = lambda g, i: g["blocks"][i]["kernel"][...]  # noqa: E731
    np.testing.assert_allclose(kernel(after, 2), kernel(before, 2) / 2, rtol=1e-6)
    np.testing.assert_allclose(after["head"]["kernel"][...], before["head"]["kernel"][...], rtol=1e-6)


def test_gradient_sync_and_reshard_after_backward_select_gather_once():
    model = tiny()
    loss, ref = grads(model, microbatches=2)
    per_microbatch = count(lowered(model, microbatches=2), "all-gather")
    model.set_requires_gradient_sync(False)
    once = lowered(model, microbatches=2)
    loss2, synced_once = grads(model, microbatches=2)
    np.testing.assert_allclose(loss2, loss, rtol=1e-6)
    assert max_diff(ref, synced_once) < 1e-6
    model.set_requires_gradient_sync(True)
    model.set_reshard_after_backward(False)
    assert lowered(model, microbatches=2) == once and count(once, "all-gather") < per_microbatch
    model.blocks[0].set_reshard_after_backward(True, recurse=False)
    with pytest.raises(ValueError, match=r"`blocks\[0\]` \(Rec\) has reshard_after_backward=True but the root has"):
        lowered(model)


def replica_all_reduces_in_loop(model, microbatches: int) -> list[bool]:
    """For each all-reduce over the replicate axis of the compiled step: whether it runs inside the microbatch loop."""
    graphdef, state = nnx.split(model)

    def step(state, batch):
        return jnnx.value_and_grad(tiny_loss, microbatches=microbatches)(nnx.merge(graphdef, state), batch)

    hlo = jax.jit(step).lower(state, TINY_BATCH).compile().as_text()
    replicas = "{{0,4},{1,5},{2,6},{3,7}}"  # the ("replicate", "fsdp") = (2, 4) mesh's replica pairs
    return [c.in_loop for c in hlo_collectives(hlo) if c.kind == "all-reduce" and c.replica_groups == replicas]


def test_requires_all_reduce_on_hsdp():
    mesh = js.make_mesh(replicate=2)
    model = Tiny(nnx.Rngs(0))
    for block in model.blocks:
        jnnx.fully_shard(block, mesh)
    jnnx.fully_shard(model, mesh)
    _, ref = grads(model, microbatches=2)
    assert any(replica_all_reduces_in_loop(model, microbatches=2))  # by default: once per microbatch
    model.set_requires_all_reduce(False)
    in_loop = replica_all_reduces_in_loop(model, microbatches=2)
    assert in_loop and not any(in_loop)  # once per step, after the microbatch loop
    _, once = grads(model, microbatches=2)
    assert max_diff(ref, once) < 1e-6


def test_forward_prefetch_gathers_before_the_previous_block_runs():
    policy = js.FullyShardPolicy(custom_all_gather=record_gather)
    model = tiny(policy)
    lowered(model)
    plain = forward_events()
    model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1]])
    model.blocks[1].set_modules_to_backward_prefetch([model.blocks[0]])
    assert unit_uids(model.blocks[1]) == (model.blocks[0]._jshard.path,)
    lowered(model)
    prefetched = forward_events()
    g0, g1, g2 = ("gather", (1, 16)), ("gather", (2, 24)), ("gather", (3, 8))
    assert plain == [g0, ("call", 8), g1, ("call", 16), g2, ("call", 24)]
    assert prefetched == [g0, g1, ("call", 8), ("call", 16), g2, ("call", 24)]
    with pytest.raises(ValueError, match=r"modules\[0\] \(Linear\) is not fully sharded"):
        model.blocks[0].set_modules_to_forward_prefetch([nnx.Linear(2, 2, rngs=nnx.Rngs(0))])


def unit_uids(module):
    return module._jshard.backward_prefetch


class Reuse(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.block = Rec(8, 8, rngs=rngs)
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.block(jnp.tanh(self.block(x))))


def test_unshard_in_step_gathers_once_until_reshard():
    reference = nnx.value_and_grad(tiny_loss)(Reuse(nnx.Rngs(0)), TINY_BATCH)
    model = Reuse(nnx.Rngs(0))
    jnnx.fully_shard(model.block, policy=js.FullyShardPolicy(custom_all_gather=record_gather))
    jnnx.fully_shard(model)

    def explicit(model, batch):
        handle = model.block.unshard(async_op=True)
        handle.wait()
        out = tiny_loss(model, batch)
        model.block.reshard()
        return out

    graphdef, state = nnx.split(model)
    for fn, gathers in [(tiny_loss, 2), (explicit, 1)]:
        EVENTS.clear()
        step = jax.jit(lambda s, b, fn=fn: jnnx.value_and_grad(fn)(nnx.merge(graphdef, s), b))
        loss, g = step(state, TINY_BATCH)
        assert sum(e[0] == "gather" for e in forward_events()) == gathers
        np.testing.assert_allclose(loss, reference[0], rtol=1e-6)
        ref_kernel = reference[1]["block"]["kernel"][...]
        np.testing.assert_allclose(g["block"]["kernel"][...], ref_kernel, rtol=1e-5, atol=1e-7)


class Tied(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(11, 8, rngs=rngs)
        self.mix = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, tokens):
        return self.embed.attend(jnp.tanh(self.mix(self.embed(tokens))))


def test_register_fsdp_forward_method_gathers_for_attend():
    model = Tied(nnx.Rngs(0))
    tokens = {"x": jnp.arange(16).reshape(8, 2) % 11}
    loss = lambda m, b: jnp.mean(m(b["x"]) ** 2)  # noqa: E731
    ref_loss, ref_grads = nnx.value_and_grad(loss)(nnx.clone(model), tokens)
    jnnx.fully_shard(model.embed)
    jnnx.fully_shard(model)
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, b: jnnx.value_and_grad(loss)(nnx.merge(graphdef, s), b))
    with pytest.raises(RuntimeError, match=r"Param `embed.embedding` of a fully sharded module was read inside"):
        step(state, tokens)  # attend is not a registered forward method
    jnnx.register_fsdp_forward_method(model.embed, "attend")
    graphdef, state = nnx.split(model)
    value, g = jax.jit(lambda s, b: jnnx.value_and_grad(loss)(nnx.merge(graphdef, s), b))(state, tokens)
    np.testing.assert_allclose(value, ref_loss, rtol=1e-6)
    ref_embedding = ref_grads["embed"]["embedding"][...]
    np.testing.assert_allclose(np.asarray(g["embed"]["embedding"][...])[:11], ref_embedding, atol=1e-6)
    with pytest.raises(RuntimeError, match=r"`embed` \(Embed\) is fully sharded and was called outside the step"):
        model.embed.attend(jnp.ones((1, 8)))
    with pytest.raises(ValueError, match=r"`embed` \(Embed\) has no method `generate`"):
        jnnx.register_fsdp_forward_method(model.embed, "generate")


class Noisy(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(8, 2, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.lin(self.drop(x))


def test_non_param_state_updates_come_back():
    model = jnnx.fully_shard(Noisy(nnx.Rngs(0)))
    count0 = int(model.drop.rngs.count[...])
    step = nnx.jit(lambda m, b: jnnx.value_and_grad(tiny_loss)(m, b)[0])
    first, second = step(model, TINY_BATCH), step(model, TINY_BATCH)
    assert int(model.drop.rngs.count[...]) == count0 + 2
    assert float(first) != float(second)  # new dropout masks each step


def test_unshard_for_evaluation_matches_the_unsharded_model():
    model = tiny()
    reference = Tiny(nnx.Rngs(0))
    with pytest.raises(RuntimeError, match=r"the root module \(Tiny\) is fully sharded and was called outside"):
        model(TINY_BATCH["x"])
    np.testing.assert_allclose(jnnx.unshard(model)(TINY_BATCH["x"]), reference(TINY_BATCH["x"]), rtol=1e-6)
    with pytest.raises(RuntimeError, match=r"`blocks\[0\]` \(Rec\) holds gathered parameters"):
        lowered(model)
    jnnx.reshard(model)
    assert model.blocks[0].kernel.get_value().shape == (8, 16) and model.head.bias.get_value().shape == (8,)


# ----------------------------------------------------------------------------------------
# Misuse: errors name the module path and say what to do.


def test_error_child_sharded_after_its_root():
    model = Tiny(nnx.Rngs(0))
    jnnx.fully_shard(model)
    match = r"Module `blocks\[1\]` \(Rec\) already belongs to the unit of the root module \(Tiny\).*bottom-up"
    with pytest.raises(RuntimeError, match=match):
        jnnx.fully_shard(model.blocks[1])
    with pytest.raises(RuntimeError, match=r"the root module \(Tiny\) is already fully sharded"):
        jnnx.fully_shard(model)


class Pair(nnx.Module):
    def __init__(self, left, right):
        self.left = left
        self.right = right


def test_error_module_shared_by_two_parents():
    shared = jnnx.fully_shard(nnx.Linear(8, 8, rngs=nnx.Rngs(0)))
    shared_by_two = r"Module `{}` of module Pair is shared by two parents \(it is also {}\)"
    with pytest.raises(ValueError, match=shared_by_two.format("right", "at `left`")):
        jnnx.fully_shard(Pair(shared, shared))
    first, second = Pair(shared, nnx.Linear(8, 8, rngs=nnx.Rngs(1))), Pair(nnx.Linear(8, 8, rngs=nnx.Rngs(2)), shared)
    jnnx.fully_shard(first)
    earlier = r"`left` of another root module \(Pair\), sharded earlier"  # not this root: the other parent
    with pytest.raises(ValueError, match=shared_by_two.format("right", earlier)):
        jnnx.fully_shard(second)
    plain = nnx.Linear(8, 8, rngs=nnx.Rngs(3))
    jnnx.fully_shard(Pair(plain, nnx.Linear(8, 8, rngs=nnx.Rngs(4))))
    owned = r"`left` in the unit of the root module \(Pair\)"
    with pytest.raises(ValueError, match=shared_by_two.format("left", owned)):
        jnnx.fully_shard(Pair(plain, nnx.Linear(8, 8, rngs=nnx.Rngs(5))))


def test_error_step_misuse():
    with pytest.raises(ValueError, match=r"The step got Tiny, which is not fully sharded.*then on the root"):
        jnnx.value_and_grad(tiny_loss)(Tiny(nnx.Rngs(0)), TINY_BATCH)
    model = tiny()
    model.extra = nnx.Param(jnp.ones((3,)))
    with pytest.raises(ValueError, match=r"Param `extra` of the root module \(Tiny\) belongs to no unit"):
        lowered(model)
    with pytest.raises(TypeError, match="takes an nnx.Module"):
        jnnx.fully_shard({"w": jnp.ones(3)})
    with pytest.raises(ValueError, match=r"register_fsdp_forward_method got Linear, which is not fully sharded"):
        jnnx.register_fsdp_forward_method(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "__call__")
    outsider = jnnx.fully_shard(nnx.Linear(2, 2, rngs=nnx.Rngs(1)))  # sharded, but not part of the model
    with pytest.raises(ValueError, match=r"the root module \(Linear\) was called in a step that it is not part of"):
        jnnx.value_and_grad(lambda m, b: tiny_loss(m, b) + outsider(b["y"]).sum())(tiny(), TINY_BATCH)


class Normed(nnx.Module):
    def __init__(self, axis_name, rngs: nnx.Rngs):
        self.lin = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, axis_name=axis_name, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.lin(x))


def test_batch_norm_statistics_are_per_device_unless_named_over_the_mesh_axis():
    """docs/flax.md: inside the step each device normalises with its own batch's statistics;
    ``axis_name="fsdp"`` (the data-parallel axes) gives the global batch's, as unsharded training."""
    x = jax.random.normal(jax.random.key(0), (16, 4)) * jnp.arange(1.0, 17.0)[:, None]
    loss = lambda m, x: jnp.mean(m(x) ** 2)  # noqa: E731
    reference = Normed(None, nnx.Rngs(0))
    ref_loss, _ = nnx.value_and_grad(loss)(reference, x)
    step = nnx.jit(jnnx.value_and_grad(loss))  # one compile, not op-by-op dispatch
    per_device, _ = step(jnnx.fully_shard(Normed(None, nnx.Rngs(0))), x)
    model = jnnx.fully_shard(Normed("fsdp", nnx.Rngs(0)))
    global_batch, _ = step(model, x)
    assert abs(float(per_device) - float(ref_loss)) > 1e-5
    np.testing.assert_allclose(global_batch, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(model.bn.mean[...], reference.bn.mean[...], atol=1e-6)  # running stats too


def test_a_param_read_outside_its_forward_names_its_shard():
    """[Note: shard reads]: the NNX Param guard decides by the core's rule, so its error carries the
    same facts as a unit's: the parameter's shape, the shard read, the padded shape, the mesh axis."""
    peek = lambda m, b: tiny_loss(m, b) + m.blocks[1].kernel[...].sum()  # noqa: E731
    shard = (r"Param `blocks\[1\]\.kernel` of a fully sharded module was read inside the step while its module's "
             r"parameters are not gathered, so it holds this device's shard \(2, 24\) of the parameter's \(16, 24\) "
             r"\(padded to \(16, 24\), split over mesh axis 'fsdp' of size 8\)\. Read parameters inside the module's")
    with pytest.raises(RuntimeError, match=shard):
        jax.jit(jnnx.value_and_grad(peek)).lower(tiny(), TINY_BATCH)


def test_one_layer_of_a_stack_is_known_by_its_exact_shape():
    """[Note: NNX layer slices]: inside nnx.scan a stacked unit's Params hold one layer, known from
    the shapes their carried layout allows, not from ``ndim``. A scan over axis 1 hands the layer's
    module slices of neither shape (``ndim`` took them for one layer, and JAX failed in the gather's
    VJP); slicing some Params only leaves them disagreeing. Both are refused by name."""

    @nnx.split_rngs(splits=4)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return nnx.Linear(16, 16, rngs=rngs)

    stack = jnnx.fully_shard(create(nnx.Rngs(0)), policy=js.FullyShardPolicy(scan_axis=0))

    def loss_over(axis):
        run = nnx.scan(lambda x, layer: layer(x), in_axes=(nnx.Carry, axis), out_axes=nnx.Carry)
        return lambda model, batch: run(batch["x"], model).sum()

    batch = {"x": jnp.ones((8, 16))}
    jax.jit(jnnx.value_and_grad(loss_over(0))).lower(stack, batch)  # as Flax writes it: one layer per iteration
    neither = (r"Param `bias` of the root module \(Linear\), a stack of layers \(FullyShardPolicy\(scan_axis=0\)\), "
               r"holds shape \(4,\) inside the step, which is neither; its stack's shard is \(4, 2\) and one "
               r"layer's \(2,\) \(split over mesh axis 'fsdp' of size 8\).*nnx.scan or nnx.vmap over axis 0")
    with pytest.raises(ValueError, match=neither):
        jax.jit(jnnx.value_and_grad(loss_over(1))).lower(stack, batch)
    some_sliced = nnx.StateAxes({nnx.PathContains("kernel"): 0, ...: None})  # bias broadcast whole
    with pytest.raises(ValueError, match=r"Param `kernel` .* holds shape \(2, 16\) inside the step, while `bias` "
                                         r"holds its whole stack"):
        jax.jit(jnnx.value_and_grad(loss_over(some_sliced))).lower(stack, batch)
    stack.set_requires_gradient_sync(False)  # gathered up front: one layer is the parameter's slice
    jax.jit(jnnx.value_and_grad(loss_over(0))).lower(stack, batch)


def test_a_stack_under_nnx_vmap_gathers_one_layer_per_instance():
    """[Note: NNX layer slices]: nnx.vmap over a stacked unit (every layer on the same input) hands
    each instance one layer, known by the same carried shapes as inside nnx.scan."""

    @nnx.split_rngs(splits=4)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return nnx.Linear(16, 16, rngs=rngs)

    run = nnx.vmap(lambda layer, x: layer(x), in_axes=(0, None), out_axes=0)
    loss = lambda m, b: (run(m, b["x"]) ** 2).mean()  # noqa: E731
    batch = {"x": jnp.arange(128.0).reshape(8, 16) / 128}
    want = nnx.value_and_grad(loss)(create(nnx.Rngs(0)), batch)[0]
    stack = jnnx.fully_shard(create(nnx.Rngs(0)), policy=js.FullyShardPolicy(scan_axis=0))
    np.testing.assert_allclose(jax.jit(jnnx.value_and_grad(loss))(stack, batch)[0], want, rtol=1e-6)
