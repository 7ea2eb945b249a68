"""jshard's lowest peak per model over the stored sweeps of its options, against the best recipe.

``python -m benchmarks.options_per_model --target tpu_v5p_2x2x2`` reads the six training-step
sweeps of :mod:`benchmarks.memory_sweep` stored for that target (``--apply-sgd``: vectors sharded
or kept whole by ``--replicate-below 4096``, weight gradients reduced or ``from_activations``,
vectors sharded with weight gradients ``in_blocks``, and vectors whole with
``from_activations+in_blocks``), takes for each model the lowest of jshard's six peaks and the
lowest recipe peak of the files (the recipes compile to the same figures in each), and prints a
Markdown row for each model whose lowest jshard peak is still above that recipe: what ``python -m
jshard.report frontier ... --replicate-below 0,4096 --weight-gradients all`` can choose between,
per model (docs/benchmarks.md, "The options searched per model"). It first says how many models
jshard's own defaults on that target leave above the recipe ([Note: platform defaults]: the
option sweep they equal). Nothing is compiled.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

from benchmarks.memory_sweep import RESULTS, exceeds, options_suffix
from jshard._sharding.platform_defaults import platform_layout
from jshard.report import CompileTarget

# The options, by name: (replicate_below, weight_gradients) as memory_sweep's sweeps ran them.
OPTIONS = {"vectors sharded, reduced": (0, "reduced"), "vectors whole, reduced": (4096, "reduced"),
           "vectors sharded, routed": (0, "from_activations"), "vectors whole, routed": (4096, "from_activations"),
           "vectors sharded, in blocks": (0, "in_blocks"), "vectors whole, both": (4096, "from_activations+in_blocks")}


def option_files(target: str, folder: pathlib.Path = RESULTS) -> dict[str, pathlib.Path]:
    """The stored training-step sweep of each option for ``target`` (``tpu_v5p_2x2x2``,
    ``tpu_v5p_2x2x2_async``, ``tpu_v6e_2x4``), by option name."""
    return {name: folder / f"memory_sweep_{target}{options_suffix(*options, True, True)}.json"
            for name, options in OPTIONS.items()}


def best_per_model(sweeps: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """For each model of the first sweep: the best recipe's peak over all sweeps, and jshard's lowest
    peak with the option that gives it (``sweeps``: stored sweep results by option name).

    Example:
      >>> row = lambda name, recipe, jshard: {"name": name, "peak_bytes": {
      ...     "recipe": recipe, "constrained": recipe + 1, "jshard": jshard}}
      >>> best_per_model({"a": {"models": [row("m", 10, 12)]}, "b": {"models": [row("m", 10, 9)]}})
      [{'name': 'm', 'recipe': 10, 'jshard': 9, 'option': 'b'}]
    """
    by_option = {option: {r["name"]: r["peak_bytes"] for r in sweep["models"]} for option, sweep in sweeps.items()}
    first = next(iter(by_option.values()))
    rows = []
    for name in first:
        peaks = {option: models[name] for option, models in by_option.items() if name in models}
        recipe = min(min(p["recipe"], p["constrained"]) for p in peaks.values())
        option = min(peaks, key=lambda o: peaks[o]["jshard"])
        rows.append({"name": name, "recipe": recipe, "jshard": peaks[option]["jshard"], "option": option})
    return rows


def default_option(target: str) -> str:
    """The option whose sweep jshard's defaults compile to on ``target`` (a stored sweep's target name).

    Example:
      >>> default_option("tpu_v6e_2x4_async"), default_option("cpu_8")
      ('vectors whole, both', 'vectors sharded, reduced')
    """
    layout = platform_layout(CompileTarget.parse(":".join(target.removesuffix("_async").split("_", 2))).device_kind)
    return next(name for name, options in OPTIONS.items()
                if options == (layout["replicate_below"], layout["weight_gradients"]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="tpu_v5p_2x2x2",
                        help="the stored sweeps' target, as in their names (tpu_v5p_2x2x2, tpu_v5p_2x2x2_async, "
                             "tpu_v6e_2x4)")
    parser.add_argument("--results", type=pathlib.Path, default=RESULTS, help="the folder of the stored sweeps")
    args = parser.parse_args(argv)
    files = option_files(args.target, args.results)
    missing = [str(path) for path in files.values() if not path.exists()]
    if missing:
        raise SystemExit(f"No stored sweep {', '.join(missing)}: run benchmarks.memory_sweep --apply-sgd with "
                         "that option first.")
    sweeps = {option: json.loads(path.read_text()) for option, path in files.items()}
    rows = best_per_model(sweeps)
    above = [r for r in rows if exceeds(r["jshard"], r["recipe"])]
    mib = 2**20
    default = default_option(args.target)
    recipes = {r["name"]: r["recipe"] for r in rows}
    peaks = [(m["peak_bytes"]["jshard"], recipes[m["name"]]) for m in sweeps[default]["models"]]
    print(f"{args.target}: jshard's defaults ({default}) above the best recipe in "
          f"{sum(exceeds(*p) for p in peaks)} of {len(peaks)} models, worst {max(a / b for a, b in peaks):.3f}")
    print(f"{args.target}: jshard's lowest of {len(files)} options above the best recipe in {len(above)} of "
          f"{len(rows)} models")
    print("| model | best recipe MiB | jshard's lowest MiB | ratio | option |\n|---|---|---|---|---|")
    for r in above:
        print(f"| {r['name']} | {r['recipe'] / mib:.2f} | {r['jshard'] / mib:.2f} | {r['jshard'] / r['recipe']:.3f} "
              f"| {r['option']} |")


if __name__ == "__main__":
    main()
