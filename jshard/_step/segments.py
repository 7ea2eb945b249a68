"""Unit boundaries for unrolled code: the step's loss cut at each unit's gather.

[Note: unrolled units] A unit gathered by :func:`jshard.unshard` in straight-line code
(a Python loop over layers, an NNX or Linen module per block, a Hugging Face layer
stack) is not bounded by remat alone. Its gather depends only on parameters, so XLA
schedules every gather at the top of the program; the re-gather that remat places in
backward is the same computation as the forward gather, so XLA's CSE merges the two
(XLA:CPU first drops ``optimization_barrier`` in ``cse_barrier_expander``), and every
gathered unit stays alive until its backward. Measured before this: 8 units of 1 MiB
in a Python loop kept 8.0 MiB of temporaries, one whole unit more per layer.

The step therefore traces the loss to a jaxpr and cuts its top-level equations into
**segments**: a new segment starts at a gather (a ``checkpoint_name``
:data:`GATHER_START` on a shard, emitted by ``gather.gather_leaf`` for the shards it gathers;
a leaf kept whole is neither a cut nor ordered below) that follows compute (an equation
reading something other than parameters). Each segment runs as a
``custom_vjp`` whose data dependences order the program on every backend:

- forward: each segment hands the next a *token*, a zero ``depend``-ed on the
  activations it received; the next segment's shards are ``depend``-ed on that token, so
  a unit is gathered as soon as the layer before it has *started* (FSDP2's prefetch: the
  next unit's all-gather can overlap the running unit's compute) and no earlier (at most
  the running unit and the next one are gathered). The dependence is made inside the
  segment's checkpoint, which takes the shards as they are and the token: what backward
  keeps of a shard is then the parameter itself. Made before it, the residual was the
  depended copy (shard plus the token's zero), a float32 shard per unit that XLA:TPU kept
  from forward to backward: a training step of eight unrolled 1536 -> 4608 GELU blocks,
  recomputed, on v6e 2x4 held four layers' copies at its fullest, 86.94 MiB against the
  plain recipe's 68.19, now 70.56 (docs/benchmarks.md, "Shard copies kept for backward");
- backward: the token's cotangent is a zero ``depend``-ed on the next segment's incoming
  cotangents, and the shards, as saved in the residuals, are ``depend``-ed on it, so a
  re-gather may run while the segment after it computes its backward (prefetch again),
  not before the one after that finished, and is a different computation from the forward
  gather (CSE cannot merge it). The last segment has no next: its shards wait for its own
  cotangents, and the token cotangent it hands back waits for its backward (its incoming
  cotangent is the loss's constant 1, on which nothing can be made to wait). With
  ``value_and_grad(..., backward_prefetch=False)`` every segment hands back that later token
  (FSDP1's ``BACKWARD_POST``, later still): a re-gather waits for the next segment's whole
  backward, its gradients reduced, so backward never holds a prefetched unit beside a full
  gradient; nothing then overlaps the re-gather (docs/benchmarks.md measures both).

Under jshard's own policy the segment's checkpoint runs with ``prevent_cse=False``
(``remat.keeps_cse_barrier``). ``jax.checkpoint`` otherwise passes every residual through an
``optimization_barrier`` in backward, which pins each as a buffer of its own: XLA:TPU cannot
fold a GELU's elementwise intermediates back into the backward fusion that recomputes them
(the sweep's transformer, 8 unrolled 256-wide blocks, batch 64, activations kept: six
``f32[8,64,1024]`` per block; peak 156.0 MiB with the barrier, 79.4 without, the recipe 64.1).
That policy recomputes only gathers and layout ops, and the dependences above already keep
the re-gathers apart: in the TPU-compiled program every segment's re-gathers but the last's
are there without the barrier (v5p 2x2x2, that transformer: 7 of 8 per block matrix; when
the last segment was still checkpointed, its incoming cotangent, the constant 1, let XLA's
algebraic simplifier fold its ``depend`` and CSE merge its re-gather with its forward
gather; it is not checkpointed now, see below). The memory bound holds (1024 -> 3072 GELU
units, 8 rows per device: XLA's live peak less the arguments 24.5 MiB at 4 layers, 24.8 at
8); an earlier reading of a failure compared ``temp_size_in_bytes``, the size of the
temporaries' allocation, whose packing varies with the program (25.9 MiB at 4 layers, 51.9
at 8, 55.0 at 16; with the barrier 50.8, 52.3, 52.3). These figures were measured while the
last segment was checkpointed. Under a ``remat_policy`` the barrier
stays, as in ``jax.checkpoint(layer)`` in the hand-written step: it keeps a recomputed layer
apart from its forward (without it the sweep's 12 unrolled recomputed models on v5p peaked higher
in 21 of 24 compiles, with and without the async flags, measured while whole leaves still waited
for the previous unit: tanh 8x1536 fp32 44.96 -> 53.90 MiB).

``depend(x, sources)`` (``remat.py``) adds a zero read from one element of each source:
``e * 0`` where ``e`` is finite, else 0. It is exactly zero, never NaN, and XLA cannot
fold it (it cannot prove ``e * 0 == 0`` for floats); it is a primitive the remat policy
refuses to save, so a dependence inside a checkpoint is recomputed with it in backward
(``reshard_after_forward=k`` re-gathers from its saved group copy that way).

Inside a segment, ``jax.vjp`` of the segment under the step's names-based remat policy
decides what is saved (activations) and what is recomputed (gathered parameters); the
shards are found among its residuals by identity and only they are replaced in backward.
A loss with one segment (stacked units under :func:`jshard.scan`, or every unit gathered
up front) runs as one checkpoint of the traced jaxpr, as before. Limits: a gather inside
a nested jaxpr (a ``jax.jit``, ``jax.checkpoint`` or scan inside ``loss_fn``) belongs to
that equation, which is not cut; a gathered unit read again in a later segment (a tied
embedding) is carried to it, so it stays gathered in between. The last segment runs
without a checkpoint: its backward follows its forward at once, so it keeps its unit
gathered and its activations rather than re-gather and recompute them (the peak is the same;
the matmuls of its layer and of the loss's tail run once: [Note: recompute once]).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jcore

from jshard._step.remat import (
    FREE,
    GATHER_START,
    REMAT_POLICY,
    checkpoint_primitive,
    depend,
    keeps_cse_barrier,
    loop_policy,
    sub_jaxprs,
)
from jshard._step.weight_route import route_matmuls, route_whole


def _is_start(eqn: Any) -> bool:
    return eqn.primitive.name == "name" and eqn.params.get("name") == GATHER_START


def frees_outside_checkpoints(eqns: Sequence[Any]) -> bool:
    """Whether a gathered value is freed (named :data:`FREE`) outside every ``jax.checkpoint``
    among ``eqns``: only then does the step need a checkpoint of its own around the loss (or
    around one of its segments).

    [Note: recompute once] Layers under :func:`jshard.scan` are checkpointed per iteration
    with the step's policy. A checkpoint around the whole loss would apply its policy to
    them too (the outermost policy decides) and, under a policy that saves nothing, recompute
    the whole forward scan in backward before each iteration recomputes its layer again: the
    forward three times where ``jax.checkpoint(layer)`` in a ``lax.scan`` runs it twice. So the
    loss is checkpointed as a whole only where a unit gathered outside those bodies must be
    freed (``reshard_after_forward`` of a unit gathered at the top level), or where the step's
    policy is jshard's own (no ``remat_policy``). Under a ``remat_policy`` a segment that frees
    such a unit is cut again before a loop that gathers inside it, so the checkpoint that frees
    the unit does not hold the loop: an NNX Llama with its embedding and its output head each a
    unit of its own (torchtitan wraps them so) ran its stacked layers' forward three times,
    1.21x the recipe's matmul FLOPs (``tests/test_recompute.py`` pins a smaller case). Jshard's
    own policy recomputes only cheap layout ops
    (around a loop, elementwise arithmetic too: [Note: loop residuals] in ``remat.py``) and saves
    their inputs, less than plain differentiation keeps (v5p, eight stacked 1536-wide tanh layers,
    activations kept: 35.7 MiB with it, 48.3 without).
    """
    for eqn in eqns:
        if eqn.primitive.name == "name" and eqn.params.get("name") == FREE:
            return True
        if eqn.primitive is not checkpoint_primitive() and any(
                frees_outside_checkpoints(j.eqns) for j in sub_jaxprs(eqn)):
            return True
    return False


def _has_loop(eqns: Sequence[Any]) -> bool:
    """Whether a ``scan`` or ``while`` runs among ``eqns`` (nested jaxprs included)."""
    return any(eqn.primitive.name in ("scan", "while") or any(_has_loop(j.eqns) for j in sub_jaxprs(eqn))
               for eqn in eqns)


class _Segment:
    """A run of top-level equations: its inputs, outputs, the shards it gathers and whether it
    runs under the step's checkpoint (decided on its equations as traced, before any route)."""

    def __init__(self, eqns: list[Any], policy: Any):
        self.eqns = eqns
        self.checkpointed = _checkpoint_whole(eqns, policy)
        self.inputs: list[Any] = []
        self.outputs: list[Any] = []
        self.gathered: set[Any] = set()
        for eqn in eqns:
            if _is_start(eqn) and not isinstance(eqn.invars[0], jcore.Literal):
                self.gathered.add(eqn.invars[0])

    def jaxpr(self, effects: Any) -> jcore.Jaxpr:
        info = jcore.DebugInfo("jshard segment", "jshard._step.segments", None, None)
        return jcore.Jaxpr([], self.inputs, self.outputs, self.eqns, effects, info)

    def route(self, effects: Any) -> None:
        """Under a ``remat_policy``: its matmuls routed, all or none ([Note: weight gradient
        route] in ``weight_route.py``)."""
        self.eqns = route_whole(self.jaxpr(effects)).eqns


