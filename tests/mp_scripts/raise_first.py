"""No JAX: process 1 reports an uncaught exception first, process 0 (its collective "failing") exits before it.

Usage: python -m jshard.launch --nproc 2 --no-auto-init raise_first.py FLAG_FILE
"""

import os
import pathlib
import sys
import time

me, flag = int(os.environ["JSHARD_PROCESS_ID"]), pathlib.Path(sys.argv[1])
if me == 1:
    print("[jshard] process 1: uncaught ValueError; exiting now (simulated)", file=sys.stderr, flush=True)
    flag.touch()
    time.sleep(0.5)  # exits after process 0, as a slow traceback or exit would
    sys.exit(1)
while not flag.exists():
    time.sleep(0.01)
print("collective failed: another task died", flush=True)
sys.exit(3)
