"""When a plan target fails: one line on the command line, the traceback on request, the same from a subprocess.

[Note: planning errors] A target that cannot be planned (a module that does not import, a
missing function, a builder or step that raises) is the user's to fix, so the command line
prints one line and exits 2, with the traceback only under ``--traceback``. A plan with more
devices than this process has runs in a planning process (:func:`run_in_devices`); there the
same error happens in the child, which writes its message and traceback to the file named by
``JSHARD_PLAN_ERROR_FILE`` before exiting 2, and the parent raises it again as a
:class:`PlanTargetError`: the same line, the same exit code, the child's traceback under
``--traceback``. A planning process that dies any other way (killed, out of memory) is a
``RuntimeError`` carrying its output.
"""

from __future__ import annotations

import json
import os
import pathlib
import traceback

ERROR_FILE_ENV = "JSHARD_PLAN_ERROR_FILE"


class PlanTargetError(ValueError):
    """A plan target that cannot be planned; ``details`` is the traceback that says where.

    Example:
      >>> from jshard.report import PlanTargetError, plan
      >>> try:
      ...     plan(lambda mesh: 1 / 0, devices=8)
      ... except PlanTargetError as err:
      ...     print(str(err).split(": ", 1)[1])
      ...     print(err.details.splitlines()[-1])
      division by zero (--traceback shows where).
      ZeroDivisionError: division by zero
    """

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


def target_raised(spec: str, err: BaseException) -> PlanTargetError:
    """The error for a builder (or the step it returned) that raised ``err`` while being built or traced."""
    lines = str(err).strip().splitlines()
    return PlanTargetError(
        f"Plan target {spec!r} raised {type(err).__name__} while building or tracing its step"
        + (f": {lines[0]}" if lines else "") + " (--traceback shows where).",
        traceback_text(err),
    )


def traceback_text(err: BaseException) -> str:
    """The traceback to print under ``--traceback``: the planning process's own when it came from one."""
    return getattr(err, "details", "") or "".join(traceback.format_exception(err))


def hand_to_parent(err: BaseException) -> None:
    """In a planning process, write ``err`` where the process that started it reads it (else nothing)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        pathlib.Path(path).write_text(json.dumps({"message": str(err), "details": traceback_text(err)}))


def from_planning_process(path: str | os.PathLike[str]) -> PlanTargetError | None:
    """The error a planning process handed over through ``path``, if it did."""
    file = pathlib.Path(path)
    if not file.exists():
        return None
    data = json.loads(file.read_text())
    return PlanTargetError(data["message"], data["details"])