def _checkpoint_whole(eqns: Sequence[Any], policy: Any) -> bool:
    """Whether a segment (or the whole loss) runs under the step's checkpoint: see
    [Note: recompute once]."""
    return policy is REMAT_POLICY or frees_outside_checkpoints(eqns)


def _gathers_inside(eqn: Any) -> bool:
    """Whether a gather starts inside the equation's nested jaxprs (a loop over a stack)."""
    return any(_is_start(e) or _gathers_inside(e) for j in sub_jaxprs(eqn) for e in j.eqns)


def _split(eqns: Sequence[Any], params: set[Any], cut_loops: bool = False) -> list[list[Any]]:
    """Cut before a gather that follows compute (an equation reading non-parameter values);
    ``cut_loops``: before an equation that gathers inside (a loop over a stack) too."""
    segments: list[list[Any]] = [[]]
    derived = set(params)  # values computed from parameters (shards, gathers) alone
    computed = False
    for eqn in eqns:
        if computed and (_is_start(eqn) or cut_loops and _gathers_inside(eqn)):
            segments.append([])
            computed = False
        segments[-1].append(eqn)
        reads = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
        if all(v in derived for v in reads):
            derived.update(eqn.outvars)
        else:
            computed = True
    return [s for s in segments if s]


def _wire(segments: list[_Segment], jaxpr: Any) -> None:
    """Each segment's inputs (read, defined elsewhere) and outputs (read later)."""
    later: set[Any] = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
    for seg in reversed(segments):
        defined = {v for eqn in seg.eqns for v in eqn.outvars}
        seg.outputs = [v for v in _ordered_defs(seg) if v in later]
        reads = [v for eqn in seg.eqns for v in eqn.invars if not isinstance(v, jcore.Literal)]
        seg.inputs = list(dict.fromkeys(v for v in reads if v not in defined))
        later |= set(seg.inputs)


