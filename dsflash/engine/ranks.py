"""Starting the ranks of a parallel layout (model/parallel.py, docs/parallel.md): the command's process is rank
0, which drives the model; it starts the followers itself, one `dsflash follow` process each (on CUDA, each on
its GPU after rank 0's), joins them in one torch.distributed world and keeps a control line to each. With layer
ranges (--pp) each range is a stage with followers of its own, max(tp, ep) - 1 of them, and a group of rank 0
and those (`stage_groups`): 1 + pp x (max(tp, ep) - 1) processes in all. Under torchrun (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT in the environment) the ranks are torchrun's: rank 0 drives, the others follow, and
nothing is started here (one stage only)."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dsflash.checkpoint.reader import Checkpoint, open_checkpoint
from dsflash.engine.placement import check_gpus, layer_devices
from dsflash.engine.plan import PlacementError
from dsflash.kernels import load_kernels
from dsflash.model.parallel import Layout, Sharding, follow
from dsflash.parallel.group import (
    DEFAULT_TIMEOUT_S,
    RankLost,
    accept_controls,
    connect_control,
    init_group,
    stage_groups,
    stage_members,
)

LOCALHOST = "127.0.0.1"
STOP_WAIT_S = 10.0


@dataclass(frozen=True)
class Torchrun:
    """This process's place in a torchrun launch: the control lines listen one port above the store's."""

    rank: int
    world: int
    addr: str
    port: int

    @property
    def control_port(self) -> int:
        return self.port + 1


def torchrun_env() -> Torchrun | None:
    """The torchrun rank of this process, or None when it was not started by torchrun (or alone)."""
    env = os.environ
    if "RANK" not in env or int(env.get("WORLD_SIZE", "1")) < 2:
        return None
    return Torchrun(int(env["RANK"]), int(env["WORLD_SIZE"]), env.get("MASTER_ADDR", LOCALHOST),
                    int(env.get("MASTER_PORT", "29500")))


def follower_device(device: str, rank: int, world: int, stages: int = 1) -> str:
    """Rank `rank`'s device when rank 0 runs on `device`: the CPU, or on CUDA the GPU the plan gives it
    (engine/plan.py: stage s's ranks on GPUs s x ranks-a-stage + 0, 1, ... from rank 0's, where the stage's
    own part of rank 0 is the first)."""
    d = torch.device(device)
    if d.type == "cpu":
        return "cpu"
    members = stage_members(world, stages)
    stage = next(s for s, m in enumerate(members) if rank in m[1:])
    return f"cuda:{(d.index or 0) + stage * len(members[stage]) + members[stage].index(rank)}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOCALHOST, 0))
        return s.getsockname()[1]


class Followers:
    """The follower processes this rank 0 started (none under torchrun); calling it stops them: when `graceful`
    each exits as its control line closes (terminated if it has not after STOP_WAIT_S), otherwise (a rank was
    lost: what the others hold is of no use) killed at once -- a stopped process would ignore SIGTERM."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs = procs

    def __call__(self, graceful: bool = True) -> None:
        for p in self.procs:
            if graceful:
                try:
                    p.wait(STOP_WAIT_S)
                    continue
                except subprocess.TimeoutExpired:
                    p.terminate()
            else:
                p.kill()
            try:
                p.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def one_stage_under_torchrun(pp: int, layout: Layout) -> None:
    """PlacementError naming the flags for layer ranges with ranks under torchrun: its processes are numbered
    for one stage (rank r on LOCAL_RANK's GPU), the stages' are started by dsflash itself."""
    if pp > 1 and layout.world > 1:
        raise PlacementError(f"--pp {pp} with --ep {layout.ep} --tp {layout.tp} under torchrun: the stages' ranks "
                             "are started by dsflash itself (run the command without torchrun)")


