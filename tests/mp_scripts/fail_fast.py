"""No JAX: process 1 fails at once, process 0 would sleep for ten minutes (the launcher must stop it).

Usage: python -m jshard.launch --nproc 2 --no-auto-init fail_fast.py [--sleep-all]
"""

import os
import sys
import time

me = int(os.environ["JSHARD_PROCESS_ID"])
print(f"hello from {me}", flush=True)
if me == 1 and "--sleep-all" not in sys.argv:
    print("failing", file=sys.stderr, flush=True)
    sys.exit(17)
time.sleep(600)
