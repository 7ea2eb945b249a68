"""Print, as JSON, what XLA:TPU's out-of-memory check says of a recomputing ``lax.scan`` training step.

``python tests/tpu_hbm_check.py``: 8 layers of ``tanh(h @ w)``, ``w`` ``bf16[4096, 4096]``, ``h``
``bf16[2048, 4096]``, each layer under ``jax.checkpoint``, a plain SGD step with the layers donated,
compiled for one v5p chip. Started with ``LIBTPU_INIT_ARGS=--xla_tpu_max_hbm_size_mib=N`` below what
the step needs (libtpu reads it once, so tests run this in a subprocess), the compile fails and
this prints ``{"required_mib": ...}``, the compiler's "total memory required"; where it fits,
``{"required_mib": null}``.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def sgd_scan() -> tuple:
    """The step and its abstract arguments."""
    chip = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu").devices[:1]
    whole = NamedSharding(Mesh(np.array(chip), ("x",)), PartitionSpec())

    def loss(w, h):
        def layer(h, w):
            return jax.checkpoint(lambda h, w: jnp.tanh(h @ w))(h, w), None
        return jax.lax.scan(layer, h, w)[0].astype(jnp.float32).sum()

    step = jax.jit(lambda w, h: w - 0.1 * jax.grad(loss)(w, h), donate_argnums=0)
    return step, (jax.ShapeDtypeStruct((8, 4096, 4096), jnp.bfloat16, sharding=whole),
                  jax.ShapeDtypeStruct((2048, 4096), jnp.bfloat16, sharding=whole))


if __name__ == "__main__":
    step, args = sgd_scan()
    try:
        step.lower(*args).compile()
        print(json.dumps({"required_mib": None}))
    except jax.errors.JaxRuntimeError as err:
        required = re.search(r"total memory required for HLO temporaries \(([\d.]+)M\)", str(err))
        print(json.dumps({"required_mib": float(required.group(1)) if required else str(err)[:2000]}))