def start_ranks(layout: Layout, model: str | Path | None, device: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S,
                source: Sequence[str] = (), ranges: Sequence[tuple[range, str]] | None = None) -> Sharding:
    """Rank 0 of `layout` for the checkpoint at `model`, with its followers started (or torchrun's joined).
    The model is then loaded with `parallel=` the result (Engine.load), which registers the shards.
    `source`: the followers' checkpoint flags instead of `--model model` (`dsflash follow --synthetic`).
    `ranges`: the layer ranges the model is loaded over (--pp: placement.layer_devices), a stage each, rank
    0's part of a stage on its range's device; None: one stage over every layer, on `device`."""
    if layout.world < 2:
        raise ValueError(f"--ep {layout.ep} --tp {layout.tp}: a parallel layout needs at least 2 ranks")
    stages = list(ranges) if ranges else [(None, device)]
    world = 1 + len(stages) * (layout.world - 1)
    run = torchrun_env()
    if run is not None:
        one_stage_under_torchrun(len(stages), layout)
        if run.rank != 0 or run.world != world:
            raise ValueError(f"torchrun rank {run.rank} of {run.world}: rank 0 of --ep {layout.ep} --tp {layout.tp} "
                             f"drives, and torchrun's world size must be {world}")
        addr, port, control_port, procs = run.addr, run.port, run.control_port, []
    else:
        addr, port, control_port = LOCALHOST, _free_port(), 0
    listener = socket.create_server(("" if run else LOCALHOST, control_port))  # torchrun: any host may connect
    if run is None:
        control_port = listener.getsockname()[1]
        flags = list(source) or ["--model", str(model)]
        procs = [subprocess.Popen([sys.executable, "-m", "dsflash.cli", "follow", *flags,
                                   "--rank", str(r), "--world", str(world), "--stages", str(len(stages)),
                                   "--addr", addr, "--port", str(port), "--control-port", str(control_port),
                                   "--device", follower_device(device, r, world, len(stages)),
                                   "--timeout", str(timeout_s)])
                 for r in range(1, world)]
    stop = Followers(procs)
    try:
        group = init_group(0, world, device, timeout_s, *((None, None) if run else (addr, port)))
        groups = stage_groups(group, len(stages), [dev for _, dev in stages])
        controls = accept_controls(listener, world, timeout_s)
    except BaseException:
        stop(graceful=False)
        raise
    finally:
        listener.close()
    per = layout.world - 1  # each stage's followers, in rank order (stage_members)
    return Sharding(layout, group, [(layers, g, controls[s * per:(s + 1) * per])
                                    for s, ((layers, _), g) in enumerate(zip(stages, groups, strict=True))], stop)


def follow_rank(model: str | Path | Checkpoint, rank: int, world: int, device: str, control: tuple[str, int],
                store: tuple[str, int] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, stages: int = 1) -> int:
    """A follower rank until rank 0 closes its control line (0) or the group fails (1, said on stderr):
    join the world (its store at `store`, or torchrun's) and its stage's group (`stages` layer ranges), connect
    the control line to rank 0, follow. `model`: the checkpoint directory, or a checkpoint already open (a
    bench's synthetic one)."""
    ckpt = open_checkpoint(model) if isinstance(model, str | Path) else model
    everyone = init_group(rank, world, device, timeout_s, *(store or (None, None)))
    (group,) = [g for g in stage_groups(everyone, stages) if g is not None]
    line = connect_control(*control, rank, timeout_s)
    try:
        follow(group, line, ckpt, load_kernels(device))
    except RankLost as e:  # rank 0 or another follower went away: this rank goes too
        print(f"dsflash follow: rank {rank}: {e}", file=sys.stderr)
        return 1
    finally:
        line.close()
        everyone.close()
    return 0


def follow_torchrun(model: str | Path, device: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """This torchrun rank (> 0) as a follower of rank 0's command, on the GPU of its LOCAL_RANK on CUDA."""
    run = torchrun_env()
    assert run is not None and run.rank > 0, "follow_torchrun is for torchrun's ranks above 0"
    local = int(os.environ.get("LOCAL_RANK", run.rank))
    return follow_rank(model, run.rank, run.world, "cpu" if torch.device(device).type == "cpu" else f"cuda:{local}",
                       (run.addr, run.control_port), None, timeout_s)


def run_ranked(args: argparse.Namespace, model: str | Path, half: str, command: Callable[[Sharding | None], int]
               ) -> int:
    """A command under its --pp/--ep/--tp flags for `half` of the model ("box", "back", "all"): `command(parallel)`
    on rank 0 (or alone: None), the model to be loaded with Engine.load(parallel=...) over the layer ranges of
    `placement.layer_devices` (a stage's ranks each), the followers started before it and stopped after it; a
    torchrun rank above 0 follows rank 0's command instead."""
    device = str(getattr(args, "device", None) or "cpu")
    check_gpus(args)  # before any follower starts (and the layer ranges below divide)
    layout = Layout(args.ep, args.tp)
    launched = torchrun_env()
    if launched is not None:
        one_stage_under_torchrun(args.pp, layout)  # on every rank: none waits for a group that never forms
        if launched.rank > 0:
            return follow_torchrun(model, device)
    if layout.world == 1:
        return command(None)
    sharding = start_ranks(layout, model, device, ranges=layer_devices(args, model, half))
    try:
        return command(sharding)
    finally:
        sharding.close()
