"""Row lookups of a gathered table (an embedding) formed from exchanged activations.

[Note: row lookup route] A lookup ``table[ids]`` (``jnp.take(table, ids, axis=0)``, ``nnx.Embed``,
``nn.Embed``) of a gathered ``[V, D]`` table reads ``T`` of its rows per device, but FSDP gathers
all ``V`` of them (``V D (n-1)/n`` elements sent, ``V D`` held) and reduces a whole ``[V, D]``
gradient that is zero outside those rows (the same again, beside its scatter-add's buffer and, on
v4 and v5p, a copy padded for the first torus phase). With
``FullyShardPolicy(weight_gradients="from_activations")`` a marked table (``LeafComm.routable``)
is looked up on the shard instead, by :func:`routed_lookup`, where that sends fewer elements
(:func:`lookup_sends_less`: fewer tokens per device than ``V`` rows, roughly). Each device holds
``D/n`` columns of every row (its shard if the table is sharded on its second dim; an all-to-all
of its shard, ``V D (n-1)/n^2`` elements, if on its first), gathers every device's ids, looks up
its columns of every token and sends each device its tokens' columns back (an all-to-all of
``T D (n-1)/n``). Backward exchanges ``dy`` the other way, scatter-adds every device's tokens into
this device's columns (already summed over the devices, in ``reduce_dtype``) and, for a table
sharded on its first dim, sends the columns' rows to their shards: the gradient is finished as
a reduced one (``gather.reduce_summed``). Neither the gathered table nor its whole gradient
exists. The lookup keeps the gather's own mode and fill value (every device sees all ``V``
rows, so ids out of range behave as they would on the whole table). Unlike a matmul's route
(which needs the gathered matrix freed after forward to save anything), a lookup is routed in a
unit that keeps its leaves too (the root): the gathered table is then not kept either, if
nothing else reads it. ``jnp.take`` wraps its ``gather`` in a ``jit``: a ``jit`` whose body looks
up rows of a marked table is inlined first (:func:`inline_lookups`). Measured on the demo's Llama
(docs/benchmarks.md, "Embedding lookups on the shard").

With ``weight_gradients="in_blocks"`` (or where the route above sends more, with
``"from_activations+in_blocks"``) a table sharded on its rows is looked up by
:func:`blocked_lookup` instead: gathered as before for forward, but not kept (the gradient of a
lookup needs only the ids), its gradient scatter-added and reduce-scattered a block of columns at
a time ([Note: weight gradient blocks]): the whole gradient never exists, at the reduction's
bytes. Not where something else reads the gathered table (a tied head): it would be gathered
twice, and that reader's gradient is whole anyway. The Llama-3-8B NNX plan on ``v5p-256``
(docs/benchmarks.md, "Kept matrices' gradients in blocks").
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from jshard._step import collectives as C
from jshard._step.block_route import block_parts, ordered, reduced_in_blocks
from jshard._step.gather import LeafComm, gather_cast, reduce_summed
from jshard._step.remat import call_equation, marked, traced_equations


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def routed_lookup(comm: LeafComm, params: tuple[tuple[str, Any], ...], ids: jax.Array,
                  shard: jax.Array) -> jax.Array:
    """``gather(table, ids)`` of the table gathered from ``shard``, formed on the shard from
    exchanged ids and activations (see the Note); ``params``: the ``gather``'s own, as items;
    ``ids``: its indices ``[..., 1]``."""
    return _fwd(comm, params, ids, shard)[0]


def _columns(comm: LeafComm, shard: jax.Array) -> jax.Array:
    """``[V, D/n]``: this device's columns of every row of the table."""
    w = shard.astype(comm.param_dtype)
    return w if comm.layout.dim == 1 else jax.lax.all_to_all(w, comm.axes.shard, 1, 0, tiled=True)


def _lookup(params: tuple[tuple[str, Any], ...], columns: jax.Array, ids: jax.Array) -> jax.Array:
    """The rows of ``columns`` for every device's ``ids`` (``[n T, 1]``), in the gather's own mode
    and fill value (``params``): ``[n T, D/n]``."""
    numbers = jax.lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))
    return jax.lax.gather(columns, ids, numbers, (1, columns.shape[1]), **dict(params))


def _fwd(comm, params, ids, shard):
    axes = comm.axes.shard
    every = C.all_gather(ids.reshape(-1, 1), axes, 0, phases=comm.axes.gather_phases)
    y = jax.lax.all_to_all(_lookup(params, _columns(comm, shard), every), axes, 0, 1, tiled=True)
    return y.reshape(ids.shape[:-1] + y.shape[-1:]), every


def _scattered(comm: LeafComm, params: tuple[tuple[str, Any], ...], ids: jax.Array, dy: jax.Array) -> jax.Array:
    """The lookup's transpose: every token's row of ``dy`` added into a zero ``[V, dy's columns]``
    table at its id (``ids``: ``[tokens, 1]``), in ``reduce_dtype`` and the gather's own mode."""
    zeros = jnp.zeros((comm.layout.shape[0], dy.shape[1]), comm.reduce_dtype)
    _, scatter = jax.vjp(lambda columns: _lookup(params, columns, ids), zeros)
    return scatter(dy.astype(comm.reduce_dtype))[0]


def _bwd(comm, params, every, dy):
    axes, d = comm.axes.shard, comm.layout.shape[1]
    mine = jax.lax.all_to_all(dy.reshape(-1, d), axes, 1, 0, tiled=True)
    gradient = _scattered(comm, params, every, mine)
    if comm.layout.dim == 0:  # each block of rows to the device whose shard it is
        gradient = jax.lax.all_to_all(gradient, axes, 0, 1, tiled=True)
    return None, reduce_summed(comm, gradient)


