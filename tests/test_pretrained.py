"""Pretrained weights from unsharded safetensors, Flax msgpack and Orbax checkpoints, placed leaf by leaf.

``load_pretrained`` gives exactly what ``load_full_state_dict`` of the whole tree gives (layout,
padding, memory kind, values) while reading each device's rows from the file alone; its host
peak stays within one leaf of the placed model where the whole-tree route's holds the model twice.
"""

import json
import pathlib

import flax.serialization
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax.traverse_util import flatten_dict
from jax.sharding import NamedSharding
from safetensors.numpy import save_file

import jshard as js
from jshard._state import pretrained
from jshard.state_dict import load_full_state_dict, load_pretrained


def _params():
    rng = np.random.default_rng(0)
    f32 = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    return {"block": {"w": f32(7, 15), "b": f32(16, 17)}, "head": f32(3, 40), "ids": np.arange(5, dtype=np.int32),
            "layers": [f32(9), f32(2, 3, 11)]}


def _write(folder: pathlib.Path, fmt: str, tree) -> str:
    if fmt == "safetensors":
        save_file({k: np.ascontiguousarray(v) for k, v in flatten_dict(flax.serialization.to_state_dict(tree),
                                                                          sep=".").items()}, folder / "m.safetensors")
        return str(folder / "m.safetensors")
    if fmt == "msgpack":
        (folder / "m.msgpack").write_bytes(flax.serialization.to_bytes(tree))
        return str(folder / "m.msgpack")
    ocp.PyTreeCheckpointer().save(folder / "orbax", tree)
    return str(folder / "orbax")


def _like(mesh, policy=None, dtype=np.float32):
    def build():
        p = jax.tree.map(lambda x: x.astype(dtype) if x.dtype == np.float32 else x, _params())
        return js.fully_shard({**p, "block": js.fully_shard(p["block"], mesh, policy)}, mesh, policy)

    return jax.eval_shape(build)


POLICIES = {
    "fsdp8": (lambda: js.make_mesh(), None),
    "hsdp2x4": (lambda: js.make_mesh(replicate=2), None),
    "offload": (lambda: js.make_mesh(), js.FullyShardPolicy(offload_policy=js.CPUOffloadPolicy())),
    "last_dim": (lambda: js.make_mesh(), js.FullyShardPolicy(shard_placement_fn=lambda p, x: -1 if x.ndim else None)),
}


@pytest.mark.parametrize("fmt", ["safetensors", "msgpack", "orbax"])
@pytest.mark.parametrize("name", POLICIES)
def test_each_format_loads_exactly_what_the_whole_tree_route_loads(tmp_path, fmt, name):
    mesh, policy = POLICIES[name]
    like = _like(mesh(), policy)
    got, want = load_pretrained(_write(tmp_path, fmt, _params()), like), load_full_state_dict(_params(), like)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert jax.typeof(g) == jax.typeof(w) and g.sharding.is_equivalent_to(w.sharding, g.ndim)
        assert g.sharding.memory_kind == w.sharding.memory_kind
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_a_hugging_face_index_of_several_safetensors_files_loads_as_one(tmp_path):
    flat = flatten_dict(flax.serialization.to_state_dict(_params()), sep=".")
    names = sorted(flat)
    files = {"a.safetensors": names[:3], "b.safetensors": names[3:]}
    for file, keys in files.items():
        save_file({k: flat[k] for k in keys}, tmp_path / file)
    index = {"metadata": {}, "weight_map": {k: file for file, keys in files.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    like = _like(js.make_mesh())
    got = load_pretrained(tmp_path / "model.safetensors.index.json", like)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(load_full_state_dict(_params(), like)), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_a_bfloat16_checkpoint_is_cast_to_the_leaves_dtype(tmp_path):
    import ml_dtypes

    half = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16) if x.dtype == np.float32 else x, _params())
    got = load_pretrained(_write(tmp_path, "safetensors", half), _like(js.make_mesh()))
    assert got["block"]["b"].dtype == np.float32
    np.testing.assert_array_equal(np.asarray(js.unshard(got)["block"]["b"]), half["block"]["b"].astype(np.float32))


def test_a_flax_array_over_the_chunk_size_is_read_across_its_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(flax.serialization, "MAX_CHUNK_SIZE", 64)  # 16 float32 per chunk: (16, 17) in 17 chunks
    path = _write(tmp_path, "msgpack", _params())
    assert b"__msgpack_chunked_array__" in pathlib.Path(path).read_bytes()
    got = load_pretrained(path, _like(js.make_mesh()))
    np.testing.assert_array_equal(np.asarray(js.unshard(got)["block"]["b"]), _params()["block"]["b"])


