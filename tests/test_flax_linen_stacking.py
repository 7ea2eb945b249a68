"""Linen units learn that they are stacked from the params, carried through nn.scan / nn.vmap as
Flax carries sharding metadata (``AxisMetadata.remove_axis``), never by comparing shapes."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from jshard.flax import linen as jlinen


class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return jnp.tanh(nn.Dense(8, name="dense")(x)), None


class Model(nn.Module):
    """Embeddings, ``layers`` wrapped blocks (stacked by nn.scan, or unrolled), and a tied head
    that reads the embedding through ``variables`` as Hugging Face models do."""

    block: type
    scan: bool = True
    axis: int = 0

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(16, 8, name="embed")(tokens)
        if self.scan:
            stack = nn.scan(self.block, variable_axes={"params": self.axis}, split_rngs={"params": True}, length=3)
            x, _ = stack(name="blocks")(x, None)
        else:
            for i in range(3):
                x, _ = self.block(name=f"block_{i}")(x, None)
        return x @ self.variables["params"]["embed"]["embedding"].T


def _sharded(scan=True, axis=0):
    model = jlinen.fully_shard(Model)(jlinen.fully_shard(Layer), scan=scan, axis=axis)
    tokens = jnp.zeros((8, 4), jnp.int32)
    params = Model(Layer, scan=scan, axis=axis).init(jax.random.key(0), tokens)["params"]
    return jlinen.shard_params(model, params, tokens)


def test_a_unit_inside_nn_scan_is_stacked_and_an_unrolled_one_is_not():
    params = _sharded(scan=True)
    assert params["blocks"].meta.policy.scan_axis == 0
    assert params["blocks"]["dense"]["kernel"].shape == (3, 8, 8)  # the stacked axis is not split
    assert params.meta.policy.scan_axis is None  # the root, whose tied head read plain arrays
    unrolled = _sharded(scan=False)
    assert all(unrolled[f"block_{i}"].meta.policy.scan_axis is None for i in range(3))


def test_params_split_on_another_axis_are_refused():
    with pytest.raises(ValueError, match=r"(?s)`blocks` is wrapped with jshard\.flax\.linen\.fully_shard and called "
                                         r"where lifted transforms split its params unlike one stack of layers "
                                         r"\(blocks/dense/bias split on \[1\].*along axis 0 only"):
        _sharded(axis=1)
