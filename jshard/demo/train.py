"""The first thing to run: a character-level transformer trained fully sharded.

``python -m jshard.demo`` trains a small Flax transformer language model on the text
that ships with jshard (``jshard/demo/data/*.txt``), sharded over every device (8 simulated
CPU devices when there is no accelerator), for a minute or two. It shows a progress
bar (loss, tokens/s), then the per-device memory of the jshard step beside a
replicated data-parallel step of the same model (from ``memory_analysis()`` of both
compiled steps) as a table and a PNG, and finally text sampled from the model.

Flags: ``--steps``, ``--size tiny|small|medium``, ``--mixed-precision`` (bf16
parameters for compute and gathers, fp32 gradient reduction), ``--offload`` (sharded
state in host memory, ``CPUOffloadPolicy``), ``--tensor-parallel T`` (a 2-D mesh: each block
split Megatron-style over ``T`` devices, FSDP over the rest), ``--float8-gather`` (parameters
gathered in float8 e4m3 with per-row scales), ``--out-dir`` (the folder for what it writes, printed
at the end: ``memory.png``; default ``./jshard-demo-out``), ``--experts E`` (instead, the small
Mixtral-style mixture of experts of :mod:`jshard.demo.moe` with ``E`` experts, split over an
``expert`` mesh axis, printing its losses). Off a terminal (a log file, CI) the
progress bar becomes a line every tenth of the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import pathlib
import time
from importlib import resources
from typing import Any

DEFAULT_STEPS = {"tiny": 60, "small": 300, "medium": 150}


def simulate_cpu_devices(n: int = 8) -> bool:
    """Ask JAX for ``n`` simulated CPU devices, unless the user chose a count or it is too late.

    Only the CPU backend reads the setting, so it is harmless on a machine with an
    accelerator. Returns whether it was set.

    Example:
      >>> from jshard.demo import simulate_cpu_devices
      >>> simulate_cpu_devices()  # the tests' backend is already running with 8 devices
      False
    """
    import jax

    chosen = "JAX_NUM_CPU_DEVICES" in os.environ or "xla_force_host_platform_device_count" in os.environ.get(
        "XLA_FLAGS", ""
    )
    try:
        from jax._src import xla_bridge

        started = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # a JAX without this private helper: try, and accept a refusal
        started = False
    if chosen or started or getattr(jax.config, "jax_num_cpu_devices", -1) > 0:
        return False
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except Exception:  # the backend started already
        return False
    return True


def load_text() -> str:
    """The text that ships with jshard (every ``jshard/demo/data/*.txt``, concatenated).

    Example:
      >>> from jshard.demo import load_text
      >>> len(load_text()) > 50_000
      True
    """
    files = sorted(f for f in resources.files("jshard.demo").joinpath("data").iterdir() if f.name.endswith(".txt"))
    return "\n".join(f.read_text(encoding="utf-8") for f in files)


@dataclasses.dataclass(frozen=True)
class Vocab:
    """Characters of the text, one id each.

    Example:
      >>> from jshard.demo import Vocab
      >>> vocab = Vocab.of("hello")
      >>> vocab.decode(vocab.encode("hole"))
      'hole'
    """

    chars: str

    @classmethod
    def of(cls, text: str) -> Vocab:
        return cls("".join(sorted(set(text))))

    def encode(self, text: str) -> list[int]:
        index = {c: i for i, c in enumerate(self.chars)}
        return [index[c] for c in text]

    def decode(self, ids: Any) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def _policies(args: argparse.Namespace) -> tuple[Any, Any]:
    import jax.numpy as jnp

    import jshard as js

    mp = js.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32) if args.mixed_precision else None
    return mp, (js.CPUOffloadPolicy() if args.offload else None)


def _optimizer(args: argparse.Namespace) -> Any:
    import optax

    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr, weight_decay=0.01))


def _replicated_memory(config: Any, optimizer: Any, mesh: Any, tokens: Any) -> Any:
    """Memory of the same step with every device holding everything (compiled, never run)."""
    import jax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from jshard.demo import model as T
    from jshard.report import Memory

    # Plain jit over an Auto-axes mesh of the same devices: the replicated data-parallel step.
    mesh = jax.make_mesh((mesh.size,), ("fsdp",), devices=mesh.devices.flat, axis_types=(AxisType.Auto,))
    replicated = NamedSharding(mesh, PartitionSpec())
    tokens = jax.ShapeDtypeStruct(tokens.shape, tokens.dtype, sharding=NamedSharding(mesh, PartitionSpec("fsdp")))

    def place(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)

    params = jax.tree.map(place, T.abstract_params(config))
    opt_state = jax.tree.map(place, jax.eval_shape(optimizer.init, params))
    lowered = jax.jit(T.plain_train_step(config, optimizer)).lower(params, opt_state, tokens)
    return Memory.from_compiled(lowered.compile())


def _memory_table(replicated: Any, sharded: Any, devices: int, tensor_parallel: int = 1) -> str:
    """Per-device MiB of both compiled steps, side by side."""
    rows = [("arguments (params, optimizer state, batch)", "argument"), ("temporaries", "temp"),
            ("outputs", "output"), ("peak (arguments + outputs + temporaries)", "peak")]
    lines = [f"per-device memory over {devices} devices (MiB, memory_analysis of the compiled steps)",
             f"  {'':<44}{'replicated':>12}{'jshard':>12}{'ratio':>8}"]
    for label, name in rows:
        a, b = getattr(replicated, name), getattr(sharded, name)
        lines.append(f"  {label:<44}{a / 2**20:12.3f}{b / 2**20:12.3f}{(b / a if a else 0):8.2f}")
    if sharded.host_argument:
        lines.append(f"  {'jshard state in host memory (offload)':<44}{'':>12}{sharded.host_argument / 2**20:12.3f}")
    tp = "" if tensor_parallel <= 1 else f"; embeddings and head, not split over tp, 1/{devices // tensor_parallel}"
    notes = _TABLE_NOTES.format(n=devices, tp=tp)
    return "\n".join(lines + [f"  {line}" for line in notes.splitlines()])


_TABLE_NOTES = """\
arguments: what the step is given; jshard keeps 1/{n} of the parameters and optimizer state per
  device (plus the padding of uneven dims{tp}), replicated keeps all of it on every device.
temporaries: what the step allocates while it runs. Both hold activations; jshard also holds the
  gathered parameters of the unit being computed (the root unit, embeddings and head, stays
  gathered), that unit's full gradient before its reduce-scatter, and the collectives' buffers,
  none of which replicated training needs: so jshard's are larger while its peak is smaller.
outputs: the updated parameters and optimizer state, as large as the arguments.
peak: all of it at once (at most): the figure that decides whether a model fits."""


NO_MATPLOTLIB = "memory plot skipped: matplotlib is not installed (pip install 'jshard[demo]' installs it)"


def _plot_memory(replicated: Any, sharded: Any, devices: int, path: pathlib.Path) -> pathlib.Path | None:
    """A bar chart of :func:`memory_table`, written to ``path``; ``None`` without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["argument", "temp", "output", "peak"]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(7, 4))
    for offset, (label, memory, color) in enumerate(
        (("replicated data parallel", replicated, "tab:gray"), ("jshard (FSDP)", sharded, "tab:orange"))
    ):
        values = [getattr(memory, n) / 2**20 for n in names]
        ax.bar([i + 0.4 * offset - 0.2 for i in x], values, width=0.4, label=label, color=color)
    ax.set_xticks(list(x), ["arguments\n(params, opt state, batch)", "temporaries", "outputs", "peak"])
    ax.set_ylabel("MiB per device")
    ax.set_title(f"Per-device memory of one training step, {devices} devices")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _sample(params: Any, config: Any, vocab: Vocab, prompt: list[int], length: int, seed: int = 0) -> str:
    """``length`` characters sampled (temperature 0.8) after ``prompt`` (``seq_len`` ids)."""
    import jax
    import jax.numpy as jnp

    from jshard.demo import model as T

    @jax.jit
    def next_id(params, window, key):
        logits = T.logits_fn(params, window[None], config, T.lax_scan_blocks)[0, -1, : len(vocab.chars)]
        logits = logits.astype(jnp.float32)
        return jax.random.categorical(key, logits / 0.8)

    import numpy as np

    params = jax.device_put(jax.tree.map(np.asarray, params), jax.devices()[0])
    window = jnp.asarray(prompt[-config.seq_len :], jnp.int32)
    out = []
    for key in jax.random.split(jax.random.key(seed), length):
        token = next_id(params, window, key)
        out.append(int(token))
        window = jnp.concatenate([window[1:], token[None].astype(jnp.int32)])
    return vocab.decode(out)


class _Progress:
    """A tqdm bar on a terminal; elsewhere (logs, CI) a plain line every tenth of the run."""

    def __init__(self, steps: int):
        import sys

        self.steps, self.every = steps, max(1, steps // 10)
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:  # a plain line every tenth of the run instead (pip install 'jshard[demo]')
                return
            self.bar = tqdm(total=steps, desc="training", unit="step", dynamic_ncols=True)

    def update(self, i: int, loss: float, rate: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", tokens_per_s=f"{rate:,.0f}")
        elif (i + 1) % self.every == 0 or i + 1 == self.steps:
            print(f"training: step {i + 1}/{self.steps}, loss {loss:.3f}, {rate:,.0f} tokens/s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _batches(ids: Any, batch: int, seq_len: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(ids) - seq_len - 1, size=batch)
        yield np.stack([ids[s : s + seq_len + 1] for s in starts])


def _train(args: argparse.Namespace) -> dict[str, Any]:
    """Train, report memory, plot, sample; returns what it printed, as data."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    import jshard as js
    from jshard.demo import model as T
    from jshard.report import Memory

    text = load_text()
    vocab = Vocab.of(text)
    ids = np.asarray(vocab.encode(text), np.int32)
    config = dataclasses.replace(T.SIZES[args.size], vocab=8 * math.ceil(len(vocab.chars) / 8))
    mesh = _mesh(args.tensor_parallel)
    devices = mesh.size
    batch = args.batch or max(16, devices)
    batch = devices * math.ceil(batch / devices)
    mp, offload = _policies(args)
    tx = _optimizer(args)
    optimizer = js.shard_optimizer(tx)  # Optax on the sharded (and, with --offload, host-resident) state
    full = jax.jit(functools.partial(T.init_params, config))(jax.random.key(args.seed))
    if args.tensor_parallel > 1:
        full = T.place_tensor_parallel(full, mesh)
    params = T.shard_lm(full, mesh, mp, offload, js.float8_all_gather if args.float8_gather else None)
    opt_state = optimizer.init(params)
    data_sharding = NamedSharding(mesh, PartitionSpec("fsdp"))  # over "tp" the batch is replicated
    batches = _batches(ids, batch, config.seq_len, args.seed)
    first = jax.device_put(next(batches), data_sharding)
    step = jax.jit(T.jshard_train_step(config, optimizer)).lower(params, opt_state, first).compile()
    sharded_memory = Memory.from_compiled(step)
    replicated_memory = _replicated_memory(config, tx, mesh, first)

    print(f"jshard demo: {T.count_params(params) / 1e6:.2f}M-parameter transformer ({args.size}), "
          f"{len(text):,} characters of text, {devices} {jax.devices()[0].platform.upper()} devices, "
          f"batch {batch} x {config.seq_len} characters"
          + (", bf16 params / fp32 reduce" if args.mixed_precision else "") + (", CPU offload" if args.offload else "")
          + (", float8 all-gathers" if args.float8_gather else "")
          + (f", mesh {dict(mesh.shape)} (FSDP x tensor parallel)" if args.tensor_parallel > 1 else ""))
    steps = args.steps or DEFAULT_STEPS[args.size]
    losses, tokens = [], first
    start = time.perf_counter()
    progress = _Progress(steps)
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, tokens)
        tokens = jax.device_put(next(batches), data_sharding)
        losses.append(float(loss))
        rate = (i + 1) * batch * config.seq_len / (time.perf_counter() - start)
        progress.update(i, losses[-1], rate)
    progress.close()
    print(f"loss: {losses[0]:.4f} at step 1 -> {losses[-1]:.4f} at step {steps} "
          f"({rate:,.0f} tokens/s over {time.perf_counter() - start:.1f} s)")
    print(_memory_table(replicated_memory, sharded_memory, devices, args.tensor_parallel))
    out_dir = pathlib.Path(args.out_dir)
    path = _plot_memory(replicated_memory, sharded_memory, devices, out_dir / "memory.png")
    print(NO_MATPLOTLIB if path is None else f"outputs in {out_dir.resolve()}: memory plot {path.name}")
    end = max(text.find("Shall I compare thee"), config.seq_len)  # the sample goes on from sonnet 18's first words
    prompt = ids[end - config.seq_len : end + len("Shall I")].tolist()
    text_out = _sample(js.unshard(params), config, vocab, prompt, args.sample_chars, args.seed)
    print(f"sample (after {vocab.decode(prompt[-40:])!r}):\n{vocab.decode(prompt[-7:])}{text_out}")
    plot = None if path is None else str(path)
    return {"losses": losses, "replicated": replicated_memory, "jshard": sharded_memory, "plot": plot,
            "sample": text_out}


def _mesh(tensor_parallel: int) -> Any:
    """All devices: FSDP over ``"fsdp"``, or with ``tensor_parallel > 1`` a 2-D ``("fsdp", "tp")`` mesh."""
    import jax

    import jshard as js
    from jshard._sharding.mesh import tensor_parallel_mesh

    if tensor_parallel <= 1:
        return js.make_mesh()
    n = len(jax.devices())
    if n % tensor_parallel:
        raise SystemExit(f"--tensor-parallel {tensor_parallel} does not divide the {n} devices; pick a divisor of {n}.")
    return tensor_parallel_mesh(tensor_parallel)


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jshard.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help=f"training steps (default per size: {DEFAULT_STEPS})")
    parser.add_argument("--size", choices=sorted(DEFAULT_STEPS), default="small")
    parser.add_argument("--mixed-precision", action="store_true", help="bf16 params and gathers, fp32 reduction")
    parser.add_argument("--offload", action="store_true", help="sharded state in host memory (CPUOffloadPolicy)")
    parser.add_argument("--float8-gather", action="store_true",
                        help="gather parameters in float8 (e4m3, per-row scales: js.float8_all_gather)")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="T",
                        help="split each block Megatron-style over T devices too (a 2-D fsdp x tp mesh)")
    parser.add_argument("--experts", type=int, default=0, metavar="E",
                        help="train the small Mixtral-style MoE with E experts instead (jshard.demo.moe)")
    parser.add_argument("--out-dir", default="jshard-demo-out", help="folder for the demo's outputs (the memory plot)")
    parser.add_argument("--batch", type=int, default=None, help="global batch in sequences")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--sample-chars", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """``python -m jshard.demo [flags]``: train, report memory, plot, sample; returns the figures.

    Example:
      >>> from jshard.demo import main
      >>> result = main(["--steps", "3", "--size", "tiny"])  # doctest: +SKIP
      >>> result["losses"][-1] < result["losses"][0]  # doctest: +SKIP
      True
    """
    args = _parse_args(argv)
    simulate_cpu_devices(8)
    if args.experts:
        import numpy as np

        from jshard.demo.moe_train import train_demo

        text = load_text()
        vocab = Vocab.of(text)
        ids = np.asarray(vocab.encode(text), np.int32)
        losses = train_demo(args.experts, args.steps or DEFAULT_STEPS["tiny"], len(vocab.chars),
                            lambda batch, seq_len: _batches(ids, batch, seq_len, args.seed),
                            lr=args.lr, seed=args.seed, batch=args.batch)
        return {"losses": losses}
    return _train(args)
