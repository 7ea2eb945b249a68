"""benchmarks.compare and benchmarks.memory_sweep, quick runs: every field, and jshard at or below the recipe."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIELDS = {"peak_bytes", "argument_bytes", "temp_bytes", "output_bytes", "collective_bytes",
          "collective_bytes_total", "step_seconds", "vs_gspmd"}


def test_quick_comparison(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.compare", "--quick", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "compare.json").read_text())
    assert (tmp_path / "compare.png").stat().st_size > 10_000
    assert results["quick"] and results["cases"]
    for case in results["cases"]:
        assert set(case) >= {"size", "params", "devices", "batch", "variants"}
        variants = case["variants"]
        assert set(variants) == {"replicated", "gspmd", "jshard"}
        for r in variants.values():
            assert set(r) >= FIELDS and r["step_seconds"] > 0 and r["peak_bytes"] > 0
        jshard, gspmd = variants["jshard"], variants["gspmd"]
        assert jshard["collective_bytes_total"] <= gspmd["collective_bytes_total"]
        # jshard reduces gradients with reduce-scatters, never a full all-reduce of them.
        assert jshard["collective_bytes"].get("reduce-scatter", 0) > 0
        assert jshard["peak_bytes"] <= gspmd["peak_bytes"]
    assert "| jshard |" in done.stdout


def test_quick_memory_sweep(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory_sweep", "--quick", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    models = json.loads((tmp_path / "memory_sweep.json").read_text())["models"]
    assert {(m["stacked"], m["kind"]) for m in models} == {(True, "mlp"), (False, "mlp")}
    for m in models:
        peaks = m["peak_bytes"]
        assert peaks["jshard"] <= peaks["recipe"], m["name"]  # same activation recomputation as the recipe
