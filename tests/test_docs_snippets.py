"""Every Python block of README.md and docs/ runs in the tests.

A block preceded by a marker comment (``<!-- name -->``) is run by the test that names that
marker (it gives the block what it needs: a Hugging Face model, a mesh, a subprocess); the
Python blocks of the pages listed in ``PAGES`` run here, in order, in one namespace per page;
a block that needs several processes or a cluster is marked ``<!-- cpu-variant: path -->``,
naming the script the tests run as local CPU processes instead. ``text`` blocks are output.
Nothing else is allowed.
"""

import ast
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
    "docs/born_sharded.md": ["P(None, 'fsdp', None) P('fsdp', None)", "P('fsdp', None)", "P('fsdp', None)",
                             "P(None, 'fsdp') True"],
}
_MARKER = re.compile(r"^<!-- (.*?) -->$")


def fenced_blocks(page: str) -> list[tuple[str | None, str, str]]:
    """``(marker or None, language, code)`` for each fenced block of the page."""
    blocks, lines, i = [], (REPO / page).read_text().splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            j = next(k for k in range(i + 1, len(lines)) if lines[k].startswith("```"))
            before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            marker = _MARKER.match(before)
            blocks.append((marker.group(1) if marker else None, lines[i][3:].strip(), "\n".join(lines[i + 1:j]) + "\n"))
            i = j
        i += 1
    return blocks


def python_blocks(page: str) -> list[tuple[str | None, str]]:
    """``(marker or None, code)`` for each Python block of the page."""
    return [(marker, code) for marker, lang, code in fenced_blocks(page) if lang == "python"]


def _test_code_strings() -> list[str]:
    """The string literals of the test files' code: a marker in a docstring or a comment runs nothing."""
    found = []
    for path in (REPO / "tests").glob("test_*.py"):
        tree = ast.parse(path.read_text())
        statements = {id(n.value) for n in ast.walk(tree)  # docstrings and other bare strings
                      if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        found += [n.value for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in statements]
    return found


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_python_block_of_the_page_runs(page):
    out = io.StringIO()
    scope: dict = {"__name__": f"docs_{pathlib.Path(page).stem}"}
    with jax.numpy_dtype_promotion("standard"), contextlib.redirect_stdout(out):  # users' default promotion
        for marker, block in python_blocks(page):
            if marker is None:
                exec(compile(block, page, "exec"), scope)
    assert [line.strip() for line in out.getvalue().splitlines()] == PAGES[page]


def test_every_code_block_is_run_by_a_test():
    """Python and shell blocks alike (``text`` blocks are output, shown, not run). A marker counts where
    a test's code reads it (a string literal), not where a docstring or a comment mentions it."""
    strings = _test_code_strings()
    unrun = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        page = str(path.relative_to(REPO))
        for marker, lang, block in fenced_blocks(page):
            if lang not in ("python", "bash", "sh", ""):
                continue
            if marker is None and lang == "python" and page in PAGES:
                continue
            if marker and marker.startswith("cpu-variant: "):
                script = marker.split(": ", 1)[1]
                if (REPO / script).exists() and any(pathlib.Path(script).name in x for x in strings):
                    continue
            elif marker and any(f"<!-- {marker} -->" in x or x == marker for x in strings):
                continue
            unrun.append(f"{page}: {block.splitlines()[0] if block.strip() else '(empty)'}")
    assert unrun == [], "give each block a marker read by a test, or list its page in PAGES"


def test_the_readme_device_block_gives_eight_cpu_devices():
    (code,) = [b for m, b in python_blocks("README.md") if m == "readme-devices"]
    done = subprocess.run([sys.executable, "-c", code + "\nprint(len(jax.devices()))"], capture_output=True,
                          text=True, timeout=120, check=True, env={"JAX_PLATFORMS": "cpu", "PATH": ""})
    assert done.stdout.strip() == "8"
