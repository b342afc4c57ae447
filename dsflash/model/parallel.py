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
- tensor parallelism (`Layout.tp`): attention by heads (`AttentionShard`): rank r holds the q rows (`wq_b`),
  sinks and `wo_a` groups of its heads and a column shard of `wo_b`; rank 0 broadcasts the q LoRA's latent
  and what the heads attend to (the shared KV rows and indices: MQA), every rank computes its heads up to
  `wo_a` (attention.head_outputs: no sum across heads or groups), one all-gather gives every rank the whole
  `wo_b` input, and each computes its `wo_b` columns with the whole K. The linears of `SHARDED_LINEARS` and
  the head are split by output features the same way (column-parallel: the q and kv LoRA, the shared expert's
  three, the head by vocabulary). Every output is computed whole on one rank with its whole K and the K ranges
  of the whole weight (`Weight.k_range_out`), then the shards are concatenated. `wo_b` and the shared expert's
  `w2` are row-parallel in the usual layout (their K split over ranks, partials all-reduced); here each rank
  takes the whole gathered input instead, so no fp32 sum changes order. A weight whose output count does not
  split into equal multiples of 32 rows (attention: heads or groups that do not divide) is kept whole on rank 0.

With layer ranges (--pp) each range is a stage (`Stage`): its layers' shards are held by followers of its own,
and its sharded operations run over a group of those and rank 0 (group.stage_groups), so a follower loads and
computes only its stage's part; rank 0's `Sharding` holds the stages and goes down with a rank of any of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from dsflash.checkpoint.reader import Checkpoint
from dsflash.config import ConfigError, ModelArgs
from dsflash.kernels import Kernels
from dsflash.kernels.cpu import Weight
from dsflash.model.attention import head_outputs
from dsflash.model.expert_cache import ExpertStore
from dsflash.model.moe import pair_products, store_products
from dsflash.model.rope import Rope
from dsflash.model.tiers import Tiers
from dsflash.model.weights import WeightLoader
from dsflash.numerics import BLOCK
from dsflash.parallel.group import Control, Group, RankLost

# the column-parallel linears by name ending (and the head by vocabulary)
SHARDED_LINEARS = (".attn.wq_a", ".attn.wkv", ".shared_experts.w1", ".shared_experts.w2", ".shared_experts.w3")
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


