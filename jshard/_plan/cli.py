"""``python -m jshard.report``: plan a step, search its out-of-memory frontier, scale it over N, or rank
pipeline stages over FSDP x TP (estimated)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from jshard._plan.compiler import CompileTarget
from jshard._plan.failure import hand_to_parent, traceback_text
from jshard._plan.frontier import frontier, frontier_to_dict
from jshard._plan.hardware import HARDWARE, HardwareProfile, parse_bytes, profile
from jshard._plan.init_plan import plan_init
from jshard._plan.planner import plan
from jshard._plan.scaling import scaling
from jshard._plan.stage_plan import rank_stages
from jshard._plan.target import REMATS, PlanConfig, load_build
from jshard._sharding.policies import WEIGHT_GRADIENTS

DEMO = "jshard.demo.plan:build_{size}"
_SIZES = ("tiny", "small", "medium", "1b")
_CHOICE = {"both": (True, False), "true": (True,), "false": (False,)}
_ROUTES = {"default": (None,), "both": ("reduced", "from_activations"), "all": WEIGHT_GRADIENTS,
           **{route: (route,) for route in WEIGHT_GRADIENTS}}


def _ints(text: str, least: int = 1) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        values = []
    if not values or min(values) < least:
        kind = "positive" if least == 1 else "non-negative"
        raise argparse.ArgumentTypeError(f"expected {kind} integers separated by commas, got {text!r}")
    return values


def _counts(text: str) -> list[int]:
    return _ints(text, least=0)


def _target(args: argparse.Namespace) -> str:
    if args.target and args.size:
        raise SystemExit("Give a plan target or --size (the demo's model), not both.")
    return args.target or DEMO.format(size=args.size or "1b")


def _mesh_flags(parser: argparse.ArgumentParser, devices_type=int, default=64) -> None:
    parser.add_argument("target", nargs="?", help="the builder, pkg.module:build (default: the demo's 1b model)")
    parser.add_argument("--size", choices=_SIZES, help="plan the demo's transformer of this size instead")
    parser.add_argument("--devices", type=devices_type, default=default)
    parser.add_argument("--target", dest="compile_target", metavar="COMPILER",
                        help="cpu:N (simulated devices, the default) or a TPU topology, e.g. tpu:v5p-256, "
                             "tpu:v6e:4x4 (XLA:TPU, compile only; needs jshard[tpu])")
    parser.add_argument("--slices", type=int, default=1, help="slices of the TPU topology (default 1)")
    parser.add_argument("--replicate", type=int, default=1, help="HSDP replicas (default 1)")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="size of a 'tp' mesh axis (default 1)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--traceback", action="store_true", help="after an error, print where it was raised")


def _config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-per-device", type=int, default=1)
    parser.add_argument("--no-reshard-after-forward", action="store_true")
    parser.add_argument("--remat", choices=REMATS, default="default")
    parser.add_argument("--mixed-precision", action="store_true", help="bf16 params and all-gather, fp32 reduce")
    parser.add_argument("--offload", action="store_true", help="state in pinned host memory")
    parser.add_argument("--replicate-below", type=int, default=None, metavar="N",
                        help="keep leaves under N elements whole on every device (0: shard every leaf; default: "
                             "the target's choice, 4096 on TPU, else 0)")
    parser.add_argument("--weight-gradients", choices=WEIGHT_GRADIENTS, default=None,
                        help="reduced (FSDP2's), from_activations (matmuls of a unit's matrix on the shard, "
                             "activations exchanged, where that sends less), in_blocks (its gradient formed and "
                             "reduce-scattered a block at a time) or both (the first, else the second); default: "
                             "the target's choice, from_activations+in_blocks on TPU, else reduced")
    parser.add_argument("--config", help=argparse.SUPPRESS)  # a PlanConfig as JSON (planning subprocesses)


def _config(args: argparse.Namespace) -> PlanConfig:
    if args.config:
        return PlanConfig(**json.loads(args.config))
    return PlanConfig(args.batch_per_device, not args.no_reshard_after_forward, args.remat, args.mixed_precision,
                      args.offload, args.replicate_below, args.weight_gradients)


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m jshard.report``."""
    top = argparse.ArgumentParser(prog="python -m jshard.report",
                                  description="Plan a training step on a mesh of any size, compile only.")
    sub = top.add_subparsers(dest="command", required=True)
    one = sub.add_parser("plan", help="per-device memory and collectives of one configuration")
    _mesh_flags(one, default=None)
    _config_flags(one)
    one.add_argument("--init", action="store_true",
                     help="plan the builder's init program (it returns (init, args)): per-device peak against "
                          "the model's 1/N share")
    search = sub.add_parser("frontier", help="the configurations that fit a memory budget, ranked")
    _mesh_flags(search, default=None)
    search.add_argument("--hbm", required=True, help="per-device budget, e.g. 80GiB")
    search.add_argument("--hardware", choices=sorted(HARDWARE), default="h100")
    search.add_argument("--batches", type=_ints, default=[1, 2, 4, 8, 16], help="batches per device to try")
    search.add_argument("--remats", default=",".join(REMATS), help=f"remat policies to try, of {REMATS}")
    search.add_argument("--reshard-after-forward", choices=sorted(_CHOICE), default="both")
    search.add_argument("--mixed-precision", choices=sorted(_CHOICE), default="both")
    search.add_argument("--offload", choices=sorted(_CHOICE), default="false")
    search.add_argument("--replicate-below", type=_counts, default=[None], metavar="N[,N...]",
                        help="replicate_below values to try, e.g. 0,4096 (default: the target's choice)")
    search.add_argument("--weight-gradients", choices=sorted(_ROUTES), default="default",
                        help="default (the target's choice), reduced, from_activations, in_blocks, "
                             "from_activations+in_blocks, both (reduced and from_activations) or all four, each a "
                             "setting of its own")
    search.add_argument("--full", action="store_true",
                        help="compile the whole grid (default: a first answer, pruned from what was compiled)")
    search.add_argument("--hardware-json", help=argparse.SUPPRESS)
    search.add_argument("--grid", help=argparse.SUPPRESS)
    scale = sub.add_parser("scaling", help="per-device memory for several mesh sizes, with a PNG plot")
    _mesh_flags(scale, _ints, [8, 16, 32, 64, 128, 256, 512, 1024])
    _config_flags(scale)
    scale.add_argument("--png", help="write the plot here")
    stages = sub.add_parser("stages", help="(stage, fsdp, tp) against (fsdp, tp), estimated from the model's shape")
    stages.add_argument("target", help="a function returning a jshard.report.StackModel, e.g. "
                                       "jshard.demo.llama3:stack_70b")
    stages.add_argument("--devices", type=int, required=True)
    stages.add_argument("--global-batch", type=int, required=True, help="sequences a step")
    stages.add_argument("--hardware", choices=sorted(HARDWARE), default="h100")
    stages.add_argument("--link", help="per-device link bandwidth instead of the profile's, e.g. 50GB "
                                       "(the profile's is within a node; across nodes it is lower)")
    stages.add_argument("--top", type=int, default=10, help="print this many (default 10)")
    stages.add_argument("--json", action="store_true", help="print JSON instead of the table")
    stages.add_argument("--traceback", action="store_true", help=argparse.SUPPRESS)
    return top


