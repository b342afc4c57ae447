"""Starting the ranks of a parallel layout (model/parallel.py, docs/parallel.md): the command's process is rank
0, which drives the model; it starts ranks 1 .. world-1 itself, one `dsflash follow` process each (on CUDA,
rank r on the GPU r places after rank 0's), joins them in one torch.distributed group and keeps a control
line to each. Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment) the ranks are
torchrun's: rank 0 drives, the others follow, and nothing is started here."""

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
from dsflash.engine.placement import check_layout
from dsflash.kernels import load_kernels
from dsflash.model.parallel import Layout, Sharding, follow
from dsflash.parallel.group import DEFAULT_TIMEOUT_S, RankLost, accept_controls, connect_control, init_group

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


def follower_device(device: str, rank: int) -> str:
    """Rank `rank`'s device when rank 0 runs on `device`: the CPU, or the rank-th GPU from rank 0's."""
    d = torch.device(device)
    return "cpu" if d.type == "cpu" else f"cuda:{(d.index or 0) + rank}"


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


def start_ranks(layout: Layout, model: str | Path | None, device: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S,
                source: Sequence[str] = ()) -> Sharding:
    """Rank 0 of `layout` for the checkpoint at `model`, with its followers started (or torchrun's joined).
    The model is then loaded with `parallel=` the result (Engine.load), which registers the shards.
    `source`: the followers' checkpoint flags instead of `--model model` (`dsflash follow --synthetic`)."""
    if layout.world < 2:
        raise ValueError(f"--ep {layout.ep} --tp {layout.tp}: a parallel layout needs at least 2 ranks")
    run = torchrun_env()
    if run is not None:
        if run.rank != 0 or run.world != layout.world:
            raise ValueError(f"torchrun rank {run.rank} of {run.world}: rank 0 of --ep {layout.ep} --tp {layout.tp} "
                             f"drives, and torchrun's world size must be {layout.world}")
        addr, port, control_port, procs = run.addr, run.port, run.control_port, []
    else:
        addr, port, control_port = LOCALHOST, _free_port(), 0
    listener = socket.create_server(("" if run else LOCALHOST, control_port))  # torchrun: any host may connect
    if run is None:
        control_port = listener.getsockname()[1]
        flags = list(source) or ["--model", str(model)]
        procs = [subprocess.Popen([sys.executable, "-m", "dsflash.cli", "follow", *flags,
                                   "--rank", str(r), "--world", str(layout.world), "--addr", addr,
                                   "--port", str(port), "--control-port", str(control_port),
                                   "--device", follower_device(device, r), "--timeout", str(timeout_s)])
                 for r in range(1, layout.world)]
    stop = Followers(procs)
    try:
        group = init_group(0, layout.world, device, timeout_s, *((None, None) if run else (addr, port)))
        controls = accept_controls(listener, layout.world, timeout_s)
    except BaseException:
        stop(graceful=False)
        raise
    finally:
        listener.close()
    return Sharding(layout, group, controls, stop)


def follow_rank(model: str | Path | Checkpoint, rank: int, world: int, device: str, control: tuple[str, int],
                store: tuple[str, int] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """A follower rank until rank 0 closes its control line (0) or the group fails (1, said on stderr):
    join the group (its store at `store`, or torchrun's), connect the control line to rank 0, follow.
    `model`: the checkpoint directory, or a checkpoint already open (a bench's synthetic one)."""
    ckpt = open_checkpoint(model) if isinstance(model, str | Path) else model
    group = init_group(rank, world, device, timeout_s, *(store or (None, None)))
    line = connect_control(*control, rank, timeout_s)
    try:
        follow(group, line, ckpt, load_kernels(device))
    except RankLost as e:  # rank 0 or another follower went away: this rank goes too
        print(f"dsflash follow: rank {rank}: {e}", file=sys.stderr)
        return 1
    finally:
        line.close()
        group.close()
    return 0


def follow_torchrun(model: str | Path, device: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """This torchrun rank (> 0) as a follower of rank 0's command, on the GPU of its LOCAL_RANK on CUDA."""
    run = torchrun_env()
    assert run is not None and run.rank > 0, "follow_torchrun is for torchrun's ranks above 0"
    local = int(os.environ.get("LOCAL_RANK", run.rank))
    return follow_rank(model, run.rank, run.world, "cpu" if torch.device(device).type == "cpu" else f"cuda:{local}",
                       (run.addr, run.control_port), None, timeout_s)


def run_ranked(args: argparse.Namespace, model: str | Path, command: Callable[[Sharding | None], int]) -> int:
    """A command under its --ep/--tp flags: `command(parallel)` on rank 0 (or alone: None), the model to be
    loaded with Engine.load(parallel=...), the followers started before it and stopped after it; a torchrun
    rank above 0 follows rank 0's command instead."""
    device = str(getattr(args, "device", None) or "cpu")
    launched = torchrun_env()
    if launched is not None and launched.rank > 0:
        return follow_torchrun(model, device)
    check_layout(args)  # before any follower starts
    layout = Layout(args.ep, args.tp)
    if layout.world == 1:
        return command(None)
    sharding = start_ranks(layout, model, device)
    try:
        return command(sharding)
    finally:
        sharding.close()
