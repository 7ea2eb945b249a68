"""Print, as JSON, when the all-gathers of unrolled units run on v5p 2x2x2.

``python tests/tpu_gather_schedule.py WIDTH leaf|unit|whole [...]``: four 1-unit GELU blocks of
``WIDTH`` (benchmarks/memory_sweep.py's model, activations kept), per-leaf gathers or one per
unit (``unit_collectives=True``); ``whole``: four 1-unit tanh layers of ``WIDTH`` with their
biases kept whole (``replicate_below=4096``). Each is compiled by XLA:TPU with whatever
``LIBTPU_INIT_ARGS`` the process was started with (libtpu reads them once, so tests run this in a
subprocess); prints ``{"leaf": [...], ...}`` for the kinds asked.
"""

import dataclasses
import json
import sys

from benchmarks import memory_sweep
from jshard._report.schedule import gather_schedule
from jshard.report import CompileTarget


def schedule(width: int, per: str) -> list[dict]:
    mesh = memory_sweep.target_mesh(CompileTarget.parse("tpu:v5p:2x2x2"))
    if per == "whole":
        model = memory_sweep.Model("tanh", False, 4, width, 64, remat=False)
        step, args = memory_sweep.jshard_step(model, mesh, replicate_below=4096)
    else:
        model = memory_sweep.Model("gelu", False, 4, width, 64, remat=False)
        step, args = memory_sweep.jshard_step(model, mesh, unit_collectives=per == "unit")
    hlo = step.lower(*args).compile().as_text()
    return [dataclasses.asdict(g) for g in gather_schedule(hlo)]


if __name__ == "__main__":
    print(json.dumps({per: schedule(int(sys.argv[1]), per) for per in sys.argv[2:]}))
