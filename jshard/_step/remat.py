"""The remat policy behind ``reshard_after_forward``, and the primitive it needs.

[Note: remat policy] A names-based policy alone does not free gathered parameters: remat
decides per equation, so when the ``checkpoint_name`` of a gathered value is not saveable it
saves the *input* of the name instead, which is just as large (the output of the slice that
removes padding, or of the all-gather). :data:`REMAT_POLICY` therefore refuses: values named
:data:`FREE` (and :data:`GATHER_START`), outputs of ``all_gather``, and outputs of
:data:`unpad_p`, :data:`depend_p`, :data:`pack_p`, :data:`custom_gather_p` and
:data:`routable_p`, jshard's own slice, dependence, concatenation, custom-gather and marker
primitives (a plain ``slice`` or ``add`` would catch the user's too). Remat then walks back to
the shard, which is saved, and re-gathers in backward. A custom gather
(``FullyShardPolicy(custom_all_gather=...)``) is one primitive because what it computes after
its collective (``float8_all_gather``'s bitcast and rescaling) would otherwise be saved: the
gathered leaf in another form, kept from forward to backward (v5p, four stacked 512 -> 1536
GELU blocks in bf16, activations kept, float8 gathers: 2 gathers in the step's loops and a
29.26 MiB peak before, 4 and 11.48 MiB now; bf16 gathers 10.67). Everything else is saveable,
so activations are not recomputed. Values named :data:`SAVED` (gathered units that keep their
parameters, group copies of ``reshard_after_forward=k``) are saved at the name.

[Note: nested remat] JAX applies the outermost ``jax.checkpoint``'s policy to everything
inside it, so a ``jax.checkpoint`` the user writes inside ``loss_fn`` or a ``js.scan``
body has no effect under the step's. :func:`remat_policy` therefore combines the user's
activation policy (``value_and_grad(remat_policy=...)``) with jshard's: a value is saved
only if both allow it, except ``SAVED`` gathers, which are always kept.

[Note: loop residuals] Under :data:`REMAT_POLICY` a checkpoint saves every value but gathers
and layout ops. Around a loop over stacked layers (``js.scan``, ``nnx.scan``, ``nn.scan``, a
pipeline stage) each saved value is stacked over the layers by the scan and kept from forward
to backward: XLA cannot fuse a GELU's elementwise intermediates back into the backward that
reads them, as it does in unrolled code (v5p 2x2x2, eight stacked 1536 -> 4608 GELU blocks,
activations kept, fp32: five ``f32[8,64,4608]`` stacks at the peak, 237.41 MiB against the
recipe's 216.59). The checkpoints that hold a loop, the step's around the loss where it runs
one (``segments.py``) and each layer's (``unit_gather.per_layer``), therefore also recompute
elementwise arithmetic (:func:`loop_policy`): matmul outputs stay saved, what they feed is
recomputed from them (that model 142.84 MiB; matmul FLOPs unchanged in the 24 stacked models of
the sweep). Both, because the outermost policy decides ([Note: nested remat]). A vector a layer
reads (a bias, a norm's scale) is then needed in backward; it stays gathered from forward to
backward (``unit_gather._kept_vector``: one vector per layer kept, no collective per vector per
layer in backward).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend
from jax.interpreters import ad, batching, mlir

FREE = "jshard_gathered"
SAVED = "jshard_saved"
GATHER_START = "jshard_gather_start"  # a shard about to be gathered: where the step cuts segments

unpad_p = jax.extend.core.Primitive("jshard_unpad")


def unpad_gathered(x: jax.Array, dim: int, size: int) -> jax.Array:
    """``x[..., :size, ...]`` along ``dim``, as a primitive the remat policy recognises."""
    if x.shape[dim] == size:
        return x
    return unpad_p.bind(x, dim=dim, size=size)


def _slice(x, *, dim, size):
    return jax.lax.slice_in_dim(x, 0, size, axis=dim)


def _abstract_eval(x, *, dim, size):
    return x.update(shape=x.shape[:dim] + (size,) + x.shape[dim + 1 :])


def _transpose(ct, x, *, dim, size):
    widths = [(0, 0, 0)] * ct.ndim
    widths[dim] = (0, x.aval.shape[dim] - size, 0)
    return [jax.lax.pad(ct, jax.numpy.zeros((), ct.dtype), widths)]


def _batch(args, dims, *, dim, size):
    (x,), (bd,) = args, dims
    x = jax.numpy.moveaxis(x, bd, 0)
    return unpad_p.bind(x, dim=dim + 1, size=size), 0


unpad_p.def_impl(_slice)
unpad_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(unpad_p, mlir.lower_fun(_slice, multiple_results=False))
ad.deflinear2(unpad_p, _transpose)
batching.primitive_batchers[unpad_p] = _batch


routable_p = jax.extend.core.Primitive("jshard_routable")


def mark_routable(x: jax.Array, shard: jax.Array, comm: Any, freed: bool = True) -> jax.Array:
    """``x``, a gathered leaf whose matmuls and row lookups may form its gradient from exchanged
    activations, marked for the step that finds them ([Note: weight gradient route] in
    ``weight_route.py``, [Note: row lookup route] in ``lookup_route.py``) with what they need: the
    ``shard`` it was gathered from (a second operand, read by nothing), the leaf's ``comm``
    (``gather.LeafComm``) and whether its unit frees it after forward (``freed``: a matmul is
    routed only then, a lookup either way). An identity in ``x`` the remat policy refuses to save,
    as it refuses the gather it marks."""
    return routable_p.bind(x, shard, comm=comm, freed=freed)


def _routable_jvp(primals, tangents, **params):
    (x, shard), (dx, _) = primals, tangents
    return routable_p.bind(x, shard, **params), routable_p.bind(ad.instantiate_zeros(dx), shard, **params)


routable_p.def_impl(lambda x, shard, **_: x)
routable_p.def_abstract_eval(lambda x, shard, **_: x)
mlir.register_lowering(routable_p, mlir.lower_fun(lambda x, shard, **_: x, multiple_results=False))
ad.primitive_jvps[routable_p] = _routable_jvp
ad.primitive_transposes[routable_p] = lambda ct, x, shard, **_: [ct, None]
batching.primitive_batchers[routable_p] = lambda args, dims, **_: (args[0], dims[0])


pack_p = jax.extend.core.Primitive("jshard_pack")


def pack(vectors: Sequence[jax.Array]) -> jax.Array:
    """``jnp.concatenate(vectors)`` of 1-D arrays, as a primitive the remat policy refuses to
    save: a unit's flat buffer of shards is rebuilt from the shards in backward, so that the
    re-gather depends on them (see [Note: unit collectives] in ``unit_collectives.py``)."""
    return pack_p.bind(*vectors)


def _pack_impl(*vectors):
    return jax.numpy.concatenate(vectors, axis=-1)


def _pack_batch(args, dims):
    size = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not None)
    batched = [jax.numpy.broadcast_to(x, (size,) + x.shape) if d is None else jax.numpy.moveaxis(x, d, 0)
               for x, d in zip(args, dims, strict=True)]
    return _pack_impl(*batched), 0


def _pack_abstract_eval(*vectors):
    return vectors[0].update(shape=vectors[0].shape[:-1] + (sum(v.shape[-1] for v in vectors),))


pack_p.def_impl(_pack_impl)
pack_p.def_abstract_eval(_pack_abstract_eval)
mlir.register_lowering(pack_p, mlir.lower_fun(_pack_impl, multiple_results=False))
batching.primitive_batchers[pack_p] = _pack_batch


depend_p = jax.extend.core.Primitive("jshard_depend")


def depend(x: jax.Array, sources: Sequence[jax.Array]) -> jax.Array:
    """``x`` plus a zero that depends on one element of each of ``sources``.

    The zero is ``e * 0`` where ``e`` is finite, else ``0``: exactly zero, never NaN, and
    not foldable (XLA cannot prove ``e * 0 == 0`` for floats). It is computed inside
    :data:`depend_p`, a primitive the remat policy refuses to save, so that in backward
    the dependence is recomputed from ``sources`` rather than saved (see [Note: unrolled
    units] in ``segments.py``). Integer ``x`` is returned as it is.
    """
    if not jax.numpy.issubdtype(x.dtype, jax.numpy.inexact):
        return x
    elements = [jax.numpy.ravel(s)[0] for s in sources if _readable(s)]
    return depend_p.bind(x, *elements) if elements else x


def _readable(s: Any) -> bool:
    return hasattr(s, "dtype") and s.size > 0 and s.dtype != jax.dtypes.float0


def _zero(elements) -> jax.Array:
    total = jax.numpy.zeros((), jax.numpy.float32)
    for e in elements:
        e = e.astype(jax.numpy.float32)
        total = total + jax.numpy.where(jax.numpy.isfinite(e), e * 0.0, 0.0)
    return total


def _depend_impl(x, *elements):
    return x + _zero(elements).astype(x.dtype)


def _depend_jvp(primals, tangents):
    return depend_p.bind(*primals), ad.instantiate_zeros(tangents[0])  # the zero has no derivative


def _depend_batch(args, dims):
    (x, *elements), (xd, *eds) = args, dims
    if any(d is not None for d in eds):  # per-example zeros: plain jnp (batched values are not remat'd here)
        zero = _zero([jax.numpy.moveaxis(e, d, 0) if d is not None else e for e, d in zip(elements, eds, strict=True)])
        x = jax.numpy.moveaxis(x, xd, 0) if xd is not None else x[None]
        return x + zero.astype(x.dtype).reshape(zero.shape + (1,) * (x.ndim - 1)), 0
    return depend_p.bind(x, *elements), xd


depend_p.def_impl(_depend_impl)
depend_p.def_abstract_eval(lambda x, *elements: x)
mlir.register_lowering(depend_p, mlir.lower_fun(_depend_impl, multiple_results=False))
ad.primitive_jvps[depend_p] = _depend_jvp
batching.primitive_batchers[depend_p] = _depend_batch


custom_gather_p = jax.extend.core.Primitive("jshard_custom_gather")


def custom_gather(hook: Any, shard: jax.Array, axes: Any, dim: int) -> jax.Array:
    """``hook(shard, axes, dim)``, a custom all-gather, as one primitive the remat policy
    refuses to save: in backward it is run again from the shard (see the Note above)."""
    closed = jax.make_jaxpr(lambda x: hook(x, axes, dim))(shard)
    return custom_gather_p.bind(shard, jaxpr=closed)


def _custom_gather_impl(x, *, jaxpr):
    return jax.extend.core.jaxpr_as_fun(jaxpr)(x)[0]


def _custom_gather_batch(args, dims, *, jaxpr):
    return jax.vmap(lambda x: _custom_gather_impl(x, jaxpr=jaxpr), in_axes=dims[0])(args[0]), 0


custom_gather_p.def_impl(_custom_gather_impl)
custom_gather_p.def_abstract_eval(lambda x, *, jaxpr: jaxpr.out_avals[0])
mlir.register_lowering(custom_gather_p, mlir.lower_fun(_custom_gather_impl, multiple_results=False))
batching.primitive_batchers[custom_gather_p] = _custom_gather_batch


# Cheap layout and dtype changes: recomputed in backward rather than saved, so that a
# parameter the model slices, casts, transposes or reshapes is re-gathered, not kept in
# its derived form (their inputs are saved instead when they are activations).
_RECOMPUTED = frozenset({"convert_element_type", "transpose", "reshape", "broadcast_in_dim", "slice",
                         "squeeze", "expand_dims", "copy", "copy_p", "rev"})


def _policy(prim, *_, **params) -> bool:
    if prim.name == "name":
        return params["name"] not in (FREE, GATHER_START)
    return (prim not in (unpad_p, depend_p, pack_p, custom_gather_p, routable_p) and prim.name != "all_gather"
            and prim.name not in _RECOMPUTED)


REMAT_POLICY = _policy

# Elementwise arithmetic, recomputed in a loop's backward under jshard's own policy: see
# [Note: loop residuals].
_ELEMENTWISE = frozenset({"exp", "exp2", "expm1", "log", "log1p", "tanh", "logistic", "erf", "erf_inv", "sqrt",
                          "rsqrt", "pow", "integer_pow", "square", "abs", "sign", "neg", "add", "add_any", "sub",
                          "mul", "div", "max", "min", "select_n", "eq", "ne", "gt", "lt", "ge", "le", "and", "or",
                          "not"})


def _loop_policy(prim, *args, **params) -> bool:
    return prim.name not in _ELEMENTWISE and _policy(prim, *args, **params)


def loop_policy(policy: Any) -> Any:
    """The policy for a checkpoint that holds a loop over stacked layers (or is one layer's):
    under jshard's own policy elementwise arithmetic is recomputed too, any other policy is
    returned as it is (see [Note: loop residuals]).

    Example:
      >>> import jax
      >>> loop_policy(REMAT_POLICY) is REMAT_POLICY, loop_policy(jax.checkpoint_policies.nothing_saveable).__name__
      (False, 'nothing_saveable')
    """
    return _loop_policy if policy is REMAT_POLICY else policy


def traced_equations(fn: Any, operands: list[Any], outvars: list[Any]) -> list[Any] | None:
    """The equations ``fn`` traces to on ``operands``' avals, reading ``operands`` and writing
    ``outvars``: what replaces an equation (a call of ``fn``'s) in the jaxpr it came from, or
    ``None`` where that cannot be done plainly (constants captured, a result that is an operand, a
    literal or another result).

    Example:
      >>> closed = jax.make_jaxpr(lambda x: x * 2)(1.0)
      >>> (eqn,) = closed.jaxpr.eqns
      >>> [e.primitive.name for e in traced_equations(lambda x: -x * 3, eqn.invars[:1], eqn.outvars)]
      ['neg', 'mul']
    """
    traced = jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in operands))
    inner = traced.jaxpr
    made = {v for e in inner.eqns for v in e.outvars}
    if inner.constvars or traced.consts or len(set(map(id, inner.outvars))) != len(inner.outvars) \
            or any(isinstance(v, jax.extend.core.Literal) or v not in made for v in inner.outvars):
        return None
    renamed = dict(zip(inner.invars, operands, strict=True)) | dict(zip(inner.outvars, outvars, strict=True))
    return [e.replace(invars=[x if isinstance(x, jax.extend.core.Literal) else renamed.get(x, x) for x in e.invars],
                      outvars=[renamed.get(x, x) for x in e.outvars]) for e in inner.eqns]


def call_equation(fn: Any, operands: list[Any], outvars: list[Any]) -> Any:
    """The one equation ``fn`` traces to (a ``custom_vjp`` call), wired as :func:`traced_equations`
    wires it, or ``None`` where it traces to more.

    Example:
      >>> closed = jax.make_jaxpr(lambda x: x * 2)(1.0)
      >>> (eqn,) = closed.jaxpr.eqns
      >>> call_equation(lambda x: -x, eqn.invars[:1], eqn.outvars).primitive.name
      'neg'
    """
    eqns = traced_equations(fn, operands, outvars)
    return eqns[0] if eqns is not None and len(eqns) == 1 else None


def marked(x: Any, made: dict[Any, Any]) -> Any:
    """The equation of :data:`routable_p` that made ``x`` (``made``: each variable's defining
    equation), or ``None`` where ``x`` is no marked leaf."""
    mark = None if isinstance(x, jax.extend.core.Literal) else made.get(x)
    return mark if mark is not None and mark.primitive is routable_p else None


def sub_jaxprs(eqn: Any) -> list[Any]:
    """The jaxprs nested in ``eqn``'s parameters (a loop's body, a checkpoint's, a branch)."""
    found = []
    for value in eqn.params.values():
        for v in value if isinstance(value, tuple | list) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                found.append(v.jaxpr)
            elif isinstance(v, jax.extend.core.Jaxpr):
                found.append(v)
    return found


@functools.cache
def checkpoint_primitive() -> Any:
    """The primitive ``jax.checkpoint`` binds (its name differs across jax versions).

    Example:
      >>> import jax
      >>> jax.make_jaxpr(jax.checkpoint(lambda x: x))(0.0).eqns[0].primitive is checkpoint_primitive()
      True
    """
    return jax.make_jaxpr(jax.checkpoint(lambda x: x))(0.0).eqns[0].primitive


def keeps_cse_barrier(policy: Any) -> bool:
    """Whether an unrolled segment's checkpoint under ``policy`` keeps ``jax.checkpoint``'s CSE
    barrier (``prevent_cse``). Under jshard's own policy it does not: that policy recomputes
    gathers and layout ops only, which the segments' dependences keep apart from the forward
    gathers, and the barrier would pin every residual JAX picked ([Note: unrolled units] in
    ``segments.py``). Under a ``remat_policy`` it does, as ``jax.checkpoint`` in the
    hand-written step: a recomputed layer is kept apart from its forward.

    Example:
      >>> import jax
      >>> keeps_cse_barrier(REMAT_POLICY), keeps_cse_barrier(jax.checkpoint_policies.nothing_saveable)
      (False, True)
    """
    return policy is not REMAT_POLICY


def remat_policy(activations=None):
    """jshard's policy, combined with a ``jax.checkpoint`` policy for activations."""
    if activations is None:
        return REMAT_POLICY

    def policy(prim, *args, **params):
        if prim.name == "name" and params["name"] == SAVED:
            return True
        return _policy(prim, *args, **params) and activations(prim, *args, **params)

    return policy
