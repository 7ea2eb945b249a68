"""Multi-process runs: join a job (:func:`initialize`) and start local ones (:func:`launch`).

``python -m jshard.launch --nproc P script.py`` runs ``script.py`` as ``P`` local JAX
processes on CPU (see ``docs/multihost.md``).
"""

import sys

from jshard._multiprocess.join import initialize as initialize
from jshard._multiprocess.launcher import free_port as free_port
from jshard._multiprocess.launcher import launch as launch
from jshard._multiprocess.launcher import main as main

__all__ = ["free_port", "initialize", "launch", "main"]

if __name__ == "__main__":
    sys.exit(main())
