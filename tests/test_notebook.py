"""The Colab notebook runs top to bottom (so it cannot rot), in a fresh kernel."""

import pathlib

import nbclient  # the test extra installs them: a missing one fails here instead of skipping
import nbformat
import pytest

NOTEBOOK = pathlib.Path(__file__).parent.parent / "examples" / "colab_fsdp.ipynb"


# 45 s: in the slow run. Its NNX pattern (fully_shard per block, the root, nnx.Optimizer, jnnx.value_and_grad)
# runs in the default run through docs/flax.md (tests/test_docs_snippets.py), its memory plot through the demo.
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # jupyter_client / zmq internals
def test_colab_notebook_executes(tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]
    text = "".join(out.get("text", "") for out in outputs if out.get("output_type") == "stream")
    assert "8 devices: cpu" in text
    assert "per-block units" in text and "one root unit" in text
    assert any("image/png" in out.get("data", {}) for out in outputs)  # the memory plot
    assert "outside the step: the root module (LM) is fully sharded and was called outside the step" in text
