"""Per-device memory of the step from ``memory_analysis()`` against docs/design.md's bound.

An 8-layer stacked MLP, 512 wide, fp32, batch 256 on 8 devices, compiled on abstract
inputs. One layer is ``W*W*4`` bytes = 1 MiB. The bound for ``reshard_after_forward=True``
is two gathered layers + one layer's full gradient + activations (the per-layer inputs
saved for backward) + the sharded gradient accumulator; ``False`` adds the saved gathered
layers; ``k`` adds copies sharded over groups of ``k``.
"""

import jax
import jax.numpy as jnp
import pytest

import jshard as js

L, W, B, N = 8, 512, 256, 8
LAYER = W * W * 4
ACTIVATIONS = L * (B // N) * W * 4 * 2  # inputs and tanh outputs kept per layer
ACCUMULATOR = L * LAYER // N


def _memory(raf):
    params = {"w": jax.ShapeDtypeStruct((L, W, W), jnp.float32), "b": jax.ShapeDtypeStruct((L, W), jnp.float32)}
    sharded = js.fully_shard(params, policy=js.FullyShardPolicy(scan_axis=0, reshard_after_forward=raf))

    def loss_fn(p, x):
        h, _ = js.scan(lambda h, layer: (jnp.tanh(h @ layer["w"] + layer["b"]), None), x, p)
        return jnp.mean(h**2)

    step = jax.jit(js.value_and_grad(loss_fn, unshard_params=False))
    memory = step.lower(sharded, jax.ShapeDtypeStruct((B, W), jnp.float32)).compile().memory_analysis()
    return memory


def test_arguments_are_one_nth_of_the_parameters():
    memory = _memory(True)
    params_bytes = L * (W * W + W) * 4
    assert memory.argument_size_in_bytes == params_bytes // N + (B // N) * W * 4  # params / N + the local batch


def test_resharding_after_forward_keeps_about_two_layers_gathered():
    bound = 2 * LAYER + LAYER + ACTIVATIONS + ACCUMULATOR
    temp = _memory(True).temp_size_in_bytes
    assert temp <= bound, (temp, bound)
    assert temp >= LAYER  # at least one layer is really gathered at a time


@pytest.mark.parametrize("k", [2, 4])
def test_saving_group_copies_adds_k_over_n_of_the_stack(k):
    base = _memory(True).temp_size_in_bytes
    grown = _memory(k).temp_size_in_bytes - base
    assert abs(grown - L * LAYER * k // N) <= LAYER // 8, (grown, L * LAYER * k // N)


def test_not_resharding_saves_every_gathered_layer():
    base = _memory(True).temp_size_in_bytes
    grown = _memory(False).temp_size_in_bytes - base
    assert L * LAYER - 2 * LAYER <= grown <= L * LAYER + LAYER // 8, (grown, L * LAYER)


@pytest.mark.parametrize("raf", [True, False])
def test_activation_policy_recomputes_each_layer_in_its_backward_iteration(raf):
    # Activations dominate here: 8 layers x (1024 x 512) f32 = 2 MiB per activation per
    # layer. nothing_saveable keeps only each layer's input (L x 2 MiB); the gathered
    # layers kept by reshard_after_forward=False (L x 1 MiB) stay kept.
    params = {"w": jax.ShapeDtypeStruct((L, W, W), jnp.float32)}
    x = jax.ShapeDtypeStruct((8192, W), jnp.float32)
    sharded = js.fully_shard(params, policy=js.FullyShardPolicy(scan_axis=0, reshard_after_forward=raf))

    def loss_fn(p, x):
        def block(h, layer):
            a = jnp.tanh(h @ layer["w"])
            return jnp.sin(a) * jnp.cos(h), None

        h, _ = js.scan(block, x, p)
        return jnp.mean(h**2)

    def temp(policy):
        step = jax.jit(js.value_and_grad(loss_fn, unshard_params=False, remat_policy=policy))
        return step.lower(sharded, x).compile().memory_analysis().temp_size_in_bytes

    activation = 8192 // N * W * 4
    saved_inputs = L * activation
    kept_layers = 0 if raf else L * LAYER
    remat = temp(jax.checkpoint_policies.nothing_saveable)
    assert remat <= saved_inputs + kept_layers + 6 * activation + 3 * LAYER, remat  # + one backward iteration
    assert temp(None) >= remat + L * activation  # without it, more than one activation per layer is kept
