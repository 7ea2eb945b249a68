"""The documentation site builds in strict mode: every warning, broken link and missing reference fails."""

import pathlib
import subprocess
import sys

DOCS = pathlib.Path(__file__).parents[1] / "docs"


def test_the_site_builds_strictly_with_the_api_reference(tmp_path):
    done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "-n", "-q", "-b", "html", str(DOCS), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    pages = {p.stem for p in DOCS.glob("*.md")}
    assert pages <= {p.stem for p in tmp_path.glob("*.html")}  # every page is on the site (a toctree misses none)
    api = (tmp_path / "api.html").read_text()
    for name in ("jshard.fully_shard", "jshard.value_and_grad", "jshard.report.plan", "jshard.launch.steps",
                 "jshard.checkpoint.CheckpointManager", "jshard.flax.nnx.fully_shard"):
        assert f'id="{name}"' in api, name  # generated from the docstrings
