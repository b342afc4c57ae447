"""`dsflash plan`: where the model's parts would live (each GPU, pinned host memory, disk) and whether that
fits, from tensor headers alone: a checkpoint directory's, or a preset's expected tensors (no weights)."""

from __future__ import annotations

import argparse
import json
import sys

from dsflash.checkpoint.reader import CheckpointError, open_checkpoint
from dsflash.config import PRESETS, ConfigError, preset
from dsflash.engine.placement import add_placement_options, plan_from
from dsflash.engine.plan import HALVES, PlacementError


def run(args: argparse.Namespace) -> int:
    try:
        source = open_checkpoint(args.model) if args.model else preset(args.preset)
        backend = args.device or ("cuda" if args.gpu_memory is not None or _has_cuda() else "cpu")
        placed = plan_from(args, source, args.half, backend)
    except (CheckpointError, ConfigError, PlacementError) as e:
        print(f"dsflash plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(placed.as_dict(), indent=1) if args.json else placed.table())
    return 0 if placed.fits else 1


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="the memory plan: what goes on each GPU, in host memory and on disk",
                       description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory (its headers are read, no tensor)")
    src.add_argument("--preset", choices=list(PRESETS), help="a preset config's expected tensors")
    p.add_argument("--half", choices=HALVES, default="all",
                   help="box: embed, Engram, the layers before the first decoder layer, vision, that layer's cache "
                        "write; back: the rest, head and DSpark; all: both in one process (default)")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="backend (default: cuda when --gpu-memory is given or a GPU is present, else cpu)")
    add_placement_options(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON (bytes)")
    p.set_defaults(func=run)
