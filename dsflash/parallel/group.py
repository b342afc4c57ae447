"""The ranks of one model half over torch.distributed (gloo on the CPU, NCCL on CUDA), and the control line
each follower keeps to rank 0.

Collectives here never reduce: `all_gather` hands every rank's part back in rank order, and the caller sums
them (if at all) in the single-device order -- a ring all-reduce would add fp32 partials in an order that
depends on the world size, and the bits would follow the machine's shape (docs/parallel.md).

A rank that dies takes the group down: the next collective on any other rank fails (gloo: the peer's
connection closes; any backend: the group's timeout), and rank 0 raises `RankLost`, a retryable
`Unavailable` (the server's 503 + Retry-After), never a hang.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0


class Unavailable(RuntimeError):
    """A part of the serving machinery is gone (a box, a rank): retryable; the server answers 503 with
    Retry-After and the client may try again once it is back."""

    retry_after = 5


class RankLost(Unavailable):
    """A rank of the model's process group died or stopped answering: the group is down."""


class Group:
    """This process's place in the group: rank, world size, the device its tensors travel from, and the
    collectives the parallel layouts use (broadcast from rank 0, ordered all-gather). `pg`: a subgroup of the
    process's world (`stage_groups`; its ranks numbered within it), None for the world itself."""

    def __init__(self, rank: int, world: int, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S,
                 pg: dist.ProcessGroup | None = None):
        self.rank, self.world, self.device, self.timeout_s, self.pg = rank, world, device, timeout_s, pg
        self.lost: str | None = None  # why the group went down, once it has

    def _checked(self, what: str, fn):
        if self.lost is not None:
            raise RankLost(f"the rank group is down ({self.lost})")
        try:
            return fn()
        except Exception as e:  # gloo raises RuntimeError, NCCL DistBackendError; either way the group is gone
            self.lost = f"{what} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            raise RankLost(f"a rank of the {self.world}-rank group is lost ({self.lost})") from e

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """t from rank 0 on every rank (in place; t has the same shape and dtype everywhere)."""
        self._checked("broadcast", lambda: dist.broadcast(t, group=self.pg, group_src=0))
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's t (same shape and dtype on all ranks), in rank order."""
        parts = [torch.empty_like(t) for _ in range(self.world)]
        self._checked("all_gather", lambda: dist.all_gather(parts, t.contiguous(), group=self.pg))
        return parts

    def close(self) -> None:
        """Take the group down (the world: every subgroup of it too)."""
        if dist.is_initialized():
            dist.destroy_process_group(self.pg)


def backend_for(device: str | torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_group(rank: int, world: int, device: str | torch.device, timeout_s: float = DEFAULT_TIMEOUT_S,
               addr: str | None = None, port: int | None = None) -> Group:
    """Join the group of `world` ranks whose store rank 0 serves at addr:port (None: torchrun's, from the
    environment); every collective (and the join itself) gives up after `timeout_s`."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank}: expected 0 <= rank < world size {world}")
    if dist.is_initialized():  # torch.distributed holds one default group a process
        raise RuntimeError("this process already belongs to a rank group (one parallel layout a process)")
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), init_method="env://" if addr is None else f"tcp://{addr}:{port}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    return Group(rank, world, device, timeout_s)


def stage_members(world: int, stages: int) -> list[list[int]]:
    """The ranks of each stage's group when `world` processes serve `stages` layer ranges (docs/parallel.md):
    rank 0, which drives every stage, and (world - 1) / stages followers of the stage's own, consecutive."""
    per, extra = divmod(world - 1, stages)
    if extra or not per:
        raise ValueError(f"{world} ranks do not make {stages} stages of rank 0 and equally many followers each")
    return [[0, *range(1 + s * per, 1 + (s + 1) * per)] for s in range(stages)]


def stage_groups(world: Group, stages: int, devices: Sequence[str | torch.device] = ()) -> list[Group | None]:
    """Each stage's group (`stage_members`) as this process sees it: None for a stage it is not in. With one
    stage that is the world itself; otherwise every rank of the world calls this (torch.distributed's
    new_group is collective, in the same order everywhere). `devices`: this process's device in each stage
    (rank 0 computes each stage's part on that stage's device; default: the world's device)."""
    if stages == 1:
        return [world]
    groups: list[Group | None] = []
    for s, members in enumerate(stage_members(world.world, stages)):
        pg = dist.new_group(members, timeout=timedelta(seconds=world.timeout_s))
        device = torch.device(devices[s]) if devices else world.device
        groups.append(Group(members.index(world.rank), len(members), device, world.timeout_s, pg)
                      if world.rank in members else None)
    return groups


class Control:
    """One JSON object a line over a TCP connection: rank 0 tells a follower what to load and which sharded
    operation comes next (the tensors then travel over the group). A follower waits on it without a
    timeout (an idle server sends nothing for hours), and reads the end of the line when rank 0 is gone."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.file = sock.makefile("rb")

    def send(self, msg: dict) -> None:
        try:
            self.sock.sendall(json.dumps(msg).encode() + b"\n")
        except OSError as e:
            raise RankLost(f"the control line to a rank is closed ({e})") from e

    def recv(self, timeout_s: float | None = None) -> dict | None:
        """The next message, or None when the other side closed the line."""
        self.sock.settimeout(timeout_s)
        try:
            line = self.file.readline()
        except OSError as e:
            raise RankLost(f"no answer on a rank's control line ({e})") from e
        return json.loads(line) if line else None

    def close(self) -> None:
        for part in (self.file, self.sock):
            try:
                part.close()
            except OSError:
                pass


def connect_control(addr: str, port: int, rank: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> Control:
    """A follower's control line to rank 0, announcing its rank."""
    control = Control(socket.create_connection((addr, port), timeout=timeout_s))
    control.send({"rank": rank})
    return control


def accept_controls(listener: socket.socket, world: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Control]:
    """Rank 0: the control lines of ranks 1 .. world-1, in rank order."""
    listener.settimeout(timeout_s)
    by_rank: dict[int, Control] = {}
    try:
        while len(by_rank) < world - 1:
            sock, _ = listener.accept()
            control = Control(sock)
            hello = control.recv(timeout_s)
            rank = hello.get("rank") if hello else None
            if not isinstance(rank, int) or not 0 < rank < world or rank in by_rank:
                control.close()
                raise RankLost(f"a rank announced itself as {hello!r}: expected one of 1 .. {world - 1}, once")
            by_rank[rank] = control
    except TimeoutError as e:
        raise RankLost(f"{world - 1 - len(by_rank)} rank(s) did not connect within {timeout_s:.0f} s") from e
    return [by_rank[r] for r in range(1, world)]
