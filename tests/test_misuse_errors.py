"""The mistakes newcomers make with sharded trees get a jshard error naming the leaf and the fix."""

import jax
import jax.numpy as jnp
import pytest

import jshard as js


def test_reading_a_shard_inside_the_step_without_unshard():
    params = js.fully_shard({"w": jnp.ones((12, 3)), "s": jnp.float32(2.0)})
    shard = r"Leaf \['w'\] of shape \(12, 3\) was read from its unit inside the step without js.unshard.*shard "
    shard += r"\(2, 3\) \(of the padded \(16, 3\), split over mesh axis 'fsdp' of size 8\).*Call js.unshard\(unit\)"
    with pytest.raises(RuntimeError, match=shard):
        js.value_and_grad(lambda p, x: jnp.mean(x @ p["w"]), unshard_params=False)(params, jnp.ones((16, 12)))
    # what the message prescribes works, and replicated leaves (0-d) may be read as they are
    loss, _ = js.value_and_grad(lambda p, x: jnp.mean(x @ js.unshard(p)["w"]) * p["s"], unshard_params=False)(
        params, jnp.ones((16, 12))
    )
    assert float(loss) == 24.0


def test_jax_grad_of_sharded_params_names_the_padded_leaf():
    params = js.fully_shard({"w": jnp.ones((12, 3))})
    padded = r"Leaf \['w'\] of shape \(12, 3\) is stored padded to \(16, 3\).*under jax.grad.*js.value_and_grad"
    with pytest.raises(RuntimeError, match=padded):
        jax.value_and_grad(lambda p, x: jnp.mean(x @ p["w"]))(params, jnp.ones((16, 12)))
    with pytest.raises(RuntimeError, match=padded):
        jax.jit(jax.grad(lambda p, x: jnp.mean(x @ p["w"])))(params, jnp.ones((16, 12)))
    with pytest.raises(RuntimeError, match=padded):  # forward mode too
        jax.jvp(lambda p: jnp.mean(p["w"]), (params,), (params,))
    with jax.set_mesh(params.meta.mesh):  # js.make_mesh's axes are Explicit: plain jit needs the mesh set
        assert float(jax.jit(lambda p: p["w"].sum())(params)) == 36.0  # reading padded leaves elsewhere is fine
        unpadded = js.fully_shard({"w": jnp.ones((16, 3))})  # no padding: the global array's gradient is right
        assert jax.grad(lambda p: p["w"].sum())(unpadded)["w"].shape == (16, 3)



def test_shape_dependent_optax_state_on_explicit_mesh_axes():
    """README: js.shard_optimizer needs no mesh context; plain Optax with factored state needs jax.set_mesh
    on jax 0.10 (jax 0.12 no longer does)."""
    import optax

    params = js.fully_shard({"w": jnp.ones((250, 130))})  # large enough for Adafactor to factor
    assert params.meta.mesh.axis_types == (jax.sharding.AxisType.Explicit,)
    assert len(jax.tree.leaves(js.shard_optimizer(optax.adafactor(1e-2)).init(params))) > 0
    if jax.__version_info__ < (0, 11):
        with pytest.raises(ValueError, match=r"jax.set_mesh"):
            optax.adafactor(1e-2).init(params)
    with jax.set_mesh(params.meta.mesh):
        assert len(jax.tree.leaves(optax.adafactor(1e-2).init(params))) > 0