def _ordered_defs(seg: _Segment) -> list[Any]:
    return [v for eqn in seg.eqns for v in eqn.outvars if not isinstance(v, jcore.DropVar)]


def _evaluator(seg: _Segment, effects: Any) -> Callable[..., list[Any]]:
    return jcore.jaxpr_as_fun(jcore.ClosedJaxpr(seg.jaxpr(effects), []))


def _call(seg: _Segment, run: Callable[..., list[Any]], policy: Any, earlier: set[Any], values: list[Any],
          prev_token: jax.Array | None, last: bool, prefetch: bool) -> tuple[list[Any], jax.Array]:
    """Run one segment as a ``custom_vjp`` with the Note's forward and backward dependences.

    ``earlier``: the values produced by earlier segments (the activations it depends on).
    ``prev_token``: the previous segment's token (``None`` for the first), a zero that
    depends on the activations the previous segment received: the shards depend on it, so
    this unit is gathered while the previous one computes (prefetch). Returns the outputs
    and this segment's token. In backward, the token's cotangent is a zero that depends on
    the next segment's incoming cotangents, and the re-gather depends on it, so it runs
    while the next segment's backward computes; the last segment, which has no next, waits
    for its own cotangents. ``prefetch=False``: the token's cotangent waits for this segment's
    whole backward (its outgoing cotangents, reduced gradients included), as the last's does.
    """
    shard_at = [i for i, v in enumerate(seg.inputs) if v in seg.gathered]
    act_at = [i for i, v in enumerate(seg.inputs) if v in earlier and v not in seg.gathered]
    stash: dict[str, Any] = {}

    def with_dep(vals: Sequence[Any], sources: Sequence[Any]) -> list[Any]:
        vals = list(vals)
        for i in shard_at:
            vals[i] = depend(vals[i], sources)
        return vals

    def token_of(vals: Sequence[Any]) -> jax.Array:
        return depend(jax.numpy.zeros((), jax.numpy.float32), [vals[i] for i in act_at])

    # [Note: recompute once]: a segment whose gathers are all checkpointed inside it (a stack's
    # scan) runs as it is; a checkpoint around it would recompute the whole scan. The last
    # segment is not checkpointed: its backward follows its forward at once, so what a
    # checkpoint would free is recomputed straight away (no lower peak), and recomputing it
    # would redo its unit's layer and the loss's tail, which jax.checkpoint(layer) never does.
    def ordered(vals, token):
        return run(*with_dep(vals, [token]))

    checkpointed = (jax.checkpoint(ordered, policy=policy, prevent_cse=keeps_cse_barrier(policy))
                    if seg.checkpointed and not last else ordered)

    @jax.custom_vjp
    def segment(vals, token):
        return ordered(vals, token), token_of(vals)

    def fwd(vals, token):
        outs, vjp_fn = jax.vjp(checkpointed, list(vals), token)
        leaves, stash["tree"] = jax.tree.flatten(vjp_fn)
        shards = [vals[i] for i in shard_at]
        stash["at"] = [k for k, leaf in enumerate(leaves) if any(leaf is s for s in shards)]
        return (outs, token_of(vals)), leaves

    def bwd(leaves, cts):
        cts, token_ct = cts
        after = cts if last else [token_ct]  # the re-gather waits for these
        leaves = [depend(x, after) if k in stash["at"] else x for k, x in enumerate(leaves)]
        ct_vals = list(jax.tree.unflatten(stash["tree"], leaves)(cts)[0])
        # The last segment's incoming cotangent is the loss's constant 1: the previous
        # segment's re-gather then waits for this one's backward, or XLA would merge it with
        # the forward gather.
        return ct_vals, depend(jax.numpy.zeros((), jax.numpy.float32), ct_vals if last or not prefetch else cts)

    segment.defvjp(fwd, bwd)
    token = jax.numpy.zeros((), jax.numpy.float32) if prev_token is None else prev_token
    return segment(list(values), token)