def _stages(args: argparse.Namespace) -> str:
    model = load_build(args.target)()
    hardware = profile(args.hardware)
    if args.link:
        hardware = dataclasses.replace(hardware, link_bandwidth=parse_bytes(args.link))
    plans = rank_stages(model, args.devices, args.global_batch, hardware)
    if not plans:
        raise ValueError(f"No (stage, fsdp, tp) of {args.devices} devices divides the global batch of "
                         f"{args.global_batch} sequences; make it a multiple of the devices.")
    if args.json:
        return json.dumps([dict(vars(p), bubble=p.bubble) for p in plans[: args.top]])
    best_alone = next(p for p in plans if p.stages == 1)
    head = (f"{model.name} on {args.devices} devices ({args.hardware}, links {hardware.link_bandwidth / 1e9:g} GB/s), "
            f"{args.global_batch} sequences of {model.seq_len}: ESTIMATED from the shape, not compiled")
    return "\n".join([head, *(p.describe() for p in plans[: args.top]),
                      f"best without stages: {best_alone.describe()}"])


def _frontier(args: argparse.Namespace):
    hardware = HardwareProfile(**json.loads(args.hardware_json)) if args.hardware_json else profile(args.hardware)
    if args.grid:
        grid = json.loads(args.grid)
    else:
        remats = tuple(r for r in args.remats.split(",") if r)
        bad = [r for r in remats if r not in REMATS]
        if bad or not remats:
            raise SystemExit(f"--remats takes policies of {REMATS} separated by commas, got {args.remats!r}.")
        grid = {"batches": args.batches, "reshard_after_forward": _CHOICE[args.reshard_after_forward],
                "remats": remats, "mixed_precision": _CHOICE[args.mixed_precision], "offload": _CHOICE[args.offload],
                "replicate_below": args.replicate_below, "weight_gradients": _ROUTES[args.weight_gradients],
                "full": args.full}
    return frontier(_target(args), devices=args.devices, budget=parse_bytes(args.hbm), hardware=hardware,
                    replicate=args.replicate, tensor_parallel=args.tensor_parallel, target=_compiler(args), **grid)


