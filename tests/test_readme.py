"""The README's commands and example stay true."""

import pathlib
import re
import shutil
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


# The README's test command, written here on its own: .ci/run and the README both read the
# README, so comparing the two alone would pass whatever the README said.
TEST_COMMAND = "python -m pip install -q '.[test]' && python -m pytest -q -n 2 --dist loadfile"


def test_ci_runs_the_readme_test_command(tmp_path):
    assert _block_after("<!-- test-command -->", "bash").strip() == TEST_COMMAND
    ci = subprocess.run(["bash", ".ci/run", "--print-command"], cwd=README.parent, capture_output=True, text=True,
                        check=True)
    assert ci.stdout == TEST_COMMAND + "\n"
    (tmp_path / ".ci").mkdir()  # .ci/run runs the command it finds: a copy, with a README whose command echoes
    shutil.copy(README.parent / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "README.md").write_text("Tests:\n\n<!-- test-command -->\n```bash\necho ran in $PWD\n```\n")
    ran = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, check=True)
    assert ran.stdout == f"ci: echo ran in $PWD\nran in {tmp_path}\n"
