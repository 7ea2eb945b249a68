"""Run by ``jshard.launch`` in each process: join the job, then run the target as ``__main__``."""

from __future__ import annotations

import os
import runpy
import sys


def run(target: list[str]) -> None:
    """Call :func:`jshard.launch.initialize`, then run ``script.py args`` or ``-m module args``."""
    from jshard._multiprocess.join import initialize

    initialize()
    if target[0] == "-m":
        sys.argv = [target[1], *target[2:]]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(target)
        sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))
        runpy.run_path(target[0], run_name="__main__")
    _leave()


def _leave() -> None:
    """Leave the job once the target returned: stop the step watchdog, then JAX's shutdown
    barrier, which the process would otherwise reach while the interpreter is being torn down.
    A target that raises or calls ``sys.exit`` leaves through ``atexit``."""
    import jax

    from jshard._multiprocess.watchdog import stop_watchdog

    stop_watchdog()
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


if __name__ == "__main__":
    run(sys.argv[1:])
