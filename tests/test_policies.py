"""Policies are frozen, hashable and validated on construction."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jshard as js


def test_policies_are_frozen_and_hashable():
    policies = [
        js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32),
        js.OffloadPolicy(),
        js.CPUOffloadPolicy(pin_memory=False),
        js.DataParallelMeshDims(shard=("a", "b"), replicate="r"),
        js.FullyShardPolicy(reshard_after_forward=2, scan_axis=0),
    ]
    for policy in policies:
        assert hash(policy) == hash(dataclasses.replace(policy))
        assert policy == dataclasses.replace(policy)
        field = dataclasses.fields(policy)[0].name if dataclasses.fields(policy) else None
        if field:
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(policy, field, None)


def test_mixed_precision_normalises_dtypes():
    mp = js.MixedPrecisionPolicy(param_dtype="bfloat16", reduce_dtype=np.float32)
    assert mp.param_dtype == jnp.bfloat16 and mp.reduce_dtype == np.float32
    assert mp.output_dtype is None


def test_memory_kinds():
    assert js.OffloadPolicy().memory_kind is None
    assert js.CPUOffloadPolicy().memory_kind == "pinned_host"
    assert js.CPUOffloadPolicy(pin_memory=False).memory_kind == "unpinned_host"


def test_mesh_dims_normalise_to_tuples():
    dims = js.DataParallelMeshDims(shard="fsdp")
    assert dims.shard == ("fsdp",) and dims.replicate == ()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: js.MixedPrecisionPolicy(param_dtype=jnp.int32), r"`param_dtype` must be a floating dtype"),
        (lambda: js.MixedPrecisionPolicy(reduce_dtype="nonsense"), r"`reduce_dtype` must be a dtype"),
        (lambda: js.MixedPrecisionPolicy(cast_forward_inputs=1), r"`cast_forward_inputs` must be a bool"),
        (lambda: js.CPUOffloadPolicy(pin_memory="yes"), r"`pin_memory` must be a bool"),
        (lambda: js.DataParallelMeshDims(shard=None), r"`shard` must name at least one mesh axis"),
        (lambda: js.DataParallelMeshDims(shard=("a", "a")), r"names an axis twice"),
        (lambda: js.DataParallelMeshDims(shard="a", replicate="a"), r"named both in `shard` and `replicate`"),
        (lambda: js.DataParallelMeshDims(shard=3), r"`shard` must be a mesh axis name"),
        (lambda: js.FullyShardPolicy(reshard_after_forward=1), r"must be at least 2; use True or False"),
        (lambda: js.FullyShardPolicy(reshard_after_forward="yes"), r"must be a bool, an int or None"),
        (lambda: js.FullyShardPolicy(scan_axis=1), r"`scan_axis` must be 0"),
        (lambda: js.FullyShardPolicy(mp_policy=jnp.bfloat16), r"`mp_policy` has the wrong type"),
        (lambda: js.FullyShardPolicy(shard_placement_fn=3), r"`shard_placement_fn` must be a callable"),
        (lambda: js.FullyShardPolicy(gradient_divide_factor=0), r"`gradient_divide_factor` must be a positive"),
        (lambda: js.FullyShardPolicy(force_sum_reduction_for_comms=1), r"must be a bool"),
    ],
)
def test_invalid_policies_raise_on_construction(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_make_mesh_shapes_and_errors():
    assert dict(js.make_mesh().shape) == {"fsdp": 8}
    assert dict(js.make_mesh(replicate=2).shape) == {"replicate": 2, "fsdp": 4}
    assert dict(js.make_mesh(devices=jax.devices()[:4]).shape) == {"fsdp": 4}
    with pytest.raises(ValueError, match=r"`replicate=3` does not divide the 8 devices"):
        js.make_mesh(replicate=3)
    with pytest.raises(ValueError, match=r"`replicate` must be a positive int"):
        js.make_mesh(replicate=0)
