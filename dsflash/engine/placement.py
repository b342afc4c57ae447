"""The placement flags every command that loads the model takes (`serve`, `box`, `generate`, `plan`): where
Engram and the routed experts live, how much memory the GPUs and the host have, the context and sessions
to hold, and the plan (engine/plan.py) they make, printed at start and checked before any tensor is read."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dsflash.checkpoint.reader import Checkpoint
from dsflash.config import ModelArgs, load_config
from dsflash.engine.plan import PlacementError, Plan, Request, half_layers, layer_ranges, parse_size, plan
from dsflash.model.tiers import ENGRAM_CACHE, TIERS, Tiers

MEMINFO = Path("/proc/meminfo")


def size_arg(text: str) -> int:
    """argparse's type for a size flag (plan.parse_size: 140GiB, 256KiB, a byte count)."""
    try:
        return parse_size(text)
    except PlacementError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def gpus_arg(text: str) -> int | tuple[int, ...]:
    """argparse's type for --gpus: a count N (the N GPUs from the command's device on), or a list of GPU ids
    ("0,1,2"; "3," for one; "0" alone is GPU 0, a count of none being no request). A GPU may be listed twice
    (`0,0`: two ranks on one GPU)."""
    parts = [p for p in text.split(",") if p.strip()] if "," in text else [text]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a GPU count (2) or a list of GPU ids (0,1,2)")
    return tuple(values) if "," in text or values == [0] else values[0]


def add_layout_options(g: argparse._ActionsContainer, ranks: bool = True) -> None:
    """--gpus and --pp (layer ranges), and with `ranks` --tp/--ep (processes this command starts)."""
    g.add_argument("--gpus", type=gpus_arg, metavar="N|LIST",
                   help="the GPUs: a count (the first N from --device's) or ids, e.g. 0,1,2 (default: one a rank)")
    g.add_argument("--pp", type=int, default=1, metavar="N", help="layer ranges (pipeline stages) over the GPUs")
    if not ranks:
        g.set_defaults(tp=1, ep=1)
        return
    g.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallelism: N ranks share the column-parallel linears and the head, one process "
                   "each, started by this command (docs/parallel.md)")
    g.add_argument("--ep", type=int, default=1, metavar="N", help="expert parallelism: N ranks share the routed "
                   "experts by id, one process each, started by this command (docs/parallel.md)")


def add_placement_options(parser: argparse.ArgumentParser, context: bool = True) -> None:
    """The shared flags; `context`: also --context (commands with their own --max-context read that)."""
    g = parser.add_argument_group("placement (see `dsflash plan`)")
    add_layout_options(g)
    g.add_argument("--gpu-memory", type=size_arg, metavar="SIZE",
                   help="memory per GPU, e.g. 140GiB (default: what each device has free)")
    g.add_argument("--host-memory", type=size_arg, metavar="SIZE",
                   help="host memory, e.g. 512GiB (default: MemAvailable of /proc/meminfo)")
    g.add_argument("--engram", choices=TIERS,
                   help="where the Engram tables live (default: host memory when they fit, else disk; "
                        "resident on the CPU backend)")
    g.add_argument("--experts", choices=TIERS,
                   help="where the routed experts live (default: the GPUs when they fit, else host, else disk; "
                        "resident on the CPU backend)")
    g.add_argument("--expert-cache", type=size_arg, metavar="SIZE",
                   help="GPU expert cache per GPU for host/disk experts (default: one layer's bank)")
    g.add_argument("--engram-cache", type=size_arg, default=ENGRAM_CACHE, metavar="SIZE",
                   help="host RAM for the hot rows of disk-tier Engram tables (0: none)")
    if context:
        g.add_argument("--context", type=int, metavar="N", help="tokens per session to hold (default: the model's)")
    g.add_argument("--sessions", type=int, default=1, metavar="N", help="sessions held at once (default 1)")


def host_available() -> int:
    """MemAvailable of /proc/meminfo, in bytes."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    raise PlacementError(f"cannot read MemAvailable from {MEMINFO}: give --host-memory")


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_free(ids: tuple[int, ...]) -> tuple[int, ...]:
    """Free bytes of the CUDA devices `ids` (torch.cuda.mem_get_info)."""
    import torch

    check_present(ids, "to measure; give --gpu-memory to plan for others")
    return tuple(torch.cuda.mem_get_info(i)[0] for i in ids)


def check_present(ids: tuple[int, ...], why: str = "") -> None:
    """PlacementError naming --gpus when an id is not a CUDA device of this machine."""
    have = _cuda_count()
    missing = sorted({i for i in ids if i >= have})
    if missing:
        raise PlacementError(f"--gpus {','.join(map(str, ids))}: {', '.join(f'GPU {i}' for i in missing)} not on "
                             f"this machine (it has {have} CUDA device(s)){' ' + why if why else ''}")


def gpu_ids(args: argparse.Namespace) -> tuple[int, ...]:
    """The GPU ids of --gpus: a list as given; a count N the N from the command's device ("cuda:1": from 1 on);
    not given: one a rank (--pp x max(--tp, --ep): --tp and --ep share their ranks)."""
    gpus = args.gpus if args.gpus is not None else args.pp * max(args.tp, args.ep)
    if isinstance(gpus, tuple):
        return gpus
    if gpus < 1:
        raise PlacementError(f"--gpus {gpus}: expected at least 1")
    first = int(str(getattr(args, "device", None) or "cuda").partition(":")[2] or 0)
    return tuple(range(first, first + gpus))


def request_from(args: argparse.Namespace, model: ModelArgs, half: str, backend: str) -> Request:
    """The plan request of a command's flags (defaults measured on this machine)."""
    if backend == "cpu" and args.gpus not in (None, 1):
        raise PlacementError(f"--gpus {args.gpus}: the CPU backend has one device (host memory)")
    ids = gpu_ids(args) if backend == "cuda" else ()
    host = args.host_memory if args.host_memory is not None else host_available()
    gpus = ()
    if backend == "cuda" and args.gpu_memory is not None:
        gpus = (args.gpu_memory,) * len(ids)
    elif backend == "cuda":
        gpus = gpu_free(ids)
    context = getattr(args, "context", None) or getattr(args, "max_context", None) or model.max_seq_len
    return Request(half=half, backend=backend, gpu_memory=gpus, host_memory=host, engram=args.engram,
                   experts=args.experts, expert_cache=args.expert_cache, engram_cache=args.engram_cache,
                   context=context, sessions=args.sessions, gpu_ids=ids, pp=args.pp, tp=args.tp, ep=args.ep)


