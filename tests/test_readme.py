"""The README's commands and example stay true."""

import pathlib
import re
import subprocess

README = pathlib.Path(__file__).parent.parent / "README.md"


def _block_after(marker: str, lang: str) -> str:
    text = README.read_text()
    match = re.search(re.escape(marker) + r"\s*```" + lang + r"\n(.*?)```", text, re.S)
    assert match, f"no ```{lang} block after {marker} in README.md"
    return match.group(1)


def test_readme_example_runs():
    namespace: dict = {}
    exec(compile(_block_after("<!-- readme-example -->", "python"), "README.md", "exec"), namespace)
    assert namespace["full"]["blocks"]["w"].shape == (4, 64, 64)
    assert float(namespace["loss"]) < float("inf")


def test_ci_runs_the_readme_test_command():
    command = _block_after("<!-- test-command -->", "bash").strip()
    ci = subprocess.run(["bash", ".ci/run", "--print-command"], cwd=README.parent, capture_output=True, text=True,
                        check=True)
    assert ci.stdout.strip() == command
