"""The benchmarks: ``python -m benchmarks.<name>``.

Where no accelerator is given they run on 8 simulated CPU devices. JAX reads
``JAX_NUM_CPU_DEVICES`` once, when it is imported, so it is set here, before any benchmark
module (or the jshard it imports) imports JAX.
"""

import os

if "JAX_NUM_CPU_DEVICES" not in os.environ and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
    os.environ["JAX_NUM_CPU_DEVICES"] = "8"
