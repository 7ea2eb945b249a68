"""Recompute happens once: a ``remat_policy`` passed to the step costs what the same policy on
``jax.checkpoint(layer)`` costs the GSPMD recipe ([Note: recompute once] in ``segments.py``)."""

import jax
import pytest
from helpers import recipe_and_jshard_flops

import jshard as js

POLICIES = {"nothing_saveable": jax.checkpoint_policies.nothing_saveable,
            "dots_saveable": jax.checkpoint_policies.dots_saveable,
            "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            "everything_saveable": jax.checkpoint_policies.everything_saveable}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_matmul_flops_equal_the_recipes_with_the_same_policy(name):
    result = recipe_and_jshard_flops(js.make_mesh(), POLICIES[name], layers=8, width=512)
    forward = 8 * 2 * (64 // 8) * 512 * 512
    assert result["jshard"] == result["recipe"]
    assert result["jshard"] == (4 if name == "nothing_saveable" else 3) * forward
    assert result["jshard peak"] <= result["recipe peak"]
