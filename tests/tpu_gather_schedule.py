"""Print, as JSON, when the all-gathers of unrolled GELU units run on v5p 2x2x2.

``python tests/tpu_gather_schedule.py WIDTH leaf|unit [leaf|unit]``: four 1-unit GELU blocks of
``WIDTH`` (benchmarks/memory_sweep.py's model, activations kept), per-leaf gathers or one per
unit (``unit_collectives=True``), each compiled by XLA:TPU with whatever ``LIBTPU_INIT_ARGS`` the
process was started with (libtpu reads them once, so tests run this in a subprocess); prints
``{"leaf": [...], "unit": [...]}`` for the kinds asked.
"""

import dataclasses
import json
import sys

from benchmarks import memory_sweep
from jshard._report.schedule import gather_schedule
from jshard.report import CompileTarget


def schedule(width: int, per: str) -> list[dict]:
    mesh = memory_sweep.target_mesh(CompileTarget.parse("tpu:v5p:2x2x2"))
    model = memory_sweep.Model("gelu", False, 4, width, 64, remat=False)
    step, args = memory_sweep.jshard_step(model, mesh, unit_collectives=per == "unit")
    hlo = step.lower(*args).compile().as_text()
    return [dataclasses.asdict(g) for g in gather_schedule(hlo)]


if __name__ == "__main__":
    print(json.dumps({per: schedule(int(sys.argv[1]), per) for per in sys.argv[2:]}))
