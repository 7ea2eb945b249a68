"""Weight gradients formed from gathered activations: the matmuls that read a gathered matrix.

[Note: weight gradient route] FSDP's gradient reduction is the backward of the gather
(``gather.gather_shard``): it receives the whole gradient ``x^T dy`` that the model's matmul
formed from this device's rows, a ``[K, N]`` buffer per device, and reduce-scatters it (on v4
and v5p in torus phases, with a half-size buffer beside it). With few rows in the global batch,
GSPMD forms this device's block of that gradient from every device's activations instead: the
``x[:, K_d]`` columns of every device's rows (an all-to-all) times every device's ``dy`` (an
all-gather) is the ``[K/n, N]`` block of a matrix sharded on its first dim (for one sharded on
its second, every device's ``x`` times the ``dy[:, N_d]`` columns), already summed over the
devices. Per device, with ``M`` rows and ``n`` devices, that sends ``M K (n-1)/n + M N (n-1)``
elements where the reduction sends ``K N (n-1)/n``, and holds ``n M N`` where the reduction
holds ``K N``. Measured on v5p 2x2x2 by hand first (``benchmarks/weight_gradient_route.py``,
docs/benchmarks.md "Weight gradients from gathered activations").

Only the matmul knows its ``x`` and ``dy``, so the step finds the matmuls: with
``FullyShardPolicy(weight_gradients="from_activations")`` a gathered matrix that qualifies
(``LeafComm.routable``) is marked (``remat.routable_p``, carrying its shard and ``LeafComm``), and
:func:`route_matmuls` rewrites the traced loss's ``dot_general`` equations that read a marked
matrix as ``x @ w`` (``x``'s last dim contracted with ``w``'s first, no batch dims) into
:func:`routed_matmul`, a ``custom_vjp`` that never gathers the matrix, where that sends fewer bytes
(:func:`sends_less`: fewer rows in the global batch than ``K``, roughly). For a matrix sharded on
its inputs, forward multiplies the ``x[:, K_d]`` columns of every device's rows (an all-to-all) by
the shard and reduce-scatters the partial products to their rows; backward forms the gradient's
block from those columns (kept from forward) and every device's ``dy`` (an all-gather), and ``dx``
as every device's rows of this device's columns (``dy`` times the shard), sent back by an
all-to-all. For one sharded on its outputs, forward multiplies every device's rows (an all-gather)
by the shard and sends each device its rows of this device's outputs (an all-to-all); backward
gathers ``x`` again (every device's rows kept from forward would be ``n`` times ``x``), exchanges
``dy``'s columns and reduce-scatters ``dx``'s partial sums. Each exchange sends fewer elements than
the gather, re-gather or reduction it replaces wherever :func:`sends_less` holds, and neither the
gathered matrix nor its whole gradient exists. The gradient is finished as a reduced one
(``gather.reduce_summed``: ``reduce_dtype``, the replicas' all-reduce, the division). The original
gather is then dead unless something else reads the matrix (its gradient is reduced as before and
the two add up). Matmuls in the bodies of loops over stacked layers (``js.scan``, ``nnx.scan``,
``nn.scan``: a ``scan`` and the step's checkpoint of one layer) and of ``jit`` calls are rewritten
too: a layer's matmul reads its gathered slice there (v5p 2x2x2, training step: the sweep's 8
stacked MLP models with activations kept fall, GELU 4x512 in bf16 9.77 -> 5.36 MiB against the
recipe's 10.14, with the async-collective flags 11.35 -> 5.37 against 10.30). A recomputed layer, a
checkpoint under another policy than jshard's own (the step's of a stacked layer under a
``remat_policy``, or one the user wrote), is routed whole or not at all: left alone where a marked
matrix in it would stay gathered (read other than as ``x @ w``, or where gathering sends less).
Inside a checkpoint a ``custom_vjp``'s residuals are kept whatever the policy; routing a stacked
GELU block's first matrix alone raised the 8x1536 blocks (148.00 -> 156.59 MiB in bf16 against the
recipe's 148.53), routing the layer whole takes the stacked MLP models recomputed from 0.96-1.14x
the recipe's peak to 0.53-0.89x, FLOPs unchanged (v5p 2x2x2, training step). The segments of
unrolled units under a ``remat_policy`` are routed so too, once cut (:func:`route_whole`; the 8
unrolled MLP models recomputed from 0.46-0.99x the recipe's peak to 0.25-0.66x). In custom
derivatives the mark is an identity.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Mapping
from typing import Any

import jax
from jax.extend import core as jcore

from jshard._step import collectives as C
from jshard._step.block_route import block_parts, blocked_matmul, contract
from jshard._step.gather import LeafComm, reduce_summed, scatter_native
from jshard._step.lookup_route import inline_lookups, routed_lookup_eqn
from jshard._step.remat import (
    REMAT_POLICY,
    call_equation,
    checkpoint_primitive,
    loop_policy,
    marked,
    routable_p,
    sub_jaxprs,
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def routed_matmul(comm: LeafComm, precision: Any, preferred: Any, x: jax.Array, shard: jax.Array) -> jax.Array:
    """``x @ gather(shard)``, formed from exchanged activations and the shard (see the Note);
    ``precision`` and ``preferred`` are the matmul's own."""
    return _fwd(comm, precision, preferred, x, shard)[0]


