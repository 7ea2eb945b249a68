"""Residuals of jshard's own checkpoint left in the precision XLA picks, as plain differentiation's are.

[Note: residual rounding] ``jax.checkpoint`` ends every residual it saves with a
``reduce_precision`` to the residual's own dtype (``x`` rounded to float32 when ``x`` is
float32: no change to any value; jax PR 22244), so that a recomputation in backward sees
exactly what the forward saw where XLA computes with excess precision. That op also pins the
stored residual to its dtype: XLA:TPU can no longer store a float32 activation that only
default-precision matmuls read as the bfloat16 those matmuls round it to, which it does for
plain differentiation. Under jshard's own policy (no ``remat_policy``) the checkpoint exists
only to re-gather parameters: it recomputes gathers and layout ops, no arithmetic, so it has
no excess precision to guard against, and its residuals are the activations plain
differentiation keeps. v5p 2x2x2, the sweep's transformer, 8 unrolled 256-wide blocks, batch
64, activations kept: every block's ``f32[8,64,768]`` qkv projection was stored in float32
(as ``f32[8,64,12,64]``, 3 MiB with TPU tiling) where plain differentiation stores
``bf16`` (1.5 MiB). Peaks with the rounding / without, MiB (jax 0.10.2, libtpu 0.0.42.1):
unrolled, 4 x 128 at batch 16 17.18 / 15.89 and at 64 21.30 / 17.30, 8 x 256 44.10 / 35.70 at
batch 16 and 90.51 / 79.43 at 64 (2 x 128 at batch 16, the test's, 9.68 / 9.02). Stacked in a
``js.scan`` (whose layer checkpoint keeps its CSE barrier; whether that is why is not derived)
the transformers move by at most 0.06 MiB either way, and the sweep's 16 MLPs with activations
kept (tanh and GELU, 512 and 1536 wide, fp32 and bf16) not at all.
:func:`without_residual_rounding` removes these no-op roundings from the traced step (nested
jaxprs included); under a ``remat_policy`` the step keeps them, as ``jax.checkpoint`` in the
hand-written step does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore


def _no_op(eqn: Any) -> bool:
    """A ``reduce_precision`` to its operand's own format (what ``jax.checkpoint`` adds)."""
    if eqn.primitive.name != "reduce_precision":
        return False
    info = jnp.finfo(eqn.invars[0].aval.dtype)
    return (eqn.params["exponent_bits"], eqn.params["mantissa_bits"]) == (info.nexp, info.nmant)


def _param(value: Any) -> Any:
    if isinstance(value, jcore.ClosedJaxpr):
        return jcore.ClosedJaxpr(_strip(value.jaxpr), value.consts)
    if isinstance(value, jcore.Jaxpr):
        return _strip(value)
    if isinstance(value, tuple) and any(isinstance(v, jcore.ClosedJaxpr | jcore.Jaxpr) for v in value):
        return tuple(_param(v) for v in value)
    return value


def _strip(jaxpr: Any) -> Any:
    """``jaxpr`` (and the jaxprs in its equations' params) without no-op ``reduce_precision``."""
    renamed: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v if isinstance(v, jcore.Literal) else renamed.get(v, v)

    eqns = []
    for eqn in jaxpr.eqns:
        invars = [read(v) for v in eqn.invars]
        if _no_op(eqn):
            renamed[eqn.outvars[0]] = invars[0]
            continue
        eqns.append(eqn.replace(invars=invars, params={k: _param(v) for k, v in eqn.params.items()}))
    return jaxpr.replace(eqns=eqns, outvars=[read(v) for v in jaxpr.outvars])


def without_residual_rounding(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` traced once and run without the no-op ``reduce_precision`` that ``jax.checkpoint``
    adds to its residuals ([Note: residual rounding]); values are unchanged.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> square = jax.checkpoint(lambda x: jnp.sin(x) * jnp.sin(x), policy=jax.checkpoint_policies.everything_saveable)
      >>> f = jax.grad(square)  # sin(x): a residual read in forward too, so rounded
      >>> "reduce_precision" in str(jax.make_jaxpr(f)(1.0))
      True
      >>> g = without_residual_rounding(f)
      >>> "reduce_precision" in str(jax.make_jaxpr(g)(1.0)), bool(jnp.allclose(g(1.0), f(1.0)))
      (False, True)
    """

    def run(*args: Any) -> Any:
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        stripped = jcore.ClosedJaxpr(_strip(closed.jaxpr), closed.consts)
        flat = jcore.jaxpr_as_fun(stripped)(*jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shape), flat)

    return run
