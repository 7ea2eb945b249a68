"""No JAX: one process dies by a signal, the other reports an uncaught error, in the order MODE says.

``kill``: process 1 is SIGKILLed (as by the OOM killer) while process 0 waits for it, whose collective
then fails and which reports that uncaught error. ``abort``: process 0 reports an uncaught error first,
then process 1 is aborted (SIGABRT, as JAX's coordination service stops the survivors) before process 0
has finished exiting.

Usage: python -m jshard.launch --nproc 2 --no-auto-init killed.py FLAG_FILE (kill|abort)
"""

import os
import pathlib
import signal
import sys
import time

me, flag, mode = int(os.environ["JSHARD_PROCESS_ID"]), pathlib.Path(sys.argv[1]), sys.argv[2]
if me == 1:
    if mode == "abort":
        while not flag.exists():
            time.sleep(0.01)
    flag.touch()
    os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGABRT)
if mode == "kill":
    while not flag.exists():
        time.sleep(0.01)
    time.sleep(0.1)
print("[jshard] process 0: uncaught JaxRuntimeError; exiting now (simulated: Connection reset by peer)",
      file=sys.stderr, flush=True)
flag.touch()
time.sleep(0.5 if mode == "abort" else 0)  # a traceback being printed: process 1 ends before it
sys.exit(1)
