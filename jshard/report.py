"""Memory and collective reports of compiled steps beside the analytic model, and planning.

:func:`step_report` compiles a step and returns a :class:`Report`; :func:`plan` (and
``python -m jshard.report --plan``) plans the demo's transformer on a mesh larger than
the machine, compile only.
"""

from jshard._report.memory import Memory as Memory
from jshard._report.placement import parameter_count as parameter_count
from jshard._report.report import Report as Report
from jshard._report.report import format_report as format_report
from jshard._report.report import report_lowered as report_lowered
from jshard._report.report import step_report as step_report
from jshard._report.step_collectives import StepCollective as StepCollective
from jshard._report.step_collectives import step_collectives as step_collectives
from jshard._report.step_collectives import wire_bytes_by_kind as wire_bytes_by_kind
from jshard.demo.plan import main as main
from jshard.demo.plan import plan as plan

__all__ = [
    "Memory",
    "Report",
    "StepCollective",
    "format_report",
    "main",
    "parameter_count",
    "plan",
    "report_lowered",
    "step_collectives",
    "step_report",
    "wire_bytes_by_kind",
]

if __name__ == "__main__":
    main()
