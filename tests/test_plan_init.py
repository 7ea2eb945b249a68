"""``python -m jshard.report plan --init``: a born-sharded init program compiled for N devices, compile only,
its per-device peak against the model's 1/N share ([Note: init plan])."""

import json

import jax
import pytest

import jshard as js
from jshard.report import main, plan_init


def test_the_command_line_plans_an_init_program_that_holds_its_share(capsys):
    main(["plan", "jshard.demo.llama3:build_init_tiny", "--init", "--devices", "8", "--json"])
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    share, model, largest, memory = got["share_bytes"], got["model_bytes"], got["largest_shard_bytes"], got["memory"]
    assert got["devices"] == 8 and got["target"] == "jshard.demo.llama3:build_init_tiny"
    assert share == model // 8 and share <= memory["output"] <= share + 1024  # plus the output tuple's pointers
    peak = memory["argument"] + memory["output"] + memory["temp"] - memory["alias"]
    assert peak <= share + 4 * largest + 16 * 1024 < model / 3  # the share and one leaf's threefry words


def test_a_replicated_init_program_shows_the_whole_model_per_device():
    """The plan reads the outputs' shardings, so an initialiser that does not shard is seen as it is."""
    def build(mesh):
        return (lambda key: {"w": jax.random.normal(key, (1024, 512))}), (jax.random.key(0),)

    p = plan_init(build, devices=8)
    assert p.share_bytes == p.model_bytes == 1024 * 512 * 4 and p.memory.peak >= p.model_bytes
    sharded = plan_init(lambda mesh: (lambda key: js.fully_shard(build(mesh)[0](key), mesh), build(mesh)[1]),
                        devices=8)
    assert sharded.share_bytes == p.model_bytes // 8 and "1/8 share per device: 0.25 MiB" in str(sharded)


@pytest.mark.slow
def test_llama_3_70b_initialised_on_256_devices_holds_about_its_share_compile_only():
    """Compile only, 256 simulated CPU devices: 263 GiB of fp32 parameters, about 1 GiB each."""
    p = plan_init("jshard.demo.llama3:build_init_70b", devices=256)
    print(p)
    assert p.devices == 256 and p.model_bytes > 260 * 2**30
    assert p.share_bytes <= 1.01 * p.model_bytes / 256 and p.memory.output <= p.share_bytes + 2**20
    # the share plus the transients of drawing one leaf (the 80 stacked FFN weights: 280 MiB a device)
    assert p.memory.peak <= p.share_bytes + 8 * p.largest_shard_bytes < p.model_bytes / 80
