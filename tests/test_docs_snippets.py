"""The Python blocks of the documentation run as written, in order, one namespace per page."""

import contextlib
import io
import pathlib
import re

import jax
import pytest

DOCS = pathlib.Path(__file__).parents[1] / "docs"
PAGES = {  # page -> lines its blocks must print
    "fsdp2.md": ["(16, 16)", "(None, 'fsdp') pinned_host", "True", "(1, 4)", "(7, 3)", "210.0"],
}


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_python_block_runs(page):
    out = io.StringIO()
    scope: dict = {"__name__": f"docs_{page}"}
    with jax.numpy_dtype_promotion("standard"), contextlib.redirect_stdout(out):  # users' default promotion
        for block in python_blocks((DOCS / page).read_text()):
            exec(compile(block, f"docs/{page}", "exec"), scope)
    printed = [line.strip() for line in out.getvalue().splitlines()]
    assert printed == PAGES[page]
