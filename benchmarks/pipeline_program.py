"""The pipeline's compiled step against its analytic figures (docs/parallelism.md "Pipeline stages").

For (S, L) in (2, 5), (4, 7), M in (S, 2S), both schedules and both gather policies, compiles
(only) the step of a ``width``-wide residual MLP stack between two dense layers on 8 devices as
``(stage S, fsdp 8/S)`` and prints, per device: the schedule loops' trip counts (GPipe
``M+S-1``; 1F1B ``S-1``, ``M``, ``S-1``); ``ppermute`` bytes against ``2 (M+S-1)``
microbatches; the stack's all-gather and reduce-scatter bytes over ``fsdp`` against the
policy's figure (f32); all-reduce bytes; arguments against the analytic sum; temporaries;
matmul FLOPs per device against the one-device step's / 8 times ``(M+S-1)/M x S K/L`` (the
bubble and the identity layers). ``--memory``: temporaries and live peak of both schedules
against M (8 rows per microbatch, the batch growing with M), their slope per microbatch
against the analytic ``K A`` (``A``: a layer's saved ``h`` and ``h @ w``; its ``tanh`` is
recomputed, [Note: loop residuals]) and the rows'.

    python -m benchmarks.pipeline_program                 # 8 simulated CPU devices
    python -m benchmarks.pipeline_program --target tpu    # XLA:TPU, v5p 2x2x2, compile only
    python -m benchmarks.pipeline_program --memory [--target tpu]
"""

from __future__ import annotations

import argparse
import os

D_IN = D_OUT = 8  # the stack dominates the step


def _devices(target: str) -> list:
    import jax

    if target == "tpu":
        from jax.experimental import topologies

        return list(topologies.get_topology_desc(topology_name="v5p:2x2x2", platform="tpu").devices)
    return jax.devices()


def _layer(h, p):
    import jax.numpy as jnp

    return h + jnp.tanh(h @ p["w"] + p["b"])


def _one_device_flops(layers: int, width: int, batch: int) -> float:
    """Matmul FLOPs of the same step unsharded, on one device (compiled only)."""
    import jax
    import jax.numpy as jnp

    from jshard._report.flops import matmul_flops

    sds = jax.ShapeDtypeStruct
    params = {"w_in": sds((D_IN, width), jnp.float32), "w_out": sds((width, D_OUT), jnp.float32),
              "stack": {"w": sds((layers, width, width), jnp.float32), "b": sds((layers, width), jnp.float32)}}

    def loss_fn(p, b):
        h = jax.lax.scan(lambda h, layer: (_layer(h, layer), None), jnp.tanh(b["x"] @ p["w_in"]), p["stack"])[0]
        return jnp.mean((h @ p["w_out"] - b["y"]) ** 2)

    data = {"x": sds((batch, D_IN), jnp.float32), "y": sds((batch, D_OUT), jnp.float32)}
    return matmul_flops(jax.jit(jax.value_and_grad(loss_fn)).lower(params, data).compile().as_text())


