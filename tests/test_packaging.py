"""The package as users get it: `python -m build` makes a wheel and an sdist, and the wheel installs
into a fresh virtual environment, imports, and carries the demo's data, the license and the version."""

import os
import pathlib
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import jshard

REPO = pathlib.Path(__file__).resolve().parents[1]


def _run(cmd, **kwargs):
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kwargs)
    assert done.returncode == 0, f"{cmd}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout, done.stderr


def test_the_wheel_and_sdist_build_and_the_wheel_installs_and_imports(tmp_path):
    dist = tmp_path / "dist"
    said = _run([sys.executable, "-m", "build", "--outdir", dist, REPO])  # an sdist, then a wheel built from it
    assert "deprecated" not in "".join(said), "".join(said)  # setuptools: `project.license` as a table, ...
    (wheel,), (sdist,) = dist.glob("*.whl"), dist.glob("*.tar.gz")
    version = jshard.__version__
    assert wheel.name == f"jshard-{version}-py3-none-any.whl" and sdist.name == f"jshard-{version}.tar.gz"
    names = zipfile.ZipFile(wheel).namelist()
    data = sorted(p.name for p in (REPO / "jshard" / "demo" / "data").glob("*.txt"))
    assert data and all(f"jshard/demo/data/{name}" in names for name in [*data, "README.md"])  # texts, their source
    assert f"jshard-{version}.dist-info/licenses/LICENSE" in names
    metadata = zipfile.ZipFile(wheel).read(f"jshard-{version}.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata.splitlines() and "License-File: LICENSE" in metadata
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
    members = tarfile.open(sdist).getnames()
    assert any(m.endswith("/LICENSE") for m in members) and any(m.endswith("/CHANGELOG.md") for m in members)

    env = tmp_path / "env"
    _run([sys.executable, "-m", "venv", env])
    python = env / "bin" / "python"
    # Its dependencies come from this interpreter's site-packages (no download), listed after its own
    # site-packages, so the wheel's jshard is found first (a venv's --system-site-packages would name
    # the base interpreter's, not this one's when it is itself a venv).
    site = next((env / "lib").glob("python*/site-packages"))
    outer = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "outer.pth").write_text("".join(f"{path}\n" for path in outer))
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing but the venv's paths
    # --ignore-installed: the outer jshard (CI installs the checkout) would satisfy pip otherwise
    _run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", wheel], env=clean)
    probe = ("import jshard, jshard.demo, pathlib; "
             "print(jshard.__version__, pathlib.Path(jshard.__file__).resolve(), len(jshard.demo.load_text()))")
    got_version, where, characters = _run([python, "-c", probe], cwd=tmp_path, env=clean)[0].split()
    assert got_version == version
    assert pathlib.Path(where).is_relative_to(env.resolve())  # the wheel's copy, not the checkout
    assert int(characters) > 10_000  # the demo's text, read from the installed package
