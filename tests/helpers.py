"""Shared test references: torch.chunk layout in NumPy, device coordinates, padding, NNX blocks, divisions,
the largest difference between two trees, the GSPMD recipe's recomputation."""

from __future__ import annotations

import collections
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jshard as js
from jshard.report import Memory, matmul_flops


def torch_chunks(x: np.ndarray, n: int, dim: int) -> list[np.ndarray]:
    """FSDP2's shards: ``torch.chunk`` into ``ceil(d/n)`` rows, zero-padded to n equal chunks."""
    d = x.shape[dim]
    c = math.ceil(d / n)
    chunks = []
    for i in range(n):
        part = np.take(x, np.arange(min(i * c, d), min((i + 1) * c, d)), axis=dim)
        widths = [(0, 0)] * x.ndim
        widths[dim] = (0, c - part.shape[dim])
        chunks.append(np.pad(part, widths))
    return chunks


def shard_index(mesh, device, shard_axes: tuple[str, ...]) -> int:
    """The device's linear index over the shard axes (row-major, in the given order)."""
    coords = dict(zip(mesh.axis_names, np.argwhere(mesh.devices == device)[0], strict=True))
    sizes = [mesh.shape[a] for a in shard_axes]
    return int(np.ravel_multi_index([coords[a] for a in shard_axes], sizes))


def assert_torch_layout(stored, original: np.ndarray, mesh, shard_axes: tuple[str, ...], dim: int) -> None:
    """Every addressable shard of ``stored`` holds exactly FSDP2's chunk for its device."""
    n = math.prod(mesh.shape[a] for a in shard_axes)
    chunks = torch_chunks(np.asarray(original), n, dim)
    seen = set()
    for shard in stored.addressable_shards:
        i = shard_index(mesh, shard.device, shard_axes)
        np.testing.assert_array_equal(np.asarray(shard.data), chunks[i])
        seen.add(i)
    assert seen == set(range(n))


def max_diff(a, b) -> float:
    """The largest absolute difference between the paired leaves of two trees (in ``a``'s dtypes).

    ``inf`` when either tree holds a NaN or an infinity: a NaN is close to nothing, and
    Python's ``max`` over per-leaf maxima would skip one unless it came first.
    """
    import jax

    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x = np.asarray(x)
        x, y = x.astype(np.float64), np.asarray(y).astype(x.dtype).astype(np.float64)
        if not (np.isfinite(x).all() and np.isfinite(y).all()):
            return math.inf
        worst = max(worst, float(np.max(np.abs(x - y), initial=0.0)))
    return worst


def padding_values(tree) -> np.ndarray:
    """Every padding element of every stored leaf of ``tree`` (units), concatenated, as float32.

    Empty when nothing is padded; all zeros when the layout holds (``[Note: layout]``).
    """
    import jax

    from jshard._sharding.unit import map_unit_leaves

    def values(meta, layout, x):
        if layout is None or not layout.padding:
            return np.zeros((0,), np.float32)
        rows = range(layout.shape[layout.dim], layout.padded)
        return np.take(np.asarray(x), rows, layout.dim).ravel().astype(np.float32)

    return np.concatenate(jax.tree.leaves(map_unit_leaves(values, tree)))


def assert_zero_padding(*trees) -> None:
    """The trees hold padding, and every padding element is zero (an empty check would prove nothing)."""
    values = np.concatenate([padding_values(tree) for tree in trees])
    assert values.size, "nothing is padded: this check needs a leaf that the shard axes do not divide"
    assert not values.any(), f"{np.count_nonzero(values)} non-zero padding elements"


def run_nnx_blocks(blocks, x, scan: bool):
    """NNX blocks as the NNX docs run them: ``nnx.scan`` over stacked blocks, or a Python loop."""
    from flax import nnx

    if scan:

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return block(x)

        return forward(x, blocks)
    for block in blocks:
        x = block(x)
    return x


def recipe_and_jshard_flops(mesh, policy, layers=4, width=256, batch=64):
    """Matmul FLOPs (and the steps' peaks) per device of a stacked tanh MLP's step: the GSPMD recipe with
    ``jax.checkpoint(layer, policy)`` in a ``lax.scan``, and jshard with ``remat_policy=policy``."""
    sds = jax.ShapeDtypeStruct
    params = {"w": sds((layers, width, width), jnp.float32), "b": sds((layers, width), jnp.float32)}
    x = sds((batch, width), jnp.float32)

    def layer(h, w):
        return jnp.tanh(h @ w["w"] + w["b"]), None

    shardings = jax.tree.map(lambda _: NamedSharding(mesh, P(None, "fsdp")), params)
    recipe_loss = lambda p, x: jnp.mean(jax.lax.scan(jax.checkpoint(layer, policy=policy), x, p)[0] ** 2)  # noqa: E731
    recipe = jax.jit(jax.value_and_grad(recipe_loss), in_shardings=(shardings, NamedSharding(mesh, P("fsdp"))),
                     out_shardings=(NamedSharding(mesh, P()), shardings))
    units = js.fully_shard({"stack": js.fully_shard(params, mesh, js.FullyShardPolicy(scan_axis=0))}, mesh)
    ours = jax.jit(js.value_and_grad(lambda p, x: jnp.mean(js.scan(layer, x, p["stack"])[0] ** 2),
                                     unshard_params=False, remat_policy=policy))
    compiled = {"recipe": recipe.lower(params, x).compile(), "jshard": ours.lower(units, x).compile()}
    return {k: matmul_flops(c.as_text()) for k, c in compiled.items()} | {
        f"{k} peak": Memory.from_compiled(c).peak for k, c in compiled.items()}