def pipeline_step(devices, stages: int, layers: int, width: int, batch: int, policy):
    """The benchmark's pipelined step on ``devices`` as ``(stage, fsdp)``: ``(mesh, lowered, compiled)``. FSDP2's
    layout on every platform, the one the analytic figures describe ([Note: platform defaults])."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import jshard as js
    from jshard._sharding.platform_defaults import FSDP2_LAYOUT

    sds = jax.ShapeDtypeStruct
    mesh = Mesh(np.asarray(devices).reshape(stages, 8 // stages), ("stage", "fsdp"))
    stack = js.fully_shard(js.stage_layers({"w": sds((layers, width, width), jnp.float32),
                                            "b": sds((layers, width), jnp.float32)}, mesh), mesh,
                           js.FullyShardPolicy(scan_axis=0, dp_mesh_dims=js.DataParallelMeshDims(shard="fsdp"),
                                               **FSDP2_LAYOUT))
    params = js.fully_shard({"w_in": sds((D_IN, width), jnp.float32), "w_out": sds((width, D_OUT), jnp.float32),
                             "stack": stack}, mesh,
                            js.FullyShardPolicy(dp_mesh_dims=js.DataParallelMeshDims(shard=("stage", "fsdp")),
                                                **FSDP2_LAYOUT))

    def loss_fn(p, b):
        dense = js.unshard(p)
        h = jnp.tanh(b["x"] @ dense["w_in"])
        head = lambda h, y: jnp.mean((h @ dense["w_out"] - y) ** 2)  # noqa: E731
        if policy.schedule == "1f1b":  # the head and the loss run per microbatch inside the schedule
            return js.pipeline(_layer, h, p["stack"], policy=policy, loss=head, targets=b["y"])
        return head(js.pipeline(_layer, h, p["stack"], policy=policy), b["y"])

    data = {"x": sds((batch, D_IN), jnp.float32), "y": sds((batch, D_OUT), jnp.float32)}
    lowered = jax.jit(js.value_and_grad(loss_fn, unshard_params=False)).lower(params, data)
    return mesh, lowered, lowered.compile()


def _row(devices, stages: int, layers: int, m: int, gather: str, schedule: str, width: int, batch: int) -> str:
    import jshard as js
    from jshard._report.flops import matmul_flops
    from jshard._report.step_collectives import step_collectives

    policy = js.PipelinePolicy(microbatches=m, gather=gather, schedule=schedule)
    mesh, lowered, compiled = pipeline_step(devices, stages, layers, width, batch, policy)
    fsdp, per_stage, ticks = 8 // stages, -(-layers // stages), m + stages - 1
    found = step_collectives(compiled.as_text(), lowered.as_text(), dict(mesh.shape))
    permutes = [c for c in found if c.kind == "collective-permute"]
    stack = [c for c in found if c.axes == ("fsdp",)]
    sent = {kind: sum(c.wire_bytes_per_step for c in stack if c.kind == kind)
            for kind in ("all-gather", "reduce-scatter")}
    layer_bytes, share = (width * width + width) * 4, (fsdp - 1) / fsdp
    steps = ticks if gather == "per_microbatch" else 1
    gathered = steps * per_stage * layer_bytes * share  # the forward gathers (backward's re-gathers come on top)
    microbatch = batch // fsdp // m * width * 4
    args = (D_IN * width // 8 + width * D_OUT // 8 + stages * per_stage * (width * width + width) // 8
            + batch // 8 * (D_IN + D_OUT)) * 4
    memory = compiled.memory_analysis()
    work = matmul_flops(compiled.as_text()) / (_one_device_flops(layers, width, batch) / 8)
    trips = sorted({c.trip_count or 1 for c in permutes})  # a loop of one trip is unrolled: no counter
    return (f"S={stages} F={fsdp} L={layers} K={per_stage} M={m} {schedule:5s} {gather:14s} "
            f"trips={trips} ppermute={sum(c.wire_bytes_per_step for c in permutes):.0f}/{2 * ticks * microbatch} "
            f"all-gather={sent['all-gather'] / gathered:.3f} reduce-scatter={sent['reduce-scatter'] / gathered:.3f} "
            f"(x forward gathers) all-reduce={sum(c.wire_bytes_per_step for c in found if c.kind == 'all-reduce'):.0f} "
            f"args={memory.argument_size_in_bytes}/{args} temp={memory.temp_size_in_bytes / 2**20:.2f} MiB "
            f"flops={work:.3f}/{ticks / m * stages * per_stage / layers:.3f} (x one device's / 8)")


def _memory_over_m(devices, stages: int, layers: int, width: int, rows: int) -> list[str]:
    """Temporaries and XLA's live peak against M with ``rows`` rows per microbatch of a column
    (the batch grows with M), and their slope per microbatch from the first M to the last, against
    the analytic figures (``A``: one layer's saved activations of one microbatch, 3 ``(rows, width)``
    f32 arrays for this layer; XLA:CPU's peak does not follow the program, XLA:TPU's does)."""
    import jshard as js

    fsdp, per_stage = 8 // stages, -(-layers // stages)
    activation = rows * width * 4
    lines, ms = [], (stages, 2 * stages, 4 * stages, 8 * stages)
    for schedule in ("gpipe", "1f1b"):
        temp, peak = [], []
        for m in ms:
            policy = js.PipelinePolicy(microbatches=m, schedule=schedule)
            memory = pipeline_step(devices, stages, layers, width, fsdp * m * rows, policy)[2].memory_analysis()
            temp.append(memory.temp_size_in_bytes)
            peak.append(memory.peak_memory_in_bytes)

        def slope(values):
            return (values[-1] - values[0]) / (ms[-1] - ms[0]) / activation

        lines.append(f"S={stages} K={per_stage} {schedule:5s} M={ms} temp={[round(t / 2**20, 3) for t in temp]} MiB "
                     f"peak={[round(p / 2**20, 3) for p in peak]} MiB; per microbatch: temp {slope(temp):.2f}, "
                     f"peak {slope(peak):.2f} x (rows, width) f32 against K A = {2 * per_stage}, "
                     f"rows (2 + 2/S) = {2 + 2 / stages:.1f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=("cpu", "tpu"), default="cpu")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--memory", action="store_true", help="temporaries against M instead (width 256)")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if args.target == "cpu":
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    devices = _devices(args.target)
    if args.memory:
        for stages, layers in ((2, 7), (4, 7)):
            print("\n".join(_memory_over_m(devices, stages, layers, 256, 8)), flush=True)
        return
    for stages, layers in ((2, 5), (4, 7)):
        for m in (stages, 2 * stages):
            for schedule in ("gpipe", "1f1b"):
                for gather in ("per_microbatch", "once"):
                    print(_row(devices, stages, layers, m, gather, schedule, args.width, args.batch), flush=True)


if __name__ == "__main__":
    main()
