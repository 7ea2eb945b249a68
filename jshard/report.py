"""Memory and collective reports of compiled steps beside the analytic model, and planning.

:func:`step_report` compiles a step and returns a :class:`Report`. :func:`plan` compiles a
user's step (a builder ``build(mesh, config) -> (step, args)``) for a mesh larger than
the machine, compile only; :func:`frontier` searches the configurations that fit a
memory budget and ranks them by :func:`estimate` on a ``HARDWARE`` profile;
:func:`scaling` fits per-device memory against the mesh size; :func:`rank_stages` estimates
(analytically, not compiled) pipeline stages over FSDP x TP against FSDP x TP alone. ``python -m
jshard.report plan|frontier|scaling|stages`` runs them from the command line (docs/planning.md).
"""

from jshard._plan.cli import main as main
from jshard._plan.compiler import CompileTarget as CompileTarget
from jshard._plan.estimate import Estimate as Estimate
from jshard._plan.estimate import estimate as estimate
from jshard._plan.failure import PlanTargetError as PlanTargetError
from jshard._plan.frontier import Frontier as Frontier
from jshard._plan.frontier import frontier as frontier
from jshard._plan.hardware import HARDWARE as HARDWARE
from jshard._plan.hardware import HardwareProfile as HardwareProfile
from jshard._plan.hardware import hardware_of_device as hardware_of_device
from jshard._plan.hardware import parse_bytes as parse_bytes
from jshard._plan.init_plan import InitPlan as InitPlan
from jshard._plan.init_plan import plan_init as plan_init
from jshard._plan.planner import Plan as Plan
from jshard._plan.planner import plan as plan
from jshard._plan.scaling import Scaling as Scaling
from jshard._plan.scaling import scaling as scaling
from jshard._plan.search import FrontierRow as FrontierRow
from jshard._plan.search import Skipped as Skipped
from jshard._plan.stage_plan import StackModel as StackModel
from jshard._plan.stage_plan import StagePlan as StagePlan
from jshard._plan.stage_plan import estimate_stages as estimate_stages
from jshard._plan.stage_plan import rank_stages as rank_stages
from jshard._plan.target import PlanConfig as PlanConfig
from jshard._plan.target import abstract_result as abstract_result
from jshard._report.flops import matmul_flops as matmul_flops
from jshard._report.memory import Memory as Memory
from jshard._report.placement import parameter_count as parameter_count
from jshard._report.report import Report as Report
from jshard._report.report import format_report as format_report
from jshard._report.report import report_lowered as report_lowered
from jshard._report.report import step_report as step_report
from jshard._report.step_collectives import StepCollective as StepCollective
from jshard._report.step_collectives import step_collectives as step_collectives
from jshard._report.step_collectives import wire_bytes_by_kind as wire_bytes_by_kind

__all__ = [
    "CompileTarget",
    "HARDWARE",
    "Estimate",
    "Frontier",
    "FrontierRow",
    "HardwareProfile",
    "InitPlan",
    "Memory",
    "Plan",
    "PlanConfig",
    "PlanTargetError",
    "Report",
    "Scaling",
    "Skipped",
    "StackModel",
    "StagePlan",
    "StepCollective",
    "abstract_result",
    "estimate",
    "estimate_stages",
    "format_report",
    "frontier",
    "hardware_of_device",
    "main",
    "matmul_flops",
    "parameter_count",
    "parse_bytes",
    "plan",
    "plan_init",
    "rank_stages",
    "report_lowered",
    "scaling",
    "step_collectives",
    "step_report",
    "wire_bytes_by_kind",
]

if __name__ == "__main__":
    main()
