"""The placement flags every command that loads the model takes (`serve`, `box`, `generate`, `plan`): where
Engram and the routed experts live, how much memory the GPUs and the host have, the context and sessions
to hold, and the plan (engine/plan.py) they make, printed at start and checked before any tensor is read."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dsflash.checkpoint.reader import Checkpoint
from dsflash.config import ModelArgs
from dsflash.engine.plan import PlacementError, Plan, Request, parse_size, plan
from dsflash.model.tiers import ENGRAM_CACHE, TIERS, Tiers

MEMINFO = Path("/proc/meminfo")


def size_arg(text: str) -> int:
    """argparse's type for a size flag (plan.parse_size: 140GiB, 256KiB, a byte count)."""
    try:
        return parse_size(text)
    except PlacementError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def add_placement_options(parser: argparse.ArgumentParser, context: bool = True) -> None:
    """The shared flags; `context`: also --context (commands with their own --max-context read that)."""
    g = parser.add_argument_group("placement (see `dsflash plan`)")
    g.add_argument("--gpus", type=int, default=1, metavar="N", help="GPUs to place the layers on (default 1)")
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
    g.add_argument("--ep", type=int, default=1, metavar="N", help="expert parallelism: N ranks share the routed "
                   "experts, one process each, started by this command (docs/parallel.md)")
    g.add_argument("--tp", type=int, default=1, metavar="N", help="tensor parallelism: N ranks share the "
                   "column-parallel linears and the head (docs/parallel.md)")


def host_available() -> int:
    """MemAvailable of /proc/meminfo, in bytes."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    raise PlacementError(f"cannot read MemAvailable from {MEMINFO}: give --host-memory")


def gpu_free(n: int, first: int = 0) -> tuple[int, ...]:
    """Free bytes of CUDA devices first .. first+n-1 (torch.cuda.mem_get_info)."""
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < first + n:
        raise PlacementError(f"--gpus {n}: this machine has {have} CUDA device(s) to measure; give --gpu-memory "
                             "to plan for others")
    return tuple(torch.cuda.mem_get_info(i)[0] for i in range(first, first + n))


def request_from(args: argparse.Namespace, model: ModelArgs, half: str, backend: str) -> Request:
    """The plan request of a command's flags (defaults measured on this machine)."""
    if args.gpus < 1:
        raise PlacementError(f"--gpus {args.gpus}: expected at least 1")
    if backend == "cpu" and args.gpus != 1:
        raise PlacementError(f"--gpus {args.gpus}: the CPU backend has one device (host memory)")
    host = args.host_memory if args.host_memory is not None else host_available()
    gpus = ()
    if backend == "cuda" and args.gpu_memory is not None:
        gpus = (args.gpu_memory,) * args.gpus
    elif backend == "cuda":  # the device the command runs on ("cuda:1": from device 1 on)
        device = str(getattr(args, "device", None) or "cuda")
        gpus = gpu_free(args.gpus, int(device.partition(":")[2] or 0))
    context = getattr(args, "context", None) or getattr(args, "max_context", None) or model.max_seq_len
    return Request(half=half, backend=backend, gpu_memory=gpus, host_memory=host, engram=args.engram,
                   experts=args.experts, expert_cache=args.expert_cache, engram_cache=args.engram_cache,
                   context=context, sessions=args.sessions)


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


def checked_plan(command: str, args: argparse.Namespace, model_dir: str | Path, half: str) -> Plan:
    """The plan for a command about to load `half` of the checkpoint at `model_dir`, printed to stderr;
    PlacementError (one line: the shortfall and the flag that fixes it) when it does not fit or when it
    asks for what this build cannot run yet. Reads headers only."""
    if args.gpus != 1:
        raise PlacementError(f"--gpus {args.gpus}: this build runs on one GPU (`dsflash plan --gpus "
                             f"{args.gpus}` shows the layout a multi-GPU run would use)")
    placed = plan_from(args, Checkpoint(model_dir), half)
    print(f"dsflash {command}: {placed.table()}", file=sys.stderr)
    problem = placed.problem()
    if problem:
        raise PlacementError(problem)
    return placed