def plan_from(args: argparse.Namespace, source: Checkpoint | ModelArgs, half: str = "all",
              backend: str | None = None) -> Plan:
    """The plan of a command's flags for `half` of the model at `source` (a checkpoint: its headers; a
    config: its expected tensors). backend: "cpu" or "cuda" (default: from args.device)."""
    if backend is None:
        backend = "cuda" if str(getattr(args, "device", "cpu")).startswith("cuda") else "cpu"
    model = source.args if isinstance(source, Checkpoint) else source
    return plan(source, request_from(args, model, half, backend))


def tiers_from(args: argparse.Namespace, placed: Plan | None = None) -> Tiers:
    """The tiers to load with: the plan's resolved ones, or without a plan the flags (default resident)."""
    if placed is not None:
        return Tiers(placed.engram, placed.experts, placed.request.expert_cache, placed.request.engram_cache)
    return Tiers(args.engram or "gpu", args.experts or "gpu", args.expert_cache, args.engram_cache)


def stage_ranks(args: argparse.Namespace) -> int:
    """The number of ranks a layer range runs on: max(--ep, --tp) (the same ranks when both are given:
    model/parallel.py Layout; with --pp each range has its own, rank 0 among them)."""
    return max(args.tp, args.ep)


def check_gpus(args: argparse.Namespace) -> None:
    """PlacementError naming the flag when the layout (stage_ranks) and --gpus disagree on a CUDA backend:
    one GPU a layer range and a rank (--pp x max(--tp, --ep)), the ranks' GPUs consecutive from --device,
    every GPU present."""
    ranks = stage_ranks(args)
    if not str(getattr(args, "device", "cpu")).startswith("cuda"):
        return
    ids = gpu_ids(args)
    # the ranks' processes take consecutive GPUs from the command's device (ranks.follower_device)
    want, what = ((args.pp, f"--pp {args.pp} layer ranges") if ranks == 1 else
                  (ranks, f"--ep {args.ep} --tp {args.tp} ranks") if args.pp == 1 else
                  (args.pp * ranks, f"--pp {args.pp} x --ep {args.ep} --tp {args.tp} ranks"))
    if len(ids) != want:
        raise PlacementError(f"--gpus {','.join(map(str, ids))}: {len(ids)} GPU(s) for {what} (one GPU "
                             f"each; `dsflash plan --gpus {len(ids)}` shows a greedy layout)")
    first = int(str(args.device).partition(":")[2] or 0)
    if ranks != 1 and ids != tuple(range(first, first + want)):
        raise PlacementError(f"--gpus {','.join(map(str, ids))}: ranks run on consecutive GPUs from --device "
                             f"{args.device} (--device cuda:{ids[0]} --gpus {want} for these)")
    check_present(ids)


def checked_plan(command: str, args: argparse.Namespace, model_dir: str | Path, half: str) -> Plan:
    """The plan for a command about to load `half` of the checkpoint at `model_dir`, printed to stderr;
    PlacementError (one line: the shortfall and the flag that fixes it) when it does not fit or when its
    layout and --gpus disagree. Reads headers only."""
    check_gpus(args)
    backend = "cuda" if str(getattr(args, "device", "cpu")).startswith("cuda") else "cpu"
    placed = plan_from(args, Checkpoint(model_dir), half, backend)
    print(f"dsflash {command}: {placed.table()}", file=sys.stderr)
    problem = placed.problem()
    if problem:
        raise PlacementError(problem)
    return placed


def layer_devices(args: argparse.Namespace, model: str | Path | ModelArgs, half: str
                  ) -> list[tuple[range, str]] | None:
    """The layer ranges of --pp over the devices of --gpus (model/transformer.py `Transformer(ranges=)`) for
    `half` of the model (a checkpoint directory or its config); None for one range on the command's device.
    With ranks (--ep/--tp) range s is on the first GPU of its stage's (every max(--ep, --tp)-th: the plan's
    numbering, the stage's followers on the next). On the CPU backend every range is on `cpu` (the same code,
    one device)."""
    if args.pp == 1:
        return None
    config = model if isinstance(model, ModelArgs) else load_config(Path(model))
    ranges = layer_ranges(half_layers(config, half), args.pp)
    if not str(getattr(args, "device", "cpu")).startswith("cuda"):
        return [(r, "cpu") for r in ranges]
    return [(r, f"cuda:{i}") for r, i in zip(ranges, gpu_ids(args)[::stage_ranks(args)], strict=True)]