def _fwd(comm, precision, preferred, x, shard):
    axes, rows, w = comm.axes.shard, x.reshape(-1, x.shape[-1]), shard.astype(comm.param_dtype)
    if comm.layout.dim == 0:  # this device's inputs of every device's rows, times the shard: partial sums
        x_cols = jax.lax.all_to_all(rows, axes, split_axis=1, concat_axis=0, tiled=True)
        y = scatter_native(comm, contract(x_cols, w, ((1,), (0,)), precision, preferred), 0)  # partial sums
        saved = x_cols
    else:  # every device's rows times the shard: this device's outputs of every row
        x_all = C.all_gather(rows, axes, 0, phases=comm.axes.gather_phases)
        y = jax.lax.all_to_all(contract(x_all, w, ((1,), (0,)), precision, preferred), axes, split_axis=0,
                               concat_axis=1, tiled=True)
        saved = x  # gathered again in backward: every device's rows are n times this device's
    return y.reshape(x.shape[:-1] + y.shape[-1:]), (saved, shard)


def _bwd(comm, precision, preferred, residuals, dy):
    saved, shard = residuals
    axes, w, rows_dy = comm.axes.shard, shard.astype(comm.param_dtype), dy.reshape(-1, dy.shape[-1])
    if comm.layout.dim == 0:
        x_ex, dy_ex = saved, C.all_gather(rows_dy, axes, 0, phases=comm.axes.gather_phases)
        dx = jax.lax.all_to_all(contract(dy_ex, w, ((1,), (1,)), precision, preferred), axes, split_axis=0,
                                concat_axis=1, tiled=True)
    else:
        x_ex = C.all_gather(saved.reshape(-1, saved.shape[-1]), axes, 0, phases=comm.axes.gather_phases)
        dy_ex = jax.lax.all_to_all(rows_dy, axes, split_axis=1, concat_axis=0, tiled=True)
        dx = scatter_native(comm, contract(dy_ex, w, ((1,), (1,)), precision, preferred), 0)
    gradient = contract(x_ex, dy_ex, ((0,), (0,))).astype(w.dtype)
    return dx.reshape(dy.shape[:-1] + dx.shape[-1:]).astype(saved.dtype), reduce_summed(comm, gradient)


routed_matmul.defvjp(_fwd, _bwd)


def route_matmuls(closed: jcore.ClosedJaxpr, policy: Any = REMAT_POLICY) -> jcore.ClosedJaxpr:
    """``closed``, traced under the step's ``policy``, with the ``x @ w`` of marked gathered
    matrices ``w`` taken by :func:`routed_matmul` or ``block_route.blocked_matmul``: under jshard's
    own policy those at the top level and in the loops and step checkpoints it runs; under any,
    those of a recomputed layer (a checkpoint under another policy), where all of its are (see the
    Note), and those of matrices kept gathered in blocks (a segment's inputs once cut). Unchanged
    where there is none.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> closed = jax.make_jaxpr(lambda x, w: x @ w)(jnp.ones((2, 3)), jnp.ones((3, 4)))
      >>> route_matmuls(closed) is closed  # nothing marked
      True
    """
    return _routed_closed(closed, _ROUTES if policy is REMAT_POLICY else frozenset({"kept"}))


