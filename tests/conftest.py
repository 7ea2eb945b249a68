"""Eight simulated CPU devices, set once before JAX initialises its backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The TPU compiler (tests/test_tpu_compiler.py) compiles only; without this, libtpu's lock file
# refuses a second process that loads it (another test run, a planning subprocess).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# LLVM at -O0: the suite is compile-bound (small programs, run a few times: in the cases measured
# ~80 % of the CPU time was XLA compiling), and -O0 compiles XLA:CPU programs about twice as fast
# (test_flax_nnx.py: 108 -> 66 CPU seconds). What the tests read is decided before LLVM: the HLO,
# its collectives, schedule and buffer assignment (memory analysis); float arithmetic is IEEE
# either way (no fast-math). Child processes (multi-process jobs, the demo, planning) inherit it;
# a level already in XLA_FLAGS is kept.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")

# Scripts that the multi-process tests run in child processes; not test modules.
collect_ignore_glob = ["mp_scripts/*"]