def expert_share(args: ModelArgs, world: int) -> int:
    """An expert-parallel rank's default expert-cache slots: its share of one backbone layer's bank."""
    return -(-args.n_routed_experts // world)


def shard_rows(out: int, world: int, rank: int) -> slice | None:
    """Rank `rank`'s output rows of a column-parallel weight with `out` rows: equal shards of whole 32-row
    blocks (FP8's scale tiles), or None when `out` does not split so (the weight stays whole on rank 0)."""
    if out % (BLOCK * world):
        return None
    size = out // world
    return slice(rank * size, (rank + 1) * size)


def column_parallel(name: str, out: int, world: int) -> bool:
    """Whether the linear `name` (a checkpoint prefix, `out` output rows) is split by output rows over `world`
    ranks as a `LinearShard`: one of `SHARDED_LINEARS` or the head, in whole 32-row blocks a rank."""
    return (name == HEAD or name.endswith(SHARDED_LINEARS)) and shard_rows(out, world, 0) is not None


_HEAD_TENSORS = (".attn.wq_b.weight", ".attn.wq_b.scale", ".attn.attn_sink", ".attn.wo_a.weight",
                 ".attn.wo_b.weight", ".attn.wo_b.scale")


def split_by_rows(name: str, weight_rows: int, args: ModelArgs, layout: Layout) -> bool:
    """Whether checkpoint tensor `name` is split over the ranks by its first dimension, each holding an equal
    part (an `AttentionShard`'s or `LinearShard`'s tensors; `weight_rows`: the output rows of the linear it
    belongs to). Any other tensor is held whole: a routed expert by its `expert_range` rank under expert
    parallelism, everything else by rank 0. What `dsflash plan` counts per rank (engine/plan.py)."""
    if layout.tp == 1:
        return False
    if name.endswith(_HEAD_TENSORS):
        return splits_heads(args, layout.world)
    base, _, leaf = name.rpartition(".")
    return leaf in ("weight", "scale") and column_parallel(base, weight_rows, layout.world)


def stored_bytes(w: WeightLoader, name: str) -> int:
    """The checkpoint's bytes of linear `name` (its weight and, FP8/FP4, its scales)."""
    return sum(w.raw(name + leaf).nbytes for leaf in (".weight", ".scale") if w.has(name + leaf))


class LinearShard:
    """A column-parallel linear's rows on one rank: x [N, in] -> its [N, out / world] outputs. `nbytes`: the
    checkpoint's bytes of the rows it holds (what `dsflash plan` counts)."""

    def __init__(self, w: WeightLoader, name: str, widen: bool, rank: int, world: int):
        self.k = w.k
        self.out = w.raw(name + ".weight").size(0)
        self.weight = w.linear(name, widen, shard_rows(self.out, world, rank))
        self.weight.k_range_out = self.out  # each output sums its K blocks as the whole weight's GEMM does
        self.nbytes = stored_bytes(w, name) * self.weight.out_features // self.out

    def local(self, x: torch.Tensor) -> torch.Tensor:
        return self.k.linear(x, self.weight)

    def combine(self, parts: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.cat(parts, dim=-1)


class ExpertShard:
    """One MoE layer's routed experts of one rank (`expert_range`): the products of the (row, pick) pairs routed
    to them, padded to the busiest rank's pair count (every rank computes every rank's count from the ids).
    With the loader's expert store (`--experts host|disk`) the range lives in this rank's store and runs from
    its device slots (`store_products`), as one device's tiered experts do."""

    def __init__(self, w: WeightLoader, name: str, layer: int, n: int, topk: int, limit: float, rank: int,
                 world: int):
        if n < world:
            raise ConfigError(f"--ep {world}: {name} has {n} routed experts; --ep must not exceed the expert count")
        self.k, self.topk, self.limit, self.rank, self.world = w.k, topk, limit, rank, world
        self.layer, self.store = layer, w.experts
        self.experts = expert_range(n, world, rank)
        self.bounds = torch.tensor([expert_range(n, world, r).start for r in range(1, world)], device=w.k.device)
        if self.store is not None:
            self.store.register(layer, w, f"{name}experts.", len(self.experts), self.experts.start)
            self.nbytes = 0  # on the host or disk tier: none of the checkpoint's bytes on the device
            return
        self.w13 = self.k.expert_bank([w.linear(f"{name}experts.{e}.{p}") for p in ("w1", "w3") for e in self.experts])
        self.w2 = self.k.expert_bank([w.linear(f"{name}experts.{e}.w2") for e in self.experts])
        self.nbytes = sum(stored_bytes(w, f"{name}experts.{e}.{p}") for e in self.experts for p in ("w1", "w2", "w3"))

    def owners(self, ids: torch.Tensor) -> torch.Tensor:
        """The rank holding each pick's expert, over the flattened picks."""
        return torch.bucketize(ids.flatten(), self.bounds, right=True)

    def local(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        owners = self.owners(ids)
        width = int(torch.bincount(owners, minlength=self.world).max())
        pairs = torch.nonzero(owners == self.rank).flatten()
        out = x.new_zeros(width, x.size(1))
        if pairs.numel():
            local = ids.flatten()[pairs] - self.experts.start
            out[: pairs.numel()] = (
                store_products(self.k, self.store, self.layer, x, weights, pairs, local, len(self.experts), self.topk,
                               self.limit) if self.store is not None else
                pair_products(self.k, x, weights, pairs, local, self.w13, self.w2, len(self.experts), self.topk,
                              self.limit))
        return out

    def combine(self, parts: list[torch.Tensor], x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                ) -> torch.Tensor:
        """Every pair's product at its (row, slot): [N, k, D], slots in the ids' order (ascending expert id)."""
        owners = self.owners(ids)
        routed = x.new_empty(ids.numel(), x.size(1))
        for rank, part in enumerate(parts):
            pairs = torch.nonzero(owners == rank).flatten()
            routed[pairs] = part[: pairs.numel()]
        return routed.view(*ids.shape, x.size(1))


def splits_heads(args: ModelArgs, world: int) -> bool:
    """Whether attention splits by heads over `world` ranks: whole heads and `wo_a` groups a rank, and q and
    `wo_b` rows in whole 32-row blocks (else each attention layer stays whole on rank 0)."""
    return (args.n_heads % world == 0 and args.o_groups % world == 0
            and shard_rows(args.n_heads * args.head_dim, world, 0) is not None
            and shard_rows(args.dim, world, 0) is not None)


class AttentionShard:
    """One attention layer's heads on one rank (the rank-th n_heads / world of them): their q rows of `wq_b`,
    their sinks, the `wo_a` groups they make up and `wo_b`'s rank-th rows. (q LoRA latent, source rows,
    indices, positions) -> its `wo_b` columns [N, dim / world], the heads of every rank gathered in between."""

    def __init__(self, w: WeightLoader, prefix: str, rope: Rope, group: Group):
        a = w.ckpt.args
        self.k, self.rope, self.group, self.head_dim = w.k, rope, group, a.head_dim
        rank, world = group.rank, group.world
        heads, groups = a.n_heads // world, a.o_groups // world
        self.wq_b = LinearShard(w, prefix + "wq_b", False, rank, world)
        self.sink = w.raw(prefix + "attn_sink")[rank * heads:(rank + 1) * heads].to(w.k.device, torch.float32)
        wo_a = w.raw(prefix + "wo_a.weight").view(a.o_groups, a.o_lora_rank, -1)
        self.wo_a = wo_a[rank * groups:(rank + 1) * groups].to(w.k.device)
        self.wo_b = LinearShard(w, prefix + "wo_b", False, rank, world)
        self.nbytes = (self.wq_b.nbytes + self.wo_b.nbytes + self.sink.numel() * w.raw(prefix + "attn_sink").itemsize
                       + self.wo_a.nbytes)  # the sinks stored in fp32, wo_a in bf16, as held

    def local(self, qr: torch.Tensor, source: torch.Tensor, idx: torch.Tensor, positions: torch.Tensor
              ) -> torch.Tensor:
        self.rope.reserve(int(positions.max()) + 1, positions.device)  # a follower's table grows here
        o = head_outputs(self.k, self.rope, qr, source, idx, positions, self.wq_b.weight, self.sink, self.wo_a,
                         self.head_dim)
        # every rank's groups, in group order: the whole `wo_b` input on every rank
        return self.wo_b.local(torch.cat(self.group.all_gather(o), dim=1).flatten(1))

    def combine(self, parts: list[torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        return torch.cat(parts, dim=-1)


Shard = LinearShard | ExpertShard | AttentionShard


def load_shard(spec: dict, w: WeightLoader, group: Group, ropes: Callable[[bool], Rope]) -> Shard:
    """The shard a load message names, read from the checkpoint (this rank's rows, heads or experts only).
    `ropes(compressed)`: the rotary table an attention shard rotates by."""
    if spec["kind"] == "linear":
        return LinearShard(w, spec["name"], spec["widen"], group.rank, group.world)
    if spec["kind"] == "attention":
        return AttentionShard(w, spec["name"], ropes(spec["compressed"]), group)
    n, topk = w.ckpt.args.moe_experts(spec["layer"])
    return ExpertShard(w, spec["name"], spec["layer"], n, topk, w.ckpt.args.swiglu_limit, group.rank, group.world)


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


class Stage:
    """Rank 0's side of one stage (a layer range, or the whole half): the stage's group -- rank 0 and the
    followers holding this range's shards -- a control line per follower, the shards rank 0 holds and
    registers with the followers as the range's layers load (`linear_weight`, `attention`, `experts`: the
    loader's `Shards`), and `run`, one sharded operation over the group. `down()`: the whole layout's loss."""

    def __init__(self, layout: Layout, layers: range | None, group: Group, controls: Sequence[Control],
                 down: Callable[[], None]):
        self.layout, self.layers, self.group, self.controls = layout, layers, group, list(controls)
        self._down = down
        self.shards: dict[str, Shard] = {}
        self.held: list[int] = []  # the checkpoint bytes each of the stage's ranks holds, once `ready`
        self.caches: list[int] = []  # the expert-cache bytes of each follower (rank 1 on), once `ready`

    def _load(self, spec: dict, w: WeightLoader, rope: Rope | None = None) -> Shard:
        self._send({"load": spec})
        shard = self.shards[spec["name"]] = load_shard(spec, w, self.group, lambda compressed: rope)
        return shard

    def linear_weight(self, w: WeightLoader, name: str, widen: bool) -> Weight | None:
        """The column-parallel weight `name` as rank 0 holds it, or None where it is not sharded."""
        if self.layout.tp == 1 or not (name == HEAD or name.endswith(SHARDED_LINEARS)):  # read no other header
            return None
        if not column_parallel(name, w.raw(name + ".weight").size(0), self.layout.world):
            return None
        return ShardedWeight(name, self._load({"kind": "linear", "name": name, "widen": widen}, w))

    def attention(self, w: WeightLoader, prefix: str, rope: Rope
                  ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """The attention layer at `prefix`'s heads over the group: (q LoRA latent, source rows, indices,
        positions) -> the sub-layer's output [N, dim]; None where attention is not split (`splits_heads`)."""
        if self.layout.tp == 1 or not splits_heads(w.ckpt.args, self.layout.world):
            return None
        self._load({"kind": "attention", "name": prefix, "compressed": rope.compressed}, w, rope)
        return lambda qr, source, idx, positions: self.run(prefix, qr, source, idx, positions)

    def experts(self, w: WeightLoader, name: str, layer: int
                ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """The MoE layer at `name`'s routed experts over the group: (x, weights, ids ascending) -> the pairs'
        products [N, k, D]; None without expert parallelism."""
        if self.layout.ep == 1:
            return None
        spec = {"kind": "experts", "name": name, "layer": layer}
        if w.experts is not None:  # off the device: each rank keeps its range in a store of its own
            spec["tiers"] = {"experts": w.experts.tier, "expert_cache": w.experts.cache_bytes}
        self._load(spec, w)
        return lambda x, weights, ids: self.run(name, x, weights, ids)

    def kernels(self, k: Kernels) -> Kernels:
        """k with a `linear` that runs a ShardedWeight over the group (any other weight as before)."""
        base = k.linear

        def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
            return self.run(w.name, x) if isinstance(w, ShardedWeight) else base(x, w)

        return replace(k, linear=linear)

    def ready(self, timeout_s: float | None) -> None:
        """Wait until the stage's followers have loaded its shards (`Sharding.ready`)."""
        self._send({"ready": len(self.shards)})
        self.held, self.caches = [sum(shard.nbytes for shard in self.shards.values())], []
        for rank, control in enumerate(self.controls, 1):
            answer = self._guard(lambda c=control: c.recv(timeout_s))
            if not isinstance(answer, dict) or answer.get("loaded") != len(self.shards):
                self._down()
                raise RankLost(f"rank {rank} of the stage did not load its shards (it answered {answer!r})")
            self.held.append(answer["bytes"])
            self.caches.append(answer["cache"])

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


class Sharding:
    """Rank 0's side of a parallel layout: its world (every rank of every stage), one `Stage` per layer range
    (rank 0 is in every stage's group; each follower in one), and the layout's health. A rank lost in any
    stage takes the whole layout down: every stage's later calls raise `RankLost`. `stages`: (layers or None
    for the whole half, the stage's group, its followers' control lines), in layer order."""

    def __init__(self, layout: Layout, world: Group, stages: Sequence[tuple[range | None, Group, Sequence[Control]]],
                 stop_followers: Callable[[bool], None] = lambda graceful: None):
        self.layout, self.world = layout, world
        self.stop_followers = stop_followers  # (graceful) -> None: the processes rank 0 started, if any
        self.stages = [Stage(layout, layers, group, controls, self._down) for layers, group, controls in stages]

    def stage(self, layers: range) -> Stage:
        """The stage whose ranks serve `layers` (a model's layer range, within one stage's)."""
        for st in self.stages:
            if st.layers is None or (layers.start in st.layers and layers[-1] in st.layers):
                return st
        raise ValueError(f"layers {layers.start}-{layers[-1]} are not within one stage of the layout "
                         f"({', '.join(f'{st.layers.start}-{st.layers[-1]}' for st in self.stages)})")

    @property
    def shards(self) -> dict[str, Shard]:
        """Every shard rank 0 holds, by name, over the stages."""
        return {name: shard for st in self.stages for name, shard in st.shards.items()}

    @property
    def held(self) -> list[int]:
        """The checkpoint bytes each rank holds, once `ready`: rank 0's (every stage's part), then each
        follower's, in rank order."""
        return [sum(st.held[0] for st in self.stages), *(n for st in self.stages for n in st.held[1:])]

    @property
    def lost(self) -> str | None:
        """Why the layout went down (a rank was lost), or None while it is up: a health check's answer."""
        return next((st.group.lost for st in self.stages if st.group.lost is not None), None)

    def ready(self, timeout_s: float | None = None) -> None:
        """Wait until every follower has loaded its shards (a follower's load error surfaces here); each
        says the checkpoint bytes it holds (`held`; `Stage.held` by stage)."""
        for st in self.stages:
            st.ready(timeout_s)

    def _down(self) -> None:
        """A rank is lost: every stage is down, the other ranks stopped too (no rank waits on a collective
        forever)."""
        why = self.lost or "a rank was lost"
        for st in self.stages:
            if st.group.lost is None:
                st.group.lost = why
            for control in st.controls:
                control.close()
        self.stop_followers(False)

    def close(self) -> None:
        """Followers see their control line close and exit; then the groups are taken down."""
        for st in self.stages:
            for control in st.controls:
                control.close()
        self.stop_followers(self.lost is None)
        for st in self.stages:
            if st.group is not self.world:
                st.group.close()
        self.world.close()


def follow(group: Group, control: Control, ckpt: Checkpoint, k: Kernels) -> None:
    """A follower rank: load the shards rank 0 names and compute its part of each operation rank 0 runs, until
    rank 0 closes the control line (RankLost when the group fails under it)."""
    w = WeightLoader(ckpt, k)
    shards: dict[str, Shard] = {}
    ropes = {compressed: Rope(ckpt.args, compressed, k) for compressed in (False, True)}  # one a variant, as rank 0
    while (msg := control.recv()) is not None:
        if "load" in msg:
            tiers = msg["load"].get("tiers")
            if tiers is not None and w.experts is None:  # rank 0's experts are off its device: these too
                w.experts = ExpertStore(k, ckpt, Tiers(experts=tiers["experts"], expert_cache=tiers["expert_cache"]),
                                        ckpt.args, expert_share(ckpt.args, group.world))
            shards[msg["load"]["name"]] = load_shard(msg["load"], w, group, ropes.__getitem__)
        elif "ready" in msg:  # what this rank holds: its shards' checkpoint bytes, its expert cache's
            cache = w.experts.slots * w.experts.slot_bytes if w.experts is not None else 0
            control.send({"loaded": len(shards), "bytes": sum(shard.nbytes for shard in shards.values()),
                          "cache": cache})
        else:
            inputs = [group.broadcast(torch.empty(shape, dtype=getattr(torch, dtype), device=group.device))
                      for shape, dtype in msg["inputs"]]
            group.all_gather(shards[msg["run"]].local(*inputs))