def _compiler(args: argparse.Namespace) -> CompileTarget | None:
    if args.compile_target is None:
        if args.slices != 1:
            raise ValueError("--slices needs a TPU --target (e.g. --target tpu:v5p-256 --slices 2).")
        return None
    return CompileTarget.parse(args.compile_target, args.slices)


def main(argv: list[str] | None = None) -> None:
    """Run the command line (see ``python -m jshard.report --help``).

    Example:
      >>> from jshard.report import main
      >>> main(["plan", "jshard.demo.plan:build_1b", "--devices", "64"])  # doctest: +SKIP
      plan of jshard.demo.plan:build_1b (batch 1/device, raf, remat default, fp32, on device), ...
    """
    args = parser().parse_args(argv)
    try:
        if args.command == "plan" and args.init:
            result = plan_init(_target(args), devices=args.devices, replicate=args.replicate,
                               tensor_parallel=args.tensor_parallel, config=_config(args), target=_compiler(args))
            print(json.dumps(result.to_dict()) if args.json else result)
        elif args.command == "plan":
            result = plan(_target(args), devices=args.devices, replicate=args.replicate,
                          tensor_parallel=args.tensor_parallel, config=_config(args), target=_compiler(args))
            print(json.dumps(result.to_dict()) if args.json else result)
        elif args.command == "stages":
            print(_stages(args))
        elif args.command == "frontier":
            result = _frontier(args)
            print(json.dumps(frontier_to_dict(result)) if args.json else result)
        else:
            result = scaling(_target(args), args.devices, replicate=args.replicate,
                             tensor_parallel=args.tensor_parallel, config=_config(args), target=_compiler(args))
            if args.png:
                result.plot(args.png)
            print(json.dumps({"plans": [p.to_dict() for p in result.plans], "sharded": result.sharded,
                              "constant": result.constant}) if args.json else result)
    except ValueError as err:  # the target's or the options' fault: one line ([Note: planning errors])
        print(f"python -m jshard.report {args.command}: {err}", file=sys.stderr)
        if args.traceback:
            print(traceback_text(err), file=sys.stderr, end="")
        hand_to_parent(err)
        raise SystemExit(2) from err


