"""Eight simulated CPU devices, set once before JAX initialises its backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The TPU compiler (tests/test_tpu_compiler.py) compiles only; without this, libtpu's lock file
# refuses a second process that loads it (another test run, a planning subprocess).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")

# Scripts that the multi-process tests run in child processes; not test modules.
collect_ignore_glob = ["mp_scripts/*"]
