"""Every Python block of README.md and docs/ runs in the tests.

A block preceded by a marker comment (``<!-- name -->``) is run by the test that reads that
marker (it gives the block what it needs: a Hugging Face model, a mesh); the blocks of the
pages listed in ``PAGES`` run here, in order, in one namespace per page; a block that needs
several processes is marked ``<!-- cpu-variant: path -->``, naming the script that runs the
same code on CPU processes in the tests. Nothing else is allowed.
"""

import contextlib
import io
import pathlib
import re
import subprocess
import sys

import jax
import pytest

REPO = pathlib.Path(__file__).parents[1]
PAGES = {  # page -> the lines its blocks print
    "docs/fsdp2.md": ["(16, 16)", "(None, 'fsdp') pinned_host", "True", "(1, 4)", "(7, 3)", "210.0"],
    "docs/flax.md": ["True", "True", "True"],
}
_BLOCK = re.compile(r"(?:<!-- ([^>]*?) -->\s*)?^```python\n(.*?)^```", re.S | re.M)


def python_blocks(page: str) -> list[tuple[str | None, str]]:
    """``(marker or None, code)`` for each Python block of the page."""
    return [(m.group(1), m.group(2)) for m in _BLOCK.finditer((REPO / page).read_text())]


def _tests_text() -> str:
    return "\n".join(p.read_text() for p in (REPO / "tests").glob("test_*.py"))


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_python_block_of_the_page_runs(page):
    out = io.StringIO()
    scope: dict = {"__name__": f"docs_{pathlib.Path(page).stem}"}
    with jax.numpy_dtype_promotion("standard"), contextlib.redirect_stdout(out):  # users' default promotion
        for marker, block in python_blocks(page):
            if marker is None:
                exec(compile(block, page, "exec"), scope)
    assert [line.strip() for line in out.getvalue().splitlines()] == PAGES[page]


def test_every_python_block_is_run_by_a_test():
    tests = _tests_text()
    unrun = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        page = str(path.relative_to(REPO))
        for marker, block in python_blocks(page):
            if marker is None and page in PAGES:
                continue
            if marker and marker.startswith("cpu-variant: "):
                script = marker.split(": ", 1)[1]
                if (REPO / script).exists() and pathlib.Path(script).name in tests:
                    continue
            elif marker and f"<!-- {marker} -->" in tests:
                continue
            unrun.append(f"{page}: {block.splitlines()[0]}")
    assert unrun == [], "give each block a marker read by a test, or list its page in PAGES"


def test_the_readme_device_block_gives_eight_cpu_devices():
    (code,) = [b for m, b in python_blocks("README.md") if m == "readme-devices"]
    done = subprocess.run([sys.executable, "-c", code + "\nprint(len(jax.devices()))"], capture_output=True,
                          text=True, timeout=120, check=True, env={"JAX_PLATFORMS": "cpu", "PATH": ""})
    assert done.stdout.strip() == "8"  # <!-- readme-devices -->
