"""`dsflash follow`: a follower rank of a parallel layout, as engine/ranks.py starts them. It loads the shards
rank 0 names and computes its part of each sharded operation until rank 0 closes its control line."""

from __future__ import annotations

import argparse

from dsflash.engine.ranks import follow_rank
from dsflash.parallel.group import DEFAULT_TIMEOUT_S


def run(args: argparse.Namespace) -> int:
    model = args.model
    if args.synthetic:  # a parallel bench's ranks: the same synthetic tensors as rank 0's, drawn here
        from dsflash.bench.synthetic import SyntheticCheckpoint, synthetic_args

        model = SyntheticCheckpoint(synthetic_args(args.synthetic), args.device)
    return follow_rank(model, args.rank, args.world, args.device, (args.addr, args.control_port),
                       (args.addr, args.port), args.timeout, args.stages)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("follow", help="a follower rank of an --ep/--tp layout (rank 0 starts these itself)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory")
    src.add_argument("--synthetic", metavar="PRESET[:EXPERTS]", help="a bench's synthetic checkpoint (dsflash bench)")
    p.add_argument("--rank", type=int, required=True, help="this rank (1 .. world-1)")
    p.add_argument("--world", type=int, required=True, help="the rank count of every stage together")
    p.add_argument("--stages", type=int, default=1, help="the layer ranges (--pp), each with followers of its own")
    p.add_argument("--addr", required=True, help="rank 0's host")
    p.add_argument("--port", type=int, required=True, help="the group's store port")
    p.add_argument("--control-port", type=int, required=True, help="rank 0's control port")
    p.add_argument("--device", default="cpu", help="this rank's device (cpu: gloo; cuda:N: NCCL)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds before a collective gives up")
    p.set_defaults(func=run)