_CONSTANT = re.compile(r"(%[\w#]+) = stablehlo\.constant dense<([-+.\deE]+)> : tensor<\w*>")
_BROADCAST = re.compile(r"(%[\w#]+) = stablehlo\.broadcast_in_dim (%[\w#]+),")
_DIVIDE = re.compile(r"stablehlo\.divide %[\w#]+, (%[\w#]+)")


def collective_dtypes(stablehlo_text: str) -> dict[str, set[str]]:
    """The result dtypes of each kind of collective in a lowered program (the dtypes the step asked for)."""
    from jshard._report.hlo import lowered_collectives

    found: dict[str, set[str]] = collections.defaultdict(set)
    for kind, dtype in lowered_collectives(stablehlo_text):
        found[kind].add(dtype)
    return dict(found)


def constant_divisors(stablehlo_text: str) -> collections.Counter:
    """How many times a lowered program divides by each scalar constant (broadcast or not)."""
    values: dict[str, float] = {}
    found: collections.Counter = collections.Counter()
    for line in stablehlo_text.splitlines():
        if m := _CONSTANT.search(line):
            values[m.group(1)] = float(m.group(2))
        elif m := _BROADCAST.search(line):
            if m.group(2) in values:
                values[m.group(1)] = values[m.group(2)]
        elif (m := _DIVIDE.search(line)) and m.group(1) in values:
            found[values[m.group(1)]] += 1
    return found


def docs_example_output(page: str, marker: str, capsys, *, after: str | None = None) -> list[str]:
    """Run the Python block after ``<!-- marker -->`` on ``page`` as users run it and return
    the lines it printed (optax's Adam needs JAX's default dtype promotion); ``after``: the
    marker of a block run first, in the same namespace (the block continues that one)."""
    import pathlib

    text = (pathlib.Path(__file__).parents[1] / page).read_text()
    namespace = {"__name__": f"docs_{marker}"}
    with jax.numpy_dtype_promotion("standard"):
        for name in ([after] if after else []) + [marker]:
            code = re.search(rf"<!-- {name} -->\s*```python\n(.*?)```", text, re.S).group(1)
            exec(compile(code, page, "exec"), namespace)
    return capsys.readouterr().out.split("\n")


def train_sgd(loss_fn, params, grad_fn, batches):
    """SGD with momentum (0.1, 0.9) on ``loss_fn`` through ``grad_fn(loss_fn)`` over ``batches``:
    the losses, the parameters, and the lowered step's text (the weight-gradient routes' parity tests)."""
    tx = optax.sgd(0.1, momentum=0.9)

    @jax.jit
    def step(p, s, batch):
        loss, grads = grad_fn(loss_fn)(p, batch)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    state, losses = tx.init(params), []
    for batch in batches:
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    return losses, params, jax.jit(grad_fn(loss_fn)).lower(params, batches[0]).as_text()


def train_nnx_sgd(model, grad_fn, loss_fn, batches):
    """:func:`train_sgd` for an NNX ``model`` (``nnx.Optimizer`` over its Params): the losses, the
    trained model, and the lowered step's text."""
    optimizer = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    @jax.jit
    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = grad_fn(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss, nnx.state((model, optimizer))

    losses = []
    for batch in batches:
        loss, state = step(state, batch)
        losses.append(float(loss))
    model, _ = nnx.merge(graphdef, state)
    return losses, model, step.lower(state, batches[0]).as_text()


def head_loss(params, x):
    """A language model's end: a unit's ``tanh`` layer, then the root's head (kept gathered) and a
    logsumexp over its outputs; ``params``: ``{"l0": unit {"w"}, "head": {"w"}}``."""
    root = js.unshard(params)
    h = jnp.tanh(x @ js.unshard(root["l0"])["w"])
    return jnp.mean(jax.nn.logsumexp(h @ root["head"]["w"], axis=-1))


def head_params(mesh, policy, width, outputs):
    """Abstract float32 parameters for :func:`head_loss`, sharded by ``policy``: a ``[width, width]``
    unit and a ``[width, outputs]`` head in the root."""
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    return js.fully_shard({"l0": js.fully_shard({"w": sds(width, width)}, mesh, policy),
                           "head": {"w": sds(width, outputs)}}, mesh, policy)
