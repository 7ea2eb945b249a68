"""The package layout: one home per job, layers that import downward only, no reaching into privates.

The module graph is read from the source (every import statement, at any depth), so a
lazy import inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import subprocess
import sys

import pytest

import jshard

PACKAGE = pathlib.Path(jshard.__file__).parent
REPO = PACKAGE.parent
MAX_LINES = 400

# Implementation layers, lowest first: a module imports only from its own layer or below.
LAYERS = {
    "jshard._multiprocess": 0,
    "jshard._sharding": 1,
    "jshard._step": 2,
    "jshard._state": 3,
    "jshard._report": 3,
    "jshard._plan": 4,
    "jshard.flax._paths": 4,
    "jshard.flax._nnx": 4,
    "jshard.flax._linen": 4,
}
CORE = ("jshard._multiprocess", "jshard._sharding", "jshard._step", "jshard._state", "jshard._report")
NOT_IN_CORE = ("flax", "tqdm", "matplotlib", "transformers", "jshard.flax", "jshard.demo")
FACADES = (
    "jshard.batch", "jshard.checkpoint", "jshard.collectives", "jshard.launch", "jshard.optim", "jshard.report",
    "jshard.state_dict", "jshard.flax", "jshard.flax.nnx", "jshard.flax.linen", "jshard.demo",
)


def _name(path: pathlib.Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def modules() -> dict[str, pathlib.Path]:
    return {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@functools.cache
def tree(name: str) -> ast.Module:
    return ast.parse(modules()[name].read_text())


def imported(name: str) -> list[tuple[str, list[str], int]]:
    """``(module, names, line)`` for every import in the module; ``from pkg import mod`` names the submodule."""
    out = []
    for node in ast.walk(tree(name)):
        if isinstance(node, ast.Import):
            out += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [a.name for a in node.names if f"{node.module}.{a.name}" in modules()]
            out += [(f"{node.module}.{s}", [], node.lineno) for s in subs]
            names = [a.name for a in node.names if a.name not in subs]
            if names:
                out.append((node.module, names, node.lineno))
    return out


def jshard_edges(name: str) -> set[str]:
    return {m for m, _, _ in imported(name) if m in modules() and m != name}


def layer(name: str) -> int | None:
    for prefix, level in LAYERS.items():
        if name == prefix or name.startswith(prefix + "."):
            return level
    return None


def test_no_module_is_over_400_lines():
    long = {n: len(p.read_text().splitlines()) for n, p in modules().items()}
    assert {n: lines for n, lines in long.items() if lines > MAX_LINES} == {}


def _private_imports(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jshard"):
            found += [f"{path.name}:{node.lineno} {a.name}" for a in node.names if a.name.startswith("_")]
    return found


def test_no_module_imports_another_modules_private_names():
    found = [hit for p in modules().values() for hit in _private_imports(p)]
    assert found == [], "import the name from where it is public, or make it public where it lives"


def test_tests_and_benchmarks_import_no_private_names():
    paths = [*REPO.joinpath("tests").rglob("*.py"), *REPO.joinpath("benchmarks").rglob("*.py")]
    assert [hit for p in paths for hit in _private_imports(p)] == []


def test_no_private_attribute_of_an_imported_module_is_read():
    found = []
    for name in modules():
        aliases = {}
        for node in ast.walk(tree(name)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jshard"):
                subs = [a for a in node.names if f"{node.module}.{a.name}" in modules()]
                aliases.update({a.asname or a.name: a.name for a in subs})
        for node in ast.walk(tree(name)):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{name}:{node.lineno} {node.value.id}.{node.attr}")
    assert found == []


def _cycle() -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(jshard_edges(n)):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(modules()):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_cycles():
    assert _cycle() is None


def test_layers_import_downward_only():
    upward = []
    for name in modules():
        mine = layer(name)
        if mine is None:
            continue  # facades, the demo: the top
        for target in jshard_edges(name):
            theirs = layer(target)
            if theirs is None or theirs > mine:
                upward.append(f"{name} -> {target}")
    assert upward == []


def _closure(names: list[str]) -> set[str]:
    seen, todo = set(), list(names)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += jshard_edges(n)
    return seen


def test_core_imports_neither_flax_nor_the_demo_nor_its_extras():
    core = [n for n in modules() if n.startswith(CORE)]
    reached = _closure(core)
    third_party = {m for n in reached for m, _, _ in imported(n)}
    bad = sorted(m for m in reached | third_party if m.split(".")[0] in NOT_IN_CORE or m.startswith(NOT_IN_CORE))
    assert bad == []


def test_importing_jshard_loads_no_flax_orbax_or_demo_libraries():
    probe = "import sys, jshard; print(sorted(m for m in ('flax', 'orbax', 'tqdm', 'matplotlib') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _is_facade_statement(node: ast.stmt) -> bool:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return True
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):  # the docstring
        return True
    if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
        return True
    return isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)


@pytest.mark.parametrize("name", FACADES)
def test_public_modules_are_facades(name):
    extra = [ast.unparse(n).splitlines()[0] for n in tree(name).body if not _is_facade_statement(n)]
    assert extra == [], f"{name} holds code: move it to the private module of its job and re-export it"


def test_every_module_is_on_the_map_in_docs_internals():
    text = (REPO / "docs" / "internals.md").read_text()
    missing = [str(p.relative_to(REPO)) for p in modules().values() if f"`{p.relative_to(REPO)}`" not in text]
    assert missing == []
