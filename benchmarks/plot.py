"""Plot ``compare.json``: memory per device and step time against device count and model size."""

from __future__ import annotations

import pathlib
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"replicated": "tab:gray", "gspmd": "tab:blue", "gspmd_constrained": "tab:green", "jshard": "tab:orange"}


def _series(cases: list[dict[str, Any]], size: str, variant: str, key: str) -> tuple[list[int], list[float]]:
    rows = sorted((c["devices"], c["variants"][variant][key]) for c in cases if c["size"] == size)
    return [d for d, _ in rows], [v for _, v in rows]


def plot(results: dict[str, Any], path: pathlib.Path) -> pathlib.Path:
    """Rows: peak MiB per device, step ms; columns: model sizes; x: devices. Returns ``path``."""
    cases = results["cases"]
    sizes = list(dict.fromkeys(c["size"] for c in cases))
    devices = sorted({c["devices"] for c in cases})
    fig, axes = plt.subplots(2, len(sizes), figsize=(4.2 * len(sizes), 7), squeeze=False)
    for col, size in enumerate(sizes):
        params = next(c["params"] for c in cases if c["size"] == size)
        for variant, color in COLORS.items():
            if variant not in cases[0]["variants"]:
                continue
            x, peak = _series(cases, size, variant, "peak_bytes")
            _, secs = _series(cases, size, variant, "step_seconds")
            axes[0][col].plot(x, [p / 2**20 for p in peak], "o-", color=color, label=variant)
            axes[1][col].plot(x, [s * 1e3 for s in secs], "o-", color=color, label=variant)
        axes[0][col].set_title(f"{size} ({params / 1e6:.2f}M params)")
        axes[0][col].set_ylabel("peak memory per device (MiB)")
        axes[1][col].set_ylabel("median step time (ms)")
        for ax in axes[:, col]:
            ax.set_xscale("log", base=2)
            ax.set_xticks(devices, [str(d) for d in devices])
            ax.set_xlabel("devices")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.suptitle(f"replicated vs GSPMD FSDP recipe vs jshard ({results['backend']}, {results['cpu_count']} cores, "
                 "same model, mesh and batch)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    import json
    import sys

    source = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent / "results/compare.json")
    print(plot(json.loads(source.read_text()), source.with_suffix(".png")))