def route_whole(jaxpr: jcore.Jaxpr) -> jcore.Jaxpr:
    """``jaxpr``, code recomputed in backward (a checkpoint under another policy than jshard's, or
    a segment of unrolled code under a ``remat_policy``, cut and checkpointed by ``segments.py``),
    with the ``x @ w`` of its marked matrices routed from activations, all of them or none (see
    the Note; never in blocks, [Note: weight gradient blocks]), and either way its row lookups of
    marked tables ([Note: row lookup route] in ``lookup_route.py``: their residuals are the ids)
    and the matmuls of matrices kept gathered (in blocks: their residual is the gathered matrix
    the unit keeps anyway).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> closed = jax.make_jaxpr(lambda x, w: x @ w)(jnp.ones((2, 3)), jnp.ones((3, 4)))
      >>> route_whole(closed.jaxpr) is closed.jaxpr  # nothing marked
      True
    """
    routed = _routed_jaxpr(jaxpr, frozenset({"routed", "kept", "gather"}))
    return _routed_jaxpr(jaxpr, frozenset({"kept", "gather"})) if _still_gathers(routed) else routed


# ``routes``, below: what of this jaxpr itself is rewritten: the matmuls of freed matrices routed
# from activations (``routed``) or in blocks (``blocks``), those of kept ones in blocks (``kept``),
# and row lookups (``gather``). At the top level of a loss under a ``remat_policy`` only ``kept``:
# its unrolled segments are routed by :func:`route_whole` once cut.
_ROUTES = frozenset({"routed", "blocks", "kept", "gather"})


def _routed_closed(closed: jcore.ClosedJaxpr, routes: frozenset[str]) -> jcore.ClosedJaxpr:
    jaxpr = _routed_jaxpr(closed.jaxpr, routes)
    return closed if jaxpr is closed.jaxpr else jcore.ClosedJaxpr(jaxpr, closed.consts)


def _routed_jaxpr(jaxpr: jcore.Jaxpr, routes: frozenset[str]) -> jcore.Jaxpr:
    """``jaxpr`` with its matmuls and lookups routed, in the loop bodies and checkpoints it runs too."""
    source = inline_lookups(jaxpr.eqns) if "gather" in routes else jaxpr.eqns
    made = {v: eqn for eqn in source for v in eqn.outvars}
    reads = collections.Counter(v for e in source for v in e.invars if isinstance(v, jcore.Var))
    reads.update(v for v in jaxpr.outvars if isinstance(v, jcore.Var))
    eqns, changed = [], source is not jaxpr.eqns
    for eqn in source:
        if eqn.primitive.name == "dot_general":
            routed = _routed(eqn, made, reads, routes)
        elif eqn.primitive.name == "gather":
            routed = routed_lookup_eqn(eqn, made, reads) if "gather" in routes else eqn
        else:
            routed = _routed_inside(eqn, routes)
        changed |= routed is not eqn
        eqns.append(routed)
    return jaxpr.replace(eqns=_live(eqns, jaxpr.outvars)) if changed else jaxpr


def _routed_inside(eqn: Any, routes: frozenset[str]) -> Any:
    """``eqn`` with the matmuls of its nested jaxprs routed, where it is a loop (``js.scan``,
    ``nnx.scan``, ``nn.scan``), a ``jit`` or a checkpoint: one of jshard's own policy (a stacked
    layer's under it) as its surroundings; one under another policy (a recomputed layer: the
    step's under a ``remat_policy``, or one the user wrote) whole or not at all (see the Note).
    Never in a custom derivative, whose rule would still read the matmul it had."""
    checkpoint = eqn.primitive is checkpoint_primitive()
    if checkpoint and eqn.params["policy"] not in _STEP_POLICIES:  # a recomputed layer
        routed = route_whole(eqn.params["jaxpr"])
        return eqn if routed is eqn.params["jaxpr"] else eqn.replace(params={**eqn.params, "jaxpr": routed})
    if not checkpoint and eqn.primitive.name not in _NESTED:
        return eqn
    params = {}
    for key in _NESTED.get(eqn.primitive.name, ("jaxpr",)):
        value = eqn.params[key]
        if isinstance(value, tuple):
            routed = tuple(_routed_closed(v, routes) for v in value)
            changed = any(r is not v for r, v in zip(routed, value, strict=True))
        else:
            routed = (_routed_closed if isinstance(value, jcore.ClosedJaxpr) else _routed_jaxpr)(value, routes)
            changed = routed is not value
        if changed:
            params[key] = routed
    return eqn.replace(params={**eqn.params, **params}) if params else eqn