routed_lookup.defvjp(_fwd, _bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def blocked_lookup(comm: LeafComm, params: tuple[tuple[str, Any], ...], ids: jax.Array,
                   shard: jax.Array) -> jax.Array:
    """``gather(table, ids)`` of the table gathered from ``shard`` (sharded on its rows), its
    gradient scatter-added and reduce-scattered a block of columns at a time ([Note: weight
    gradient blocks]); backward needs only the ids, so the gathered table is not kept."""
    return _blocked_fwd(comm, params, ids, shard)[0]


def _blocked_fwd(comm, params, ids, shard):
    rows = ids.reshape(-1, 1)
    y = _lookup(params, gather_cast(comm, shard), rows)
    return y.reshape(ids.shape[:-1] + y.shape[-1:]), rows


def _blocked_bwd(comm, params, rows, dy):
    dy = dy.reshape(-1, comm.layout.shape[1])

    def form(part: slice, after: Any) -> jax.Array:
        return _scattered(comm, params, rows, dy[:, part] if after is None else ordered(dy[:, part], after))

    return None, reduce_summed(comm, reduced_in_blocks(comm, comm.layout.shape, form))


blocked_lookup.defvjp(_blocked_fwd, _blocked_bwd)


def lookup_sends_less(tokens: int, v: int, d: int, dim: int, devices: int) -> bool:
    """Whether looking up ``tokens`` rows per device of a ``[v, d]`` table sharded on ``dim``
    over ``devices`` devices sends fewer elements per device routed (the ids gathered, the tokens'
    columns exchanged, and for ``dim`` 0 the shard's columns exchanged) than gathering the table;
    backward compares the same way with the gradient's reduction (see the Note).

    Example:
      >>> lookup_sends_less(2048, 128256, 4096, 0, 128), lookup_sends_less(4096, 1000, 64, 1, 8)
      (True, False)
    """
    n = devices
    routed = tokens * (n - 1) + tokens * d * (n - 1) / n + (v * d * (n - 1) / n**2 if dim == 0 else 0)
    return routed < v * d * (n - 1) / n


def routed_lookup_eqn(eqn: Any, made: dict[Any, Any], reads: Mapping[Any, int]) -> Any:
    """The equation of :func:`routed_lookup` for a row lookup ``gather`` of a marked table where
    that route is asked for and sends less, else of :func:`blocked_lookup` where gradients in
    blocks are asked for, the table is sharded on its rows and nothing else reads it gathered (a
    tied head would keep the gather, and its whole gradient, anyway), else ``eqn``. ``made``: each
    variable's defining equation; ``reads``: how many equations and results read each."""
    table, ids = eqn.invars
    mark = marked(table, made)
    if mark is None or not _row_lookup(eqn):
        return eqn
    (_, shard), comm = mark.invars, mark.params["comm"]
    (v, d), n, chosen = table.aval.shape, comm.axes.shard_size, comm.policy.gradient_routes
    params = (("fill_value", eqn.params["fill_value"]), ("mode", eqn.params["mode"]))
    if "from_activations" in chosen and not d % n and lookup_sends_less(ids.aval.size, v, d, comm.layout.dim, n):
        lookup = routed_lookup
    elif "in_blocks" in chosen and comm.layout.dim == 0 and reads[table] == 1 and len(block_parts(comm, (v, d))) > 1:
        lookup = blocked_lookup
    else:
        return eqn
    return call_equation(functools.partial(lookup, comm, params), [ids, shard], eqn.outvars) or eqn


def _row_lookup(eqn: Any) -> bool:
    """Whether a ``gather`` takes whole rows of a 2-D operand by one index each (``jnp.take(w, ids,
    axis=0)``)."""
    table, ids = eqn.invars
    numbers = eqn.params["dimension_numbers"]
    return (table.aval.ndim == 2 and ids.aval.ndim >= 1 and ids.aval.shape[-1] == 1
            and tuple(numbers.offset_dims) == (ids.aval.ndim - 1,) and tuple(numbers.collapsed_slice_dims) == (0,)
            and tuple(numbers.start_index_map) == (0,) and not tuple(getattr(numbers, "operand_batching_dims", ()))
            and tuple(eqn.params["slice_sizes"]) == (1, table.aval.shape[1]))


def inline_lookups(eqns: list[Any]) -> list[Any]:
    """``eqns`` with each ``jit`` that looks up rows of a marked table (``jnp.take`` of an
    embedding) replaced by its body, so that its ``gather`` meets the mark; ``eqns`` itself where
    there is none."""
    made = {v: eqn for eqn in eqns for v in eqn.outvars}
    out, changed = [], False
    for eqn in eqns:
        body = None
        if _looks_up_mark(eqn, made):  # its body traced afresh, wired to its operands and results
            body = traced_equations(jcore.jaxpr_as_fun(eqn.params["jaxpr"]), eqn.invars, eqn.outvars)
        out.extend(body if body is not None else [eqn])
        changed |= body is not None
    return out if changed else eqns


def _looks_up_mark(eqn: Any, made: dict[Any, Any]) -> bool:
    """Whether ``eqn`` is a ``jit`` whose body looks up rows of an operand that is a marked table."""
    if eqn.primitive.name not in ("jit", "pjit"):
        return False
    inner = eqn.params["jaxpr"].jaxpr
    tables = {v for v, x in zip(inner.invars, eqn.invars, strict=True) if marked(x, made) is not None}
    return any(e.primitive.name == "gather" and e.invars[0] in tables and _row_lookup(e) for e in inner.eqns)
