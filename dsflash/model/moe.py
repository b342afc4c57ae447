"""Mixture of experts (spec §7): sqrt-softplus router in fp32, top-k by biased score, weights from the
unbiased scores (normalised, x route_scale), SwiGLU experts with clamps, routing weight applied before
`w2`, experts summed in ascending id order in fp32, plus the shared expert."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from dsflash.config import ModelArgs
from dsflash.kernels import Kernels
from dsflash.kernels.cpu import Weight, topk_lowest_index
from dsflash.model.common import Chunk
from dsflash.model.weights import WeightLoader
from dsflash.numerics import exact_div

if TYPE_CHECKING:
    from dsflash.model.expert_cache import ExpertStore


class Gate:
    """MoE gating: the router's scores in fp32 from x / gate_temp; the correction bias (a separate one for
    image-span rows, `bias_vl`) picks the top-k experts but does not scale them: their weights come from
    the unbiased scores, normalised over the picks and times route_scale."""

    def __init__(self, args: ModelArgs, layer: int, w: WeightLoader, prefix: str):
        self.k = w.k
        self.layer, self.args = layer, args
        self.n_experts, self.topk = args.moe_experts(layer)
        self.weight = w.linear(prefix, widen=True)  # the router runs in fp32
        self.bias = w.tensor(prefix + ".bias").float()
        self.bias_vl = w.tensor(prefix + ".bias_vl").float() if w.has(prefix + ".bias_vl") else None

    def __call__(self, x: torch.Tensor, chunk: Chunk | None, ascending: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k] fp32, expert ids [N, k]) in the router's order, or by ascending id (the routed
        experts' summation order); ids forced when the chunk carries selections."""
        logits = self.k.linear(x, self.weight)  # fp32 router: x widens in the GEMM
        bias = self.bias
        if chunk is not None and chunk.image_mask is not None and self.bias_vl is not None:
            bias = torch.where(chunk.image_mask.unsqueeze(-1), self.bias_vl, bias)
        forced = forced_weights = None
        if chunk is not None and chunk.select is not None:
            forced = chunk.select.rows(chunk.select.moe_ids, self.layer, chunk.positions[: chunk.n])
            forced_weights = chunk.select.rows(chunk.select.moe_weights, self.layer, chunk.positions[: chunk.n])
        if forced is None:
            return self.route(logits, bias, ascending=ascending)
        _, ids = self.route(logits, bias)
        ids[: chunk.n] = forced
        if forced_weights is None:
            return self.route(logits, bias, ids, ascending)
        weights, ids = self.route(logits, bias, ids)  # the router's order, as the forced weights are
        weights[: chunk.n] = forced_weights
        return by_id(weights, ids) if ascending else (weights, ids)

    def route(self, logits: torch.Tensor, bias: torch.Tensor, ids: torch.Tensor | None = None,
              ascending: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.args
        return route(self.k, logits, bias, self.topk, a.score_func, a.gate_temp, a.norm_topk_prob, a.route_scale,
                     ids, ascending)


def route(k: Kernels, logits: torch.Tensor, bias: torch.Tensor, topk: int, score_func: str, temp: float, norm: bool,
          scale: float, ids: torch.Tensor | None = None, ascending: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The router from the gate's fp32 logits [N, E]: (weights fp32 [N, topk], expert ids [N, topk]).
    Scores = score_func(logits / temp); the ids are the top-k of scores + bias (bias [E], or [N, E] for image
    rows) in descending order, the lowest id first among equal ones, unless `ids` are given; the weights are
    the picks' unbiased scores, divided by their sum in that order (the backend's small_sum) when `norm` and
    topk > 1, times `scale`. `ascending`: both reordered by id at the end (the routed experts' summation
    order). `k.moe_route`, where the backend has it, is one kernel with these bits (None where it does not
    apply)."""
    fused = k.moe_route and k.moe_route(logits, bias, topk, score_func, temp, norm, scale, ids, ascending)
    if fused is not None:
        return fused
    scores = exact_div(logits, temp)
    if score_func == "softmax":
        scores = scores.softmax(dim=-1)
    elif score_func == "sigmoid":
        scores = scores.sigmoid()
    else:
        scores = F.softplus(scores).sqrt()
    if ids is None:
        ids = topk_lowest_index(scores + bias, topk)
    weights = scores.gather(1, ids)
    if norm and topk > 1:
        weights /= k.small_sum(weights, -1).unsqueeze(-1) + 1e-20  # not norm_eps: as in training
    weights *= scale
    return by_id(weights, ids) if ascending else (weights, ids)


def by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) [N, k] reordered by ascending expert id (the routed experts' summation order)."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


def pair_products(k: Kernels, x: torch.Tensor, weights: torch.Tensor, pairs: torch.Tensor, entries: torch.Tensor,
                  w13, w2, n: int, topk: int, limit: float) -> torch.Tensor:
    """The routed products of some (row, pick) pairs, one row per pair: `pairs` index the flattened picks of
    x's rows (topk a row), `entries` their bank entries (w13 holding w1 at entry i and w3 at n + i), `weights`
    [N, topk] the routing weights, applied before w2. bf16 [pairs, D]; a pair's bits do not depend on the
    others in the call (kernels/cpu.py on batch invariance)."""
    gate_up = k.expert_linear(x[pairs // topk], w13, torch.stack([entries, entries + n], 1), 2)
    gate_up = gate_up.view(pairs.numel(), 2, -1)
    h = k.swiglu(gate_up[:, 0], gate_up[:, 1], limit, weights.flatten()[pairs, None])
    return k.expert_linear(h, w2, entries, 1)


def store_products(k: Kernels, store: ExpertStore, layer: int, x: torch.Tensor, weights: torch.Tensor,
                   pairs: torch.Tensor, experts: torch.Tensor, n: int, topk: int, limit: float,
                   groups: tuple[list[list[int]], bool] | None = None) -> torch.Tensor:
    """pair_products of some (row, pick) pairs whose experts (`experts`, the store's ids of `layer`, one a pair;
    the layer holding `n` there) live in the expert store: group by group (`ExpertStore.groups`), each group's
    experts acquired into the device slots and its pairs run from them, the next group read ahead. bf16
    [pairs, D] in the pairs' order, each pair's bits its resident product's. `groups`: `store.groups`'s answer
    for these experts when the caller has it."""
    groups, wide = groups or store.groups(experts, n)
    out = x.new_empty(pairs.numel(), x.size(1))
    for g, group in enumerate(groups):
        slot = store.acquire(layer, group, groups[g + 1] if g + 1 < len(groups) else None, wide)[experts]
        mine = torch.nonzero(slot >= 0).flatten()
        out[mine] = pair_products(k, x, weights, pairs[mine], slot[mine], store.w13, store.w2, store.slots, topk,
                                  limit)
    return out


class Expert:
    def __init__(self, k: Kernels, w1: Weight, w2: Weight, w3: Weight, swiglu_limit: float):
        self.k = k
        self.w1, self.w2, self.w3 = w1, w2, w3
        self.limit = swiglu_limit

    @classmethod
    def load(cls, w: WeightLoader, prefix: str, swiglu_limit: float) -> Expert:
        return cls(w.k, w.linear(prefix + "w1"), w.linear(prefix + "w2"), w.linear(prefix + "w3"), swiglu_limit)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        gate = self.k.linear(x, self.w1)
        up = self.k.linear(x, self.w3)
        return self.k.linear(self.k.swiglu(gate, up, self.limit, weights), self.w2)


class MoE:
    def __init__(self, args: ModelArgs, layer: int, w: WeightLoader, prefix: str):
        self.k = w.k
        self.layer = layer
        self.n_experts, self.topk = args.moe_experts(layer)
        self.args = args
        self.gate = Gate(args, layer, w, prefix + "gate")
        # the routed experts' weights as two banks (w1 then w3 of every expert, and w2), so a step's gate
        # and up products are one launch; an expert's weights are views into them. Experts on the host or
        # disk tier live in the model's expert store instead, run from its device cache of slots
        n = self.n_experts
        self.store = w.experts
        # expert parallelism: this rank holds a range of the experts, the others theirs (model/parallel.py)
        self.ep = w.parallel.experts(w, prefix, layer) if w.parallel is not None else None
        # with expert parallelism the shard holds this rank's range (in the store when off the device)
        if self.ep is None and self.store is not None:
            self.store.register(layer, w, f"{prefix}experts.", n)
        elif self.ep is None:
            self.w13 = self.k.expert_bank([w.linear(f"{prefix}experts.{e}.{name}") for name in ("w1", "w3")
                                           for e in range(n)])
            self.w2 = self.k.expert_bank([w.linear(f"{prefix}experts.{e}.w2") for e in range(n)])
            self.experts = [Expert(self.k, self.w13[e], self.w2[e], self.w13[n + e], args.swiglu_limit)
                            for e in range(n)]
        self.shared = Expert.load(w, prefix + "shared_experts.", args.swiglu_limit)

    def __call__(self, x: torch.Tensor, chunk: Chunk | None) -> torch.Tensor:
        weights, ids = self.gate(x, chunk, ascending=True)
        if chunk is not None and chunk.trace is not None:  # debugging: the router's own order, routed again
            traced_weights, traced_ids = self.gate(x, chunk)
            chunk.trace.setdefault("moe_ids", {})[self.layer] = traced_ids[: chunk.n]
            chunk.trace.setdefault("moe_weights", {})[self.layer] = traced_weights[: chunk.n]
        if self.ep is not None:  # every pair's product from its expert's rank, summed here in ascending id
            return self.k.moe_sum(self.ep(x, weights, ids), self.shared(x))
        if self.store is not None:
            return self._routed_from_cache(x, weights, ids)
        if x.size(0) <= self.k.slot_moe_rows:
            return self._routed_by_slot(x, weights, ids, self.w13, self.w2, self.n_experts)
        y = self._routed_by_expert(x, weights, ids)
        y += self.shared(x)
        return y.to(x.dtype)

    def route(self, x: torch.Tensor, chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing alone (weights, expert ids by ascending id): where a forward replayed in segments stops
        to load the experts into the store's slots (`ExpertStore.slots_for`), then resumes with `from_slots`."""
        return self.gate(x, chunk, ascending=True)

    def from_slots(self, x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The MoE's output with the routed experts run from the expert store's slots (`slots`: the routing ids
        remapped to them, all resident)."""
        store = self.store
        return self._routed_by_slot(x, weights, slots, store.w13, store.w2, store.slots)

    def _routed_by_slot(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13, w2, n: int
                        ) -> torch.Tensor:
        """Every (row, slot) pair in two expert_linear calls (gate and up together, then down), with no host
        read of the routing, and the shared expert. Each row's slots come in ascending expert id, the
        reference's summation order. `ids` index the banks w13 (w1 at entry i, w3 at n + i) and w2: the
        layer's own (expert ids) or the expert cache's (slots). The shared expert is forked beside the routed
        ones (`Kernels.fork`, lane 1: on CUDA a side stream beside the FFN site's mixes too), which it does not
        depend on."""
        shared = self.k.fork(self.shared, x, lane=1)
        # per row: its k gate slots (w1 of each expert), then its k up slots (w3: bank entries n + id)
        gate_up = self.k.expert_linear(x, w13, torch.cat([ids, ids + n], 1), 2 * self.topk)
        gate_up = gate_up.view(ids.size(0), 2, self.topk, -1)
        h = self.k.swiglu(gate_up[:, 0], gate_up[:, 1], self.args.swiglu_limit, weights.unsqueeze(-1))
        routed = self.k.expert_linear(h.view(ids.numel(), -1), w2, ids, 1).view(*ids.shape, -1)
        self.k.join(1)
        return self.k.moe_sum(routed, shared)

    def _routed_from_cache(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts from the expert store's device slots (model/expert_cache.py), ids remapped
        expert -> slot on the device. When the used experts fit in one group: `_routed_by_slot` over the slots,
        the resident calls with other addresses. Otherwise group by group, each group's (row, slot) pairs
        gathered into calls of their own (one row per pair: a row's products do not depend on the others in
        the call, on either backend), their rows put back in place, then one sum in slot order: the
        resident bits (the reference's per-expert loop adds each row's experts in the same ascending order)."""
        store = self.store
        groups, wide = planned = store.groups(ids, self.n_experts)
        if len(groups) == 1:
            return self.from_slots(x, weights, store.acquire(self.layer, groups[0], wide=wide)[ids])
        routed = store_products(self.k, store, self.layer, x, weights, torch.arange(ids.numel(), device=ids.device),
                                ids.flatten(), self.n_experts, self.topk, self.args.swiglu_limit, planned)
        return self.k.moe_sum(routed.view(*ids.shape, -1), self.shared(x))

    def _routed_by_expert(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each used expert over its rows, experts in ascending id (the reference's summation order)."""
        y = torch.zeros_like(x, dtype=torch.float32)
        # (row, slot) pairs grouped by expert, rows ascending inside each group (a stable sort of the flat
        # picks), with one host read of the group sizes instead of one per expert
        flat = ids.flatten()
        order = torch.sort(flat, stable=True).indices
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        start = 0
        for e, count in enumerate(counts):
            if count:
                pairs = order[start:start + count]
                rows, slot = pairs // self.topk, pairs % self.topk
                y[rows] += self.experts[e](x[rows], weights[rows, slot, None])
                start += count
        return y