def _still_gathers(jaxpr: jcore.Jaxpr) -> bool:
    """Whether ``jaxpr`` (or a jaxpr nested in it) still reads a marked matrix gathered: a mark the
    route left live (a use that is not ``x @ w``, one that sends less gathered, or one in a
    custom derivative)."""
    return _finds(jaxpr, lambda eqn: eqn.primitive is routable_p and eqn.params["freed"])


def _finds(jaxpr: jcore.Jaxpr, found: Any) -> bool:
    """Whether ``found`` holds for an equation of ``jaxpr`` or of a jaxpr nested in it."""
    return any(found(eqn) or any(_finds(j, found) for j in sub_jaxprs(eqn)) for eqn in jaxpr.eqns)


# The nested jaxprs of the equations routed inside, by parameter.
_NESTED = {"scan": ("jaxpr",), "while": ("body_jaxpr",), "cond": ("branches",), "jit": ("jaxpr",),
           "pjit": ("jaxpr",), "closed_call": ("call_jaxpr",)}
_STEP_POLICIES = (REMAT_POLICY, loop_policy(REMAT_POLICY))


def _routed(eqn: Any, made: dict[Any, Any], reads: Mapping[Any, int], routes: frozenset[str]) -> Any:
    """The equation of :func:`routed_matmul` or ``blocked_matmul`` for a matmul ``x @ w`` of a
    marked ``w`` whose policy names a route that applies (in its order, among ``routes``), else
    ``eqn``. A matrix kept gathered is blocked only where nothing else reads it gathered (``reads``:
    how many equations and results read each variable), so that it is still gathered once."""
    if eqn.params["dimension_numbers"] != (((eqn.invars[0].aval.ndim - 1,), (0,)), ((), ())):
        return eqn
    mark = marked(eqn.invars[1], made)
    if mark is None:
        return eqn
    (_, shard), x, comm = mark.invars, eqn.invars[0], mark.params["comm"]
    chosen, shape, freed = comm.policy.gradient_routes, eqn.invars[1].aval.shape, mark.params["freed"]
    blockable = "blocks" in routes if freed else "kept" in routes and reads[eqn.invars[1]] == 1
    if freed and "routed" in routes and "from_activations" in chosen and sends_less(
            x.aval.size // x.aval.shape[-1], *shape, comm.layout.dim, comm.axes.shard_size):
        fn = functools.partial(routed_matmul, comm, eqn.params["precision"], eqn.params["preferred_element_type"])
    elif blockable and "in_blocks" in chosen and len(
            block_parts(comm, shape, freed and "from_activations" in chosen)) > 1:
        fn = functools.partial(blocked_matmul, comm, eqn.params["precision"], eqn.params["preferred_element_type"],
                               not freed)  # [Note: weight gradient blocks]
    else:
        return eqn
    return call_equation(fn, [x, shard], eqn.outvars) or eqn


def sends_less(rows: int, k: int, n: int, dim: int, devices: int) -> bool:
    """Whether a matmul with a ``[k, n]`` matrix sharded on ``dim`` over ``devices`` devices and
    ``rows`` rows per device of activations sends fewer elements per device with its activations
    exchanged than with the matrix gathered (see the Note): the sharded side's activations go
    through an all-to-all, the other side's are gathered (or reduce-scattered) whole. The same
    inequality holds for forward against the gather, and for backward against the re-gather and
    against the gradient's reduction.

    Example:
      >>> sends_less(64, 1536, 1536, 0, 8), sends_less(512, 256, 768, 0, 8)  # an MLP at batch 512, a transformer
      (True, False)
    """
    sharded, whole = (k, n) if dim == 0 else (n, k)
    return rows * sharded / devices + rows * whole < k * n / devices


def _live(eqns: list[Any], outvars: list[Any]) -> list[Any]:
    """``eqns`` without those whose outputs nothing reads (the gathers a rewrite left unread)."""
    needed = {v for v in outvars if not isinstance(v, jcore.Literal)}
    kept = []
    for eqn in reversed(eqns):
        if eqn.effects or any(v in needed for v in eqn.outvars):
            kept.append(eqn)
            needed.update(v for v in eqn.invars if not isinstance(v, jcore.Literal))
    return kept[::-1]
