"""The 1F1B pipeline schedule: each microbatch's backward runs inside the schedule.

[Note: 1F1B schedule] GPipe (``pipeline.py``) runs all ``M`` forwards and leaves the backward
to JAX's transpose of them, so every stage keeps the saved activations of every schedule
step until the backward starts. 1F1B runs a microbatch's backward as soon as its loss is
known, so a stage keeps only the microbatches it has run forward but not yet backward. In
one SPMD program (every stage in lock step, one ``ppermute`` each way per schedule step) with
``S`` stages, stage ``s`` runs at step ``t``:

- the forward of microbatch ``t - s`` (``jax.vjp`` of its ``K`` layers, each under the step's
  checkpoint: what the step's remat policy saves is kept, in a ring of slots, and the
  weights are not copied there: the residuals that *are* the stage's weights are found by
  identity and taken from the weights in backward), sent on to stage ``s + 1``;
- on the last stage, the loss of that microbatch and its cotangent (``1 / M``);
- the backward of microbatch ``t - (2 S - 2 - s)``: its saved activations and the cotangent
  received from stage ``s + 1`` (the last stage: the loss's) give the stage's weight
  gradients, accumulated, and the input's cotangent, sent back to stage ``s - 1``.

A microbatch's backward reaches stage ``s`` ``2 (S - 1 - s)`` steps after its forward (one
hop per step each way), so stage ``s`` holds ``min(2 (S - s) - 1, M)`` microbatches and, the
ring being one shape on every device, each device ``min(2 S - 1, M)`` slots: not growing with
``M``, where GPipe keeps ``M + S - 1``. An asynchronous runtime reaches PipeDream's ``S - s``;
lock step doubles the round trip. The ``M + 2 S - 2`` steps run as three loops: ``S - 1``
warm-up steps of forwards only, ``M`` of both, ``S - 1`` cool-down steps of backwards only,
so the step takes ``(M + S - 1) (F + B)``, as GPipe's, with the same bubble
``(S - 1) / (M + S - 1)``.

The whole schedule is one ``jax.custom_vjp`` whose forward runs it and returns the loss,
keeping the gradients as its residuals; its backward multiplies them by the incoming
cotangent, summed over the stages (each stage of a column returns the column's loss, so the
step's sum over devices counts it ``S`` times). The stage's weights enter as they are given:
shards gathered per layer inside the stage (their gradients leave each ``jax.vjp``
reduce-scattered and divided as every gather's do), or layers gathered once before the
schedule (their full gradients accumulate, and the gather's own VJP reduce-scatters them
once). Values the layer body or the loss close over (the head's gathered weights) become
explicit inputs (``_hoisted``), so their gradients are accumulated and returned too. Every
stage runs the loss at each middle step (lock step), but only the last stage's is seeded with
a cotangent; the others get zero: where the loss gathers a unit itself (``js.unshard`` inside
it), the gather's VJP reduce-scatters the head's gradient over every stage inside the
microbatch's backward, and seeding every stage summed the other stages' gradients in (the
docs example's head gradient was off by 6.9 for entries of at most 1.5; a mask after the
backward cannot undo a reduction inside it). The loss's targets are not differentiated.
Shards gathered per layer are ``depend``-ed on the layer's input (``pipeline._stage``):
``jax.vjp`` of the stage otherwise computed every layer's gather, which reads only weights, in
a loop of its own ahead of the layers, holding the stage's ``K`` gathered layers and a copy
(XLA:CPU, ``S = 2``, ``K = 4``, width 256, ``M = 2``: 2.41 MiB of temporaries, 1.46 tied).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jcore

from jshard._step.remat import SAVED


def _hoisted(fn: Callable, *examples: Any) -> tuple[Callable, list[jax.Array], list[jax.Array], Any]:
    """``fn`` with the traced values it closes over as explicit inputs: ``(run(floats, others, *args),
    floats, others, fn's output shapes)``, the floating ones (differentiated) apart from the rest
    (indices, masks).

    A ``custom_vjp`` gives no gradient to what its function closes over, and a traced value
    it closes over escapes the trace that re-evaluates the step's loss; hoisted, neither.
    """
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*examples)
    kinds = [None if not isinstance(c, jax.core.Tracer) else jnp.issubdtype(c.dtype, jnp.inexact)
             for c in closed.consts]

    def run(floats: list[jax.Array], others: list[jax.Array], *args: Any) -> Any:
        given = {True: iter(floats), False: iter(others)}
        values = [c if kind is None else next(given[kind]) for c, kind in zip(closed.consts, kinds, strict=True)]
        out = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(closed.jaxpr, values))(*jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shape), out)

    pick = lambda kind: [c for c, k in zip(closed.consts, kinds, strict=True) if k is kind]  # noqa: E731
    return run, pick(True), pick(False), shape


class _Linearized:
    """The stage's ``jax.vjp`` on one microbatch, split into what a slot keeps (activations)
    and what backward takes from the weights (residuals that are the weights themselves)."""

    def __init__(self, stage: Callable, weights: Any, x: jax.Array):
        self.out, pull = jax.vjp(stage, weights, x)
        leaves, self.tree = jax.tree.flatten(pull)
        own = {id(w): k for k, w in enumerate(jax.tree.leaves(weights))}
        self.where = [own.get(id(leaf)) for leaf in leaves]
        self.saved = [leaf for leaf, k in zip(leaves, self.where, strict=True) if k is None]

    def backward(self, weights: Any, saved: list[jax.Array], cotangent: jax.Array) -> tuple[Any, jax.Array]:
        """``(weight cotangents, input cotangent)`` of the microbatch whose activations are ``saved``."""
        given, flat = iter(saved), jax.tree.leaves(weights)
        leaves = [next(given) if k is None else flat[k] for k in self.where]
        return jax.tree.unflatten(self.tree, leaves)(cotangent)


def _add_where(valid: jax.Array, acc: Any, new: Any) -> Any:
    return jax.tree.map(lambda a, b: a + jnp.where(valid, b, jnp.zeros_like(b)).astype(a.dtype), acc, new)


def _zero_cotangent(x: jax.ShapeDtypeStruct) -> Any:
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros(x.shape, x.dtype)
    return np.zeros(x.shape, jax.dtypes.float0)


def _schedule(stage: Callable, loss: Callable, axis: str, stages: int, weights: Any, head: Any, xs: jax.Array,
              ys: Any) -> tuple[jax.Array, Any, jax.Array]:
    """The 1F1B steps: ``(the loss averaged over the M microbatches on the last stage (0 elsewhere),
    (weight gradients, head gradients), cotangents of xs on stage 0 (0 elsewhere))``."""
    s, m = jax.lax.axis_index(axis), xs.shape[0]
    slots, last = min(2 * stages - 1, m), stages - 1
    forward_shift, backward_shift = [(i, i + 1) for i in range(last)], [(i + 1, i) for i in range(last)]
    ring = [jnp.zeros((slots,) + a.shape, a.dtype)
            for a in jax.eval_shape(lambda x: _Linearized(stage, weights, x).saved, xs[0])]

    def forward(t, received, ring):
        i = t - s
        run = _Linearized(stage, weights, jnp.where(s == 0, xs[jnp.clip(t, 0, m - 1)], received))
        slot, valid = jnp.mod(i, slots), (i >= 0) & (i < m)
        ring = [r.at[slot].set(jnp.where(valid, a, r[slot])) for r, a in zip(ring, run.saved, strict=True)]
        return run, ring

    def backward(t, run, cotangent, ring, acc):
        grads, dxs = acc
        j = t - (2 * last - s)
        valid = (j >= 0) & (j < m)
        dw, dx = run.backward(weights, [r[jnp.mod(j, slots)] for r in ring], cotangent)
        k = jnp.clip(j, 0, m - 1)
        dxs = dxs.at[k].set(jnp.where(valid & (s == 0), dx, dxs[k]))
        return jax.lax.ppermute(dx, axis, backward_shift), (_add_where(valid, grads, dw), dxs)

    def warm_up(carry, t):
        received, ring = carry
        run, ring = forward(t, received, ring)
        return (jax.lax.ppermute(run.out, axis, forward_shift), ring), None

    def steady(carry, t):
        received, cotangent, ring, acc, head_acc = carry
        run, ring = forward(t, received, ring)
        y = jax.tree.map(lambda v: v[t - last], ys)  # the last stage's microbatch, run forward just now
        value, pull = jax.vjp(lambda head, h: loss(head, h, y), head, run.out)
        # The cotangent is 1 / M on the last stage, 0 elsewhere, so other stages' loss contributes
        # nothing to what the loss reduces inside it (a unit it gathers is reduce-scattered over
        # every stage in its VJP) and its head gradients need no mask ([Note: 1F1B schedule]).
        d_head, d_out = pull(jnp.where(s == last, 1 / m, 0).astype(value.dtype))
        cotangent, acc = backward(t, run, jnp.where(s == last, d_out, cotangent), ring, acc)
        head_acc = jax.tree.map(jnp.add, head_acc, (d_head, jnp.where(s == last, value.astype(jnp.float32) / m, 0)))
        return (jax.lax.ppermute(run.out, axis, forward_shift), cotangent, ring, acc, head_acc), None

    def cool_down(carry, t):
        cotangent, ring, acc = carry
        run = _Linearized(stage, weights, jnp.zeros_like(xs[0]))  # for its structure: its forward is unused
        cotangent, acc = backward(t, run, cotangent, ring, acc)
        return (cotangent, ring, acc), None

    zero = jnp.zeros_like(xs[0])
    (received, ring), _ = jax.lax.scan(warm_up, (zero, ring), jnp.arange(last))
    acc = (jax.tree.map(jnp.zeros_like, weights), jnp.zeros_like(xs))
    head_acc = (jax.tree.map(jnp.zeros_like, head), jnp.zeros((), jnp.float32))
    (_, cotangent, ring, acc, (d_head, total)), _ = jax.lax.scan(
        steady, (received, zero, ring, acc, head_acc), jnp.arange(last, last + m))
    (_, _, (grads, dxs)), _ = jax.lax.scan(cool_down, (cotangent, ring, acc), jnp.arange(last + m, 2 * last + m))
    return total, (grads, d_head), dxs


def one_f_one_b(stage_fn: Callable[[Any, jax.Array], jax.Array], loss_fn: Callable[[jax.Array, Any], jax.Array],
                entries: Any, xs: jax.Array, ys: Any, axis: str, stages: int) -> jax.Array:
    """The column's loss, the mean over the ``M`` microbatches ``xs`` (and targets ``ys``) of
    ``loss_fn(stage S-1 (... stage 0 (x)), y)``, run as the 1F1B schedule ([Note: 1F1B schedule]).

    ``stage_fn(entries, h)``: this stage's layers on one microbatch; every stage returns the
    same loss, and the gradients reach ``entries``, ``xs`` and what the functions close over.
    """
    stage, stage_floats, stage_others, _ = _hoisted(stage_fn, entries, xs[0])
    y0 = jax.tree.map(lambda v: v[0], ys)
    loss, head, head_others, loss_shape = _hoisted(loss_fn, xs[0], y0)  # traced once: its dtype comes with it
    dtype = loss_shape.dtype
    fixed = (stage_others, head_others, jax.lax.stop_gradient(ys))
    shapes = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), fixed)

    def forward(weights, head, xs, fixed):
        others, head_others, ys = fixed
        run_stage = lambda w, x: stage(w[1], others, w[0], x)  # noqa: E731
        run_loss = lambda h_consts, h, y: loss(h_consts, head_others, h, y)  # noqa: E731
        total, grads, dxs = _schedule(run_stage, run_loss, axis, stages, weights, head, xs, ys)
        saved = jax.tree.map(lambda r: checkpoint_name(r, SAVED), (grads, dxs))  # kept by the step's checkpoint
        return jax.lax.psum(total, axis).astype(dtype), saved

    def backward(res, g):
        (dw, d_head), dxs = res
        scale = jax.lax.psum(g, axis)  # each stage of the column returned the column's loss
        scaled = jax.tree.map(lambda d: d * scale.astype(d.dtype), (dw, d_head, dxs))
        return (*scaled, jax.tree.map(_zero_cotangent, shapes))

    scheduled = jax.custom_vjp(lambda weights, head, xs, fixed: forward(weights, head, xs, fixed)[0])
    scheduled.defvjp(forward, backward)
    return scheduled((entries, stage_floats), head, xs, fixed)