def segmented(fn: Callable[..., Any], policy: Any, n_params: int, backward_prefetch: bool) -> Callable[..., Any]:
    """``fn`` (whose first ``n_params`` flat arguments are shards) cut at unit boundaries
    (``backward_prefetch``: see the Note).

    With one segment it is ``jax.checkpoint(fn, policy=policy)`` as before (of the jaxpr
    already traced: ``fn`` runs once, whatever its trace-time side effects), or ``fn`` itself
    where nothing gathered outside a checkpoint is freed ([Note: recompute once]).
    """

    def run(*args: Any) -> Any:
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        closed = route_matmuls(closed, policy)  # [Note: weight gradient route]
        jaxpr = closed.jaxpr
        params = set(jaxpr.invars[:n_params]) | set(jaxpr.constvars)
        pieces = _split(jaxpr.eqns, params)
        if policy is not REMAT_POLICY:  # a loop leaves a segment its checkpoint would recompute it in
            pieces = [q for p in pieces for q in (_split(p, params, cut_loops=True)
                                                 if frees_outside_checkpoints(p) else [p])]
        flat_args = jax.tree.leaves(args)
        if len(pieces) <= 1:
            routed = closed if policy is REMAT_POLICY else jcore.ClosedJaxpr(route_whole(jaxpr), closed.consts)
            whole = jcore.jaxpr_as_fun(routed)
            if _checkpoint_whole(jaxpr.eqns, policy):  # see [Note: recompute once]
                whole = jax.checkpoint(whole, policy=loop_policy(policy) if _has_loop(jaxpr.eqns) else policy)
            return jax.tree.unflatten(jax.tree.structure(shape), whole(*flat_args))
        segments = [_Segment(p, policy) for p in pieces]
        _wire(segments, jaxpr)
        if policy is not REMAT_POLICY:  # routed once cut: recomputed units are routed whole
            for seg in segments:
                seg.route(jaxpr.effects)
        env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(jaxpr.invars, flat_args, strict=True))
        earlier: set[Any] = set()
        token = None
        for k, seg in enumerate(segments):
            outs, token = _call(seg, _evaluator(seg, jaxpr.effects), policy, earlier, [env[v] for v in seg.inputs],
                                token, last=k == len(segments) - 1, prefetch=backward_prefetch)
            env.update(zip(seg.outputs, outs, strict=True))
            earlier |= set(seg.outputs)
        flat = [v.val if isinstance(v, jcore.Literal) else env[v] for v in jaxpr.outvars]
        return jax.tree.unflatten(jax.tree.structure(shape), flat)

    return run