@pytest.mark.parametrize("fmt", ["safetensors", "msgpack"])
def test_each_device_reads_only_its_own_rows_from_the_file(tmp_path, fmt, monkeypatch):
    path, read = _write(tmp_path, fmt, _params()), []
    original = pretrained.read_block

    def spy(file, tensor, index):
        block = original(file, tensor, index)
        read.append((tensor.shape, block.shape))
        return block

    monkeypatch.setattr(pretrained, "read_block", spy)
    load_pretrained(path, _like(js.make_mesh()))
    assert {b for s, b in read if s == (16, 17)} == {(2, 17)}  # 8 devices, 2 rows each
    assert sorted(b for s, b in read if s == (7, 15)) == [(0, 15)] + [(1, 15)] * 7  # the last device: padding only


def test_a_leaf_of_another_shape_is_named_with_both_shapes(tmp_path):
    path = _write(tmp_path, "safetensors", {**_params(), "head": np.zeros((40, 3), np.float32)})
    with pytest.raises(ValueError, match=r"Leaf \['head'\]: `like` has shape \(3, 40\), but the checkpoint .* holds "
                                         r"'head' with shape \(40, 3\)"):
        load_pretrained(path, _like(js.make_mesh()))


def test_missing_and_extra_entries_are_named_and_names_maps_them(tmp_path):
    params = _params()
    path = _write(tmp_path, "msgpack", {"model": params, "rope": np.zeros(4, np.float32)})
    like = _like(js.make_mesh())
    with pytest.raises(ValueError, match=r"missing \['block.b', 'block.w', 'head', 'ids', 'layers.0'\] \(6\), "
                                         r"unexpected \['model.block.b'"):
        load_pretrained(path, like)
    with pytest.raises(ValueError, match=r"unexpected \['rope'\] \(1\)"):
        load_pretrained(path, like, names=lambda n: "model." + n)
    got = load_pretrained(path, like, names=lambda n: "model." + n, strict=False)
    np.testing.assert_array_equal(np.asarray(js.unshard(got)["layers"][1]), params["layers"][1])


def test_the_host_peak_stays_within_one_leaf_of_the_placed_model(tmp_path):
    """Fresh processes read their own peak resident set: leaf by leaf against the whole tree."""
    from benchmarks import pretrained_rss as bench

    shapes = bench.model_shapes(*bench.SIZES["quick"])
    leaves = [4 * int(np.prod(s)) for _, s in bench.leaf_shapes(shapes)]
    model, leaf, mib = sum(leaves), max(leaves), 2**20
    paths = bench.write_checkpoints(tmp_path, shapes)
    for fmt in ("safetensors", "msgpack", "orbax"):
        stream = bench.measure("stream", fmt, paths[fmt], "quick")
        assert stream["placed"] >= model
        assert stream["peak"] - stream["placed"] < leaf + 24 * mib, (fmt, stream)
    whole = bench.measure("whole", "safetensors", paths["safetensors"], "quick")
    assert whole["peak"] - whole["placed"] > 0.9 * model, whole


def test_a_hugging_face_flax_model_saved_by_save_pretrained_loads_into_its_born_sharded_units(tmp_path):
    """``save_pretrained`` writes ``model.safetensors`` or ``flax_model.msgpack``; the abstract ``like`` is the
    born-sharded ``init_weights`` of docs/born_sharded.md, traced by ``jax.eval_shape``: nothing is initialised."""
    import transformers
    from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2Block

    from jshard.flax import linen as jlinen

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=61, n_positions=16)
    with jax.numpy_dtype_promotion("standard"):
        saved = transformers.FlaxGPT2LMHeadModel(config, seed=0)
        saved.save_pretrained(tmp_path / "st", safe_serialization=True)
        saved.save_pretrained(tmp_path / "mp")
        model, ids = transformers.FlaxGPT2LMHeadModel(config, _do_init=False), np.ones((8, 16), np.int32)
        units = jlinen.ModuleUnits(FlaxGPT2Block)

        def init_hf(key):
            params = model.init_weights(key, ids.shape)
            return jlinen.shard_params(lambda p, i: model(i, params=p), params, ids, units=units)

        like = jax.eval_shape(init_hf, jax.random.key(1))
    for path in (tmp_path / "st" / "model.safetensors", tmp_path / "mp" / "flax_model.msgpack"):
        got = load_pretrained(path, like)
        assert tuple(got["transformer"]["h"]["0"]["attn"]["c_attn"]["kernel"].sharding.spec) == ("fsdp",)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(like), strict=True):  # `like`: an abstract mesh
            assert g.shape == w.shape and g.sharding.is_equivalent_to(NamedSharding(g.sharding.mesh, w.sharding.spec),
                                                                      g.ndim)
        for g, w in zip(jax.tree.leaves(js.unshard(got)), jax.tree.leaves(saved.params), strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
