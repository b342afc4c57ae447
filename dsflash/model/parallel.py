"""Expert and tensor parallelism of a model half over a process group (dsflash/parallel/group.py), bit-identical
to one device (docs/parallel.md).

Rank 0 runs the model and holds its state (caches, rings, the sequence); the other ranks hold shards of the
big weights and compute their part of each sharded operation when rank 0 names it: rank 0 sends the
operation's name on each follower's control line, broadcasts its inputs, every rank computes its part, and
an ordered all-gather brings the parts back to rank 0, which puts them together. No part is a partial sum:

- expert parallelism (`Layout.ep`): rank r holds the routed experts of a contiguous id range of every MoE
  layer and computes the (row, pick) pairs routed to them; rank 0 places every pair's product at its slot and
  sums them with `k.moe_sum` in ascending expert id, as one device does. A pair's product does not depend on
  which other pairs share the call (`kernels/cpu.py` on batch invariance; the CUDA kernels are row-invariant).
- tensor parallelism (`Layout.tp`): the linears of `SHARDED_LINEARS` and the head are split by output
  features (column-parallel: attention's q LoRA, q heads and kv projections, `wo_b`, the shared expert's
  three, the head by vocabulary). Every output is computed whole on one rank with its whole K and the K
  ranges of the whole weight (`Weight.k_range_out`), then the shards are concatenated. `wo_b` and the shared
  expert's `w2` are row-parallel in the usual layout (their K split over ranks, partials all-reduced); here
  each rank takes the whole gathered input instead, so no fp32 sum changes order. A weight whose output
  count does not split into equal multiples of 32 rows is kept whole on rank 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from dsflash.checkpoint.reader import Checkpoint
from dsflash.config import ConfigError
from dsflash.kernels import Kernels
from dsflash.kernels.cpu import Weight
from dsflash.model.moe import pair_products
from dsflash.model.weights import WeightLoader
from dsflash.numerics import BLOCK
from dsflash.parallel.group import Control, Group, RankLost

# the column-parallel linears by name ending (and the head by vocabulary)
SHARDED_LINEARS = (".attn.wq_a", ".attn.wq_b", ".attn.wkv", ".attn.wo_b",
                   ".shared_experts.w1", ".shared_experts.w2", ".shared_experts.w3")
HEAD = "head"


@dataclass(frozen=True)
class Layout:
    """The parallel layout of one model half: `ep` ranks share the routed experts, `tp` ranks the sharded
    linears; both at once run over the same ranks (then ep == tp)."""

    ep: int = 1
    tp: int = 1

    def __post_init__(self):
        for name in ("ep", "tp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} {getattr(self, name)}: expected at least 1")
        if self.ep > 1 and self.tp > 1 and self.ep != self.tp:
            raise ConfigError(f"--ep {self.ep} with --tp {self.tp}: both run over the same ranks, give equal counts")

    @property
    def world(self) -> int:
        return max(self.ep, self.tp)


def expert_range(n: int, world: int, rank: int) -> range:
    """The routed expert ids rank `rank` holds: a contiguous range, the ranks' ranges covering 0 .. n-1."""
    return range(n * rank // world, n * (rank + 1) // world)


def shard_rows(out: int, world: int, rank: int) -> slice | None:
    """Rank `rank`'s output rows of a column-parallel weight with `out` rows: equal shards of whole 32-row
    blocks (FP8's scale tiles), or None when `out` does not split so (the weight stays whole on rank 0)."""
    if out % (BLOCK * world):
        return None
    size = out // world
    return slice(rank * size, (rank + 1) * size)


class LinearShard:
    """A column-parallel linear's rows on one rank: x [N, in] -> its [N, out / world] outputs."""

    def __init__(self, w: WeightLoader, name: str, widen: bool, rank: int, world: int):
        self.k = w.k
        self.out = w.raw(name + ".weight").size(0)
        self.weight = w.linear(name, widen, shard_rows(self.out, world, rank))
        self.weight.k_range_out = self.out  # each output sums its K blocks as the whole weight's GEMM does

    def local(self, x: torch.Tensor) -> torch.Tensor:
        return self.k.linear(x, self.weight)

    def combine(self, parts: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.cat(parts, dim=-1)


class ExpertShard:
    """One MoE layer's routed experts of one rank (`expert_range`): the products of the (row, pick) pairs routed
    to them, padded to the busiest rank's pair count (every rank computes every rank's count from the ids)."""

    def __init__(self, w: WeightLoader, name: str, n: int, topk: int, limit: float, rank: int, world: int):
        if n < world:
            raise ConfigError(f"--ep {world}: {name} has {n} routed experts; --ep must not exceed the expert count")
        self.k, self.topk, self.limit, self.rank, self.world = w.k, topk, limit, rank, world
        self.experts = expert_range(n, world, rank)
        self.bounds = torch.tensor([expert_range(n, world, r).start for r in range(1, world)], device=w.k.device)
        self.w13 = self.k.expert_bank([w.linear(f"{name}experts.{e}.{p}") for p in ("w1", "w3") for e in self.experts])
        self.w2 = self.k.expert_bank([w.linear(f"{name}experts.{e}.w2") for e in self.experts])
        self.dim = self.w2[0].out_features

    def owners(self, ids: torch.Tensor) -> torch.Tensor:
        """The rank holding each pick's expert, over the flattened picks."""
        return torch.bucketize(ids.flatten(), self.bounds, right=True)

    def local(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        owners = self.owners(ids)
        width = int(torch.bincount(owners, minlength=self.world).max())
        pairs = torch.nonzero(owners == self.rank).flatten()
        out = x.new_zeros(width, self.dim)
        if pairs.numel():
            out[: pairs.numel()] = pair_products(self.k, x, weights, pairs, ids.flatten()[pairs] - self.experts.start,
                                                 self.w13, self.w2, len(self.experts), self.topk, self.limit)
        return out

    def combine(self, parts: list[torch.Tensor], x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                ) -> torch.Tensor:
        """Every pair's product at its (row, slot): [N, k, D], slots in the ids' order (ascending expert id)."""
        owners = self.owners(ids)
        routed = x.new_empty(ids.numel(), self.dim)
        for rank, part in enumerate(parts):
            pairs = torch.nonzero(owners == rank).flatten()
            routed[pairs] = part[: pairs.numel()]
        return routed.view(*ids.shape, self.dim)


Shard = LinearShard | ExpertShard


def load_shard(spec: dict, w: WeightLoader, rank: int, world: int) -> Shard:
    """The shard a load message names, read from the checkpoint (this rank's rows or experts only)."""
    if spec["kind"] == "linear":
        return LinearShard(w, spec["name"], spec["widen"], rank, world)
    n, topk = w.ckpt.args.moe_experts(spec["layer"])
    return ExpertShard(w, spec["name"], n, topk, w.ckpt.args.swiglu_limit, rank, world)


class ShardedWeight(Weight):
    """A column-parallel linear as rank 0's model holds it: its own shard, run over the group by the kernels
    `Sharding.kernels` gives (their `linear` sees this type)."""

    def __init__(self, name: str, shard: LinearShard):
        self.name, self.shard = name, shard
        self.kind, self.values, self.scale = shard.weight.kind, shard.weight.values, shard.weight.scale

    @property
    def out_features(self) -> int:
        return self.shard.out

    @property
    def in_features(self) -> int:
        return self.shard.weight.in_features


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Sharding:
    """Rank 0's side of a parallel layout: the group, a control line per follower, the shards it holds and
    registers with the followers as the model loads (`linear_weight`, `experts`), and `run`, one sharded
    operation over the group. Once a rank is lost every later call raises `RankLost`."""

    def __init__(self, layout: Layout, group: Group, controls: Sequence[Control],
                 stop_followers: Callable[[bool], None] = lambda graceful: None):
        self.layout, self.group, self.controls = layout, group, list(controls)
        self.stop_followers = stop_followers  # (graceful) -> None: the processes rank 0 started, if any
        self.shards: dict[str, Shard] = {}

    def _load(self, spec: dict, w: WeightLoader) -> Shard:
        self._send({"load": spec})
        shard = self.shards[spec["name"]] = load_shard(spec, w, 0, self.layout.world)
        return shard

    def linear_weight(self, w: WeightLoader, name: str, widen: bool) -> Weight | None:
        """The column-parallel weight `name` as rank 0 holds it, or None where it is not sharded."""
        if self.layout.tp == 1 or not (name == HEAD or name.endswith(SHARDED_LINEARS)):
            return None
        if shard_rows(w.raw(name + ".weight").size(0), self.layout.world, 0) is None:
            return None
        return ShardedWeight(name, self._load({"kind": "linear", "name": name, "widen": widen}, w))

    def experts(self, w: WeightLoader, name: str, layer: int
                ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """The MoE layer at `name`'s routed experts over the group: (x, weights, ids ascending) -> the pairs'
        products [N, k, D]; None without expert parallelism."""
        if self.layout.ep == 1:
            return None
        self._load({"kind": "experts", "name": name, "layer": layer}, w)
        return lambda x, weights, ids: self.run(name, x, weights, ids)

    def kernels(self, k: Kernels) -> Kernels:
        """k with a `linear` that runs a ShardedWeight over the group (any other weight as before)."""
        base = k.linear

        def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
            return self.run(w.name, x) if isinstance(w, ShardedWeight) else base(x, w)

        return replace(k, linear=linear)

    @property
    def lost(self) -> str | None:
        """Why the group went down (a rank was lost), or None while it is up: a health check's answer."""
        return self.group.lost

    def ready(self, timeout_s: float | None = None) -> None:
        """Wait until every follower has loaded its shards (a follower's load error surfaces here)."""
        self._send({"ready": len(self.shards)})
        for rank, control in enumerate(self.controls, 1):
            answer = self._guard(lambda c=control: c.recv(timeout_s))
            if answer != {"loaded": len(self.shards)}:
                self._down()
                raise RankLost(f"rank {rank} did not load its shards (it answered {answer!r})")

    def run(self, name: str, *inputs: torch.Tensor) -> torch.Tensor:
        """One sharded operation: its name to the followers, its inputs broadcast, every rank's part
        all-gathered in rank order, the parts put together here."""
        inputs = tuple(t.contiguous() for t in inputs)
        self._send({"run": name, "inputs": [[list(t.shape), _dtype_name(t.dtype)] for t in inputs]})
        shard = self.shards[name]
        for t in inputs:
            self._guard(lambda t=t: self.group.broadcast(t))
        parts = self._guard(lambda: self.group.all_gather(shard.local(*inputs)))
        return shard.combine(parts, *inputs)

    def _send(self, msg: dict) -> None:
        if self.group.lost is not None:
            raise RankLost(f"the rank group is down ({self.group.lost})")
        for control in self.controls:
            self._guard(lambda c=control: c.send(msg))

    def _guard(self, fn):
        try:
            return fn()
        except RankLost:
            self._down()
            raise

    def _down(self) -> None:
        """A rank is lost: the group's other ranks are stopped too (no rank waits on a collective forever)."""
        if self.group.lost is None:
            self.group.lost = "a rank was lost"
        for control in self.controls:
            control.close()
        self.stop_followers(False)

    def close(self) -> None:
        """Followers see their control line close and exit; then the group is taken down."""
        for control in self.controls:
            control.close()
        self.stop_followers(self.group.lost is None)
        self.group.close()


def follow(group: Group, control: Control, ckpt: Checkpoint, k: Kernels) -> None:
    """A follower rank: load the shards rank 0 names and compute its part of each operation rank 0 runs, until
    rank 0 closes the control line (RankLost when the group fails under it)."""
    w = WeightLoader(ckpt, k)
    shards: dict[str, Shard] = {}
    while (msg := control.recv()) is not None:
        if "load" in msg:
            shards[msg["load"]["name"]] = load_shard(msg["load"], w, group.rank, group.world)
        elif "ready" in msg:
            control.send({"loaded": len(shards)})
        else:
            inputs = [group.broadcast(torch.empty(shape, dtype=getattr(torch, dtype), device=group.device))
                      for shape, dtype in msg["inputs"]]
            group.all_gather(shards[msg["run"]].local(*inputs))
