"""Property-based round trips and layouts over random shapes, dtypes, dims and meshes."""

import jax
import jax.numpy as jnp
import numpy as np
from helpers import assert_torch_layout
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jshard as js

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.int8]
MESHES = [(1, 8), (1, 4), (1, 2), (1, 1), (2, 4), (4, 2)]


@st.composite
def cases(draw):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(1, 20), min_size=ndim, max_size=ndim)))
    dtype = draw(st.sampled_from(DTYPES))
    dim = draw(st.none() | st.integers(-ndim, ndim - 1)) if ndim else None
    replicate, shard = draw(st.sampled_from(MESHES))
    seed = draw(st.integers(0, 2**16))
    return shape, dtype, dim, replicate, shard, seed


def _default_dim(shape, n):
    """docs/design.md's placement rule, independently: dim 0 unless more than half of the n devices would hold only
    padding there while another dim is at least n; then the largest such dim, the first of equal ones."""
    wide = [d for d in range(1, len(shape)) if shape[d] >= n]
    if 2 * shape[0] >= n or not wide:
        return 0
    return sorted(wide, key=lambda d: (-shape[d], d))[0]


def _mesh(replicate, shard):
    devices = jax.devices()[: replicate * shard]
    return js.make_mesh(replicate=replicate, devices=devices)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_round_trip_and_torch_layout(case):
    shape, dtype, dim, replicate, shard, seed = case
    rng = np.random.default_rng(seed)
    original = jnp.asarray((rng.normal(size=shape) * 50).astype(np.float32), dtype=dtype)
    mesh = _mesh(replicate, shard)
    policy = js.FullyShardPolicy(shard_placement_fn=lambda path, leaf: dim)
    sharded = js.fully_shard({"x": original}, mesh, policy)
    stored = sharded["x"]
    assert stored.dtype == original.dtype
    if original.ndim:
        placement = _default_dim(shape, shard) if dim is None else dim % original.ndim
        assert stored.shape[placement] == shard * -(-original.shape[placement] // shard)
        assert_torch_layout(stored, original, mesh, ("fsdp",), placement)
    else:
        assert stored.sharding.is_fully_replicated
    back = js.unshard(sharded)["x"]
    assert back.shape == original.shape and back.dtype == original.dtype
    np.testing.assert_array_equal(np.asarray(back), np.asarray(original))
    again = js.reshard({"x": back}, sharded)["x"]
    np.testing.assert_array_equal(np.asarray(again), np.asarray(stored))
