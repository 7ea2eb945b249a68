"""User-facing policies: frozen, hashable dataclasses validated on construction.

Each mirrors the PyTorch FSDP2 policy of the same name (``torch.distributed.fsdp``);
see docs/fsdp2.md for the table of correspondences.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from jshard._sharding.comm_hooks import AllGather, AllReduce, ReduceScatter, check_hook
from jshard._sharding.dtypes import cast_floating, is_floating


def _as_dtype(name: str, value: Any) -> np.dtype | None:
    if value is None:
        return None
    try:
        dtype = jnp.dtype(value)
    except TypeError as e:
        raise ValueError(f"`{name}` must be a dtype such as jnp.bfloat16 or None, got {value!r}.") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"`{name}` must be a floating dtype (it is a compute or reduction precision), "
            f"got {dtype}."
        )
    return dtype


def _as_axes(name: str, value: Any, allow_none: bool) -> tuple[str, ...] | None:
    if value is None:
        if allow_none:
            return None
        raise ValueError(f"`{name}` must name at least one mesh axis, got None.")
    axes = (value,) if isinstance(value, str) else value
    if not isinstance(axes, tuple) or not all(isinstance(a, str) and a for a in axes):
        raise ValueError(
            f"`{name}` must be a mesh axis name or a tuple of them, got {value!r}."
        )
    if not axes:
        if allow_none:
            return None
        raise ValueError(f"`{name}` must name at least one mesh axis, got ().")
    if len(set(axes)) != len(axes):
        raise ValueError(f"`{name}` names an axis twice: {axes}.")
    return axes


def _check_callable(name: str, value: Any) -> None:
    if value is not None and not callable(value):
        raise ValueError(f"`{name}` must be a callable or None, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Precision of gathered parameters, gradient reduction and outputs.

    Args:
      param_dtype: dtype of gathered parameters (all-gather and compute dtype). Shards
        keep their own dtype: they are the master copy. Non-floating leaves are never
        cast. ``None`` keeps each leaf's dtype.
      reduce_dtype: dtype of the gradient reduce-scatter and all-reduce. ``None`` means
        ``param_dtype`` if set, else the leaf's dtype. Reduced gradients are cast back
        to the shard's dtype.
      output_dtype: floating outputs of the loss function are cast to it.
      cast_forward_inputs: cast floating inputs (the batch) to ``param_dtype``.

    Example:
      >>> import jax.numpy as jnp, jshard as js
      >>> mp = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
      >>> mp.param_dtype
      dtype(bfloat16)
    """

    param_dtype: Any = None
    reduce_dtype: Any = None
    output_dtype: Any = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            object.__setattr__(self, name, _as_dtype(name, getattr(self, name)))
        if not isinstance(self.cast_forward_inputs, bool):
            raise ValueError(
                f"`cast_forward_inputs` must be a bool, got {self.cast_forward_inputs!r}."
            )

    def compute_dtype(self, leaf_dtype: Any) -> np.dtype:
        """The dtype a leaf is gathered and used in: ``param_dtype`` for floating leaves.

        Example:
          >>> import jax.numpy as jnp, jshard as js
          >>> mp = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16)
          >>> mp.compute_dtype(jnp.float32), mp.compute_dtype(jnp.int32)
          (dtype(bfloat16), dtype('int32'))
        """
        leaf_dtype = np.dtype(leaf_dtype)
        return self.param_dtype if self.param_dtype is not None and is_floating(leaf_dtype) else leaf_dtype

    def gradient_dtype(self, leaf_dtype: Any) -> np.dtype:
        """The dtype a leaf's gradient is reduced in: ``reduce_dtype``, else ``param_dtype``, else its own.

        Example:
          >>> import jax.numpy as jnp, jshard as js
          >>> js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16).gradient_dtype(jnp.float32)
          dtype(bfloat16)
        """
        return np.dtype(self.reduce_dtype or self.param_dtype or leaf_dtype)

    def cast_inputs(self, tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> Any:
        """A forward's floating inputs in ``param_dtype`` when ``cast_forward_inputs`` (the
        step's batch, a sharded module's arguments); the one home of that cast.

        Example:
          >>> import jax.numpy as jnp, jshard as js
          >>> js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16).cast_inputs(jnp.ones(2)).dtype
          dtype(bfloat16)
        """
        return cast_floating(tree, self.param_dtype, is_leaf) if self.cast_forward_inputs else tree

    def cast_outputs(self, tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> Any:
        """A forward's floating outputs in ``output_dtype`` (the loss, a sharded module's result).

        Example:
          >>> import jax.numpy as jnp, jshard as js
          >>> js.MixedPrecisionPolicy(output_dtype=jnp.float32).cast_outputs(jnp.ones(2, jnp.bfloat16)).dtype
          dtype('float32')
        """
        return cast_floating(tree, self.output_dtype, is_leaf)


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    """No offload: sharded state lives in device memory.

    Example:
      >>> import jshard as js
      >>> js.OffloadPolicy().memory_kind is None
      True
    """

    @property
    def memory_kind(self) -> str | None:
        """The memory kind of sharded state (``None``: the device's default)."""
        return None


@dataclasses.dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters, gradients and optimizer state live in host memory.

    Args:
      pin_memory: use page-locked host memory (``pinned_host``), which devices copy
        from asynchronously; ``False`` uses ``unpinned_host``.

    Example:
      >>> import jshard as js
      >>> js.CPUOffloadPolicy().memory_kind
      'pinned_host'
    """

    pin_memory: bool = True

    def __post_init__(self):
        if not isinstance(self.pin_memory, bool):
            raise ValueError(f"`pin_memory` must be a bool, got {self.pin_memory!r}.")

    @property
    def memory_kind(self) -> str:
        return "pinned_host" if self.pin_memory else "unpinned_host"


@dataclasses.dataclass(frozen=True)
class DataParallelMeshDims:
    """Which mesh axes shard state (FSDP) and which replicate it (HSDP).

    Gradients are reduce-scattered over ``shard`` axes and all-reduced over
    ``replicate`` axes; the batch is split over both.

    Args:
      shard: a mesh axis name or a tuple of names.
      replicate: a mesh axis name, a tuple of names, or ``None``.

    Example:
      >>> import jshard as js
      >>> js.DataParallelMeshDims(shard="fsdp", replicate="replicate").replicate
      ('replicate',)
    """

    shard: str | tuple[str, ...] = "fsdp"
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self):
        shard = _as_axes("shard", self.shard, allow_none=False)
        replicate = _as_axes("replicate", self.replicate, allow_none=True) or ()
        overlap = set(shard) & set(replicate)
        if overlap:
            raise ValueError(
                f"Mesh axes {sorted(overlap)} are named both in `shard` and `replicate`; "
                "an axis either shards or replicates."
            )
        object.__setattr__(self, "shard", shard)
        object.__setattr__(self, "replicate", replicate)


WEIGHT_GRADIENTS = ("reduced", "from_activations", "in_blocks", "from_activations+in_blocks")


@dataclasses.dataclass(frozen=True)
class FullyShardPolicy:
    """Everything that decides how one unit is sharded, gathered and reduced.

    Args:
      reshard_after_forward: ``True``: gathered parameters are freed after forward and
        re-gathered for backward; ``False``: kept for backward; ``None``: ``False`` for
        the root unit, ``True`` for the others; an ``int k`` (``1 < k < N``, dividing
        N): a copy sharded over groups of ``k`` devices is kept and backward gathers
        only inside the group.
      shard_placement_fn: ``(key_path, leaf) -> int | None``: the dim to shard a leaf
        on; ``None`` means the default (0, or 1 with ``scan_axis=0``).
      mp_policy: a :class:`MixedPrecisionPolicy`.
      offload_policy: :class:`OffloadPolicy` or :class:`CPUOffloadPolicy`.
      ignored_params: ``(key_path, leaf) -> bool``: matching leaves are not sharded,
        not cast and get no gradient (they are constants of the step).
      dp_mesh_dims: a :class:`DataParallelMeshDims`; ``None`` infers it from the mesh.
      scan_axis: ``0`` when every leaf is stacked along axis 0, one slice per layer.
      gradient_divide_factor: reduced gradients are divided by it; ``None`` means the
        number of data-parallel devices (the gradient of the global-batch mean).
      force_sum_reduction_for_comms: split the division into a pre- and a post-scale
        around the sum (FSDP2's name); by default this happens only for float16.
      custom_all_gather: a :class:`AllGather`, ``(shard, axis_names, dim) -> full``,
        replacing the all-gather (e.g. :func:`jshard.int8_all_gather`).
      custom_reduce_scatter: a :class:`ReduceScatter`, ``(grad, axis_names, dim) ->
        shard``, replacing the reduce-scatter (a sum).
      all_reduce_hook: a :class:`AllReduce`, ``(grad_shard, replicate_axes) ->
        grad_shard``, replacing the all-reduce over replicate axes (a sum); runs on 1-D
        meshes too, with ``()``.
      unit_collectives: ``True``: one all-gather and one reduce-scatter for all the
        unit's leaves, through a flat buffer (FSDP2's copy-in / copy-out): fewer, larger
        collectives, at the cost of one more gathered unit (and one more unit of
        gradient) of temporaries while it is copied. ``False`` (default): one per leaf,
        which XLA's GPU and TPU collective combiners may merge without a copy. Leaves with
        a custom collective, model axes or an int ``reshard_after_forward`` keep their own.
      replicate_below: leaves with fewer elements than this (per layer, with ``scan_axis=0``)
        are not sharded: every device keeps them whole, they are never gathered, and their
        gradient is all-reduced (DeepSpeed ZeRO-3's ``stage3_param_persistence_threshold``).
        Sharded, biases and norm scales cost one small collective each per gather, which
        XLA:TPU's combiners merge across units (docs/benchmarks.md); whole, each costs
        ``size * (N - 1) / N`` more elements of memory per device and fewer bytes on the wire.
        ``0``: every leaf is sharded, as in FSDP2. Leaves split over model axes stay sharded.
        ``None`` (default): the platform's choice, filled in by ``fully_shard`` from the mesh's
        devices: ``4096`` on TPU (v4, v5e, v5p, v6e), ``0`` elsewhere ([Note: platform defaults]).
      weight_gradients: ``"reduced"``: a gathered leaf's gradient is formed whole on every device
        from its own rows and reduce-scattered, as in FSDP2. ``None`` (default): the platform's
        choice, as for ``replicate_below``: ``"from_activations+in_blocks"`` on TPU,
        ``"reduced"`` elsewhere.
        ``"from_activations"``: where the unit's matrix ``w`` (2-D, sharded without padding,
        freed after forward, no model axes, offload or custom collectives) is read by a matmul
        ``x @ w`` (in straight-line code or a loop over stacked layers), that matmul runs on the
        shard with the activations exchanged instead (all-to-alls and all-gathers of ``x``,
        ``dy`` and ``dx``, reduce-scatters of partial products), forward and backward, and forms
        this device's block of the gradient from them: neither the gathered ``w`` nor its whole
        gradient exists; fewer bytes and less memory where the global batch has fewer rows than
        ``w`` has inputs (GSPMD's choice at such batches; docs/benchmarks.md, "Weight gradients
        from gathered activations"). Under a ``remat_policy`` each recomputed layer (a stacked
        layer, an unrolled unit) is routed whole or not at all. A row lookup of such a table
        (``jnp.take(w, ids, axis=0)``: ``nnx.Embed``, ``nn.Embed``), in any unit, the root too, runs
        on the shard with the ids gathered and each token's columns exchanged, where that sends
        fewer elements (fewer tokens per device than rows): neither the gathered table nor its
        whole gradient exists (docs/benchmarks.md, "Embedding lookups on the shard"). Other uses
        keep the gather and the reduction.
        ``"in_blocks"``: the same matrices' matmuls keep the gather (forward, and again in
        backward for ``dx``) but form the weight gradient a block at a time along the matrix's
        unsharded dim (4 where they divide it), each block reduce-scattered before the next is
        formed: the whole gradient never exists, at the reduction's bytes and FLOPs
        (docs/benchmarks.md, "Weight gradients reduced a block at a time"). Not in a recomputed
        layer or segment (its matrices would be gathered three times). A matrix its unit keeps
        gathered through backward (the root's, ``reshard_after_forward=False``: a language
        model's output head) is gathered once and kept, its gradient formed in blocks, wherever
        its matmul runs, recomputed pieces too. A row lookup of a table sharded on its rows (an
        embedding, in any unit) is gathered for forward only and its gradient scatter-added a block
        of columns at a time. A kept matrix or a table that something else also reads gathered (a
        tied head) keeps the reduction: blocking it would gather it twice.
        ``"from_activations+in_blocks"``: both, each matmul and row lookup taking the first that
        applies: routed from activations where that sends less, its gradient in blocks otherwise
        (docs/planning.md: a Llama-3-8B on ``v5p-256``).

    Example:
      >>> import jshard as js
      >>> js.FullyShardPolicy(replicate_below=4096).replicate_below
      4096
      >>> js.FullyShardPolicy(weight_gradients="from_activations").weight_gradients
      'from_activations'
      >>> policy = js.FullyShardPolicy(reshard_after_forward=False)
      >>> hash(policy) == hash(js.FullyShardPolicy(reshard_after_forward=False))
      True
    """

    reshard_after_forward: bool | int | None = None
    shard_placement_fn: Callable[[Any, Any], int | None] | None = None
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy()
    offload_policy: OffloadPolicy = OffloadPolicy()
    ignored_params: Callable[[Any, Any], bool] | None = None
    dp_mesh_dims: DataParallelMeshDims | None = None
    scan_axis: int | None = None
    gradient_divide_factor: float | None = None
    force_sum_reduction_for_comms: bool = False
    custom_all_gather: AllGather | None = None
    custom_reduce_scatter: ReduceScatter | None = None
    all_reduce_hook: AllReduce | None = None
    unit_collectives: bool = False
    replicate_below: int | None = None
    weight_gradients: str | None = None

    def __post_init__(self):
        raf = self.reshard_after_forward
        if raf is not None and not isinstance(raf, (bool, int)):
            raise ValueError(f"`reshard_after_forward` must be a bool, an int or None, got {raf!r}.")
        if isinstance(raf, int) and not isinstance(raf, bool) and raf < 2:
            raise ValueError(
                f"`reshard_after_forward={raf}`: an int is the size of the device group that "
                "keeps a copy for backward and must be at least 2; use True or False instead."
            )
        self._check_types()
        if self.scan_axis not in (None, 0):
            raise ValueError(
                f"`scan_axis` must be 0 (layers stacked along axis 0) or None, got "
                f"{self.scan_axis!r}; move the layer axis to the front (jnp.moveaxis)."
            )
        below = self.replicate_below
        if below is not None and (isinstance(below, bool) or not isinstance(below, int) or below < 0):
            raise ValueError(
                f"`replicate_below` must be a non-negative int (a number of elements) or None, got {below!r}; "
                "0 shards every leaf."
            )
        if self.weight_gradients not in (None, *WEIGHT_GRADIENTS):
            raise ValueError(f"`weight_gradients` must be one of {WEIGHT_GRADIENTS} or None, "
                             f"got {self.weight_gradients!r}.")
        if self.weight_gradients is not None and self.gradient_routes and self.unit_collectives:
            raise ValueError(f"`weight_gradients={self.weight_gradients!r}` forms each matrix's gradient in its own "
                             "collectives; it cannot share the unit's flat buffer: set `unit_collectives=False`.")
        factor = self.gradient_divide_factor
        if factor is not None and (isinstance(factor, bool) or not factor > 0):
            raise ValueError(f"`gradient_divide_factor` must be a positive number, got {factor!r}.")

    @property
    def gradient_routes(self) -> frozenset[str]:
        """The ways of forming weight gradients ``weight_gradients`` names, besides FSDP2's reduction.

        Example:
          >>> import jshard as js
          >>> sorted(js.FullyShardPolicy(weight_gradients="from_activations+in_blocks").gradient_routes)
          ['from_activations', 'in_blocks']
        """
        if self.weight_gradients is None:
            raise ValueError("`weight_gradients=None` is the platform's choice, which `fully_shard` fills in from "
                             "the mesh: read `unit.meta.policy`, or name the route.")
        return frozenset(self.weight_gradients.split("+")) - {"reduced"}

    def resolved_reshard_after_forward(self, root: bool) -> bool | int:
        """``reshard_after_forward`` with ``None`` resolved: ``False`` for a root unit, ``True`` otherwise.

        Example:
          >>> import jshard as js
          >>> js.FullyShardPolicy().resolved_reshard_after_forward(root=True)
          False
        """
        raf = self.reshard_after_forward
        return (not root) if raf is None else raf

    def _check_types(self):
        expected = {
            "mp_policy": MixedPrecisionPolicy,
            "offload_policy": OffloadPolicy,
            "dp_mesh_dims": (DataParallelMeshDims, type(None)),
        }
        for name, kind in expected.items():
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise ValueError(f"`{name}` has the wrong type: {type(value).__name__}.")
        for name in ("shard_placement_fn", "ignored_params"):
            _check_callable(name, getattr(self, name))
        for name in ("custom_all_gather", "custom_reduce_scatter", "all_reduce_hook"):
            check_hook(name, getattr(self, name))
        for name in ("force_sum_reduction_for_comms", "unit_collectives"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be a bool, got {getattr(self, name)!r}.")
