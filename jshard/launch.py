"""Multi-process runs: join a job (:func:`initialize`), start local ones (:func:`launch`), mark steps
for the watchdog (:func:`steps`) and stop on preemption (:func:`reached_preemption`).

``python -m jshard.launch --nproc P script.py`` runs ``script.py`` as ``P`` local JAX
processes on CPU (see ``docs/multihost.md``).
"""

import sys

from jshard._multiprocess.join import initialize as initialize
from jshard._multiprocess.launcher import free_port as free_port
from jshard._multiprocess.launcher import launch as launch
from jshard._multiprocess.launcher import main as main
from jshard._multiprocess.preemption import PREEMPTED_EXIT as PREEMPTED_EXIT
from jshard._multiprocess.preemption import reached_preemption as reached_preemption
from jshard._multiprocess.watchdog import WATCHDOG_EXIT as WATCHDOG_EXIT
from jshard._multiprocess.watchdog import steps as steps

__all__ = [
    "PREEMPTED_EXIT", "WATCHDOG_EXIT", "free_port", "initialize", "launch", "main", "reached_preemption", "steps",
]

if __name__ == "__main__":
    sys.exit(main())
