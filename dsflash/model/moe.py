"""Mixture of experts (spec §7): sqrt-softplus router in fp32, top-k by biased score, weights from the
unbiased scores (normalised, x route_scale), SwiGLU experts with clamps, routing weight applied before
`w2`, experts summed in ascending id order in fp32, plus the shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsflash.config import ModelArgs
from dsflash.kernels.cpu import Weight
from dsflash.model.attention import topk_lowest_index
from dsflash.model.common import Chunk
from dsflash.model.weights import WeightLoader


class Expert:
    def __init__(self, w: WeightLoader, prefix: str, swiglu_limit: float):
        self.k = w.k
        self.w1: Weight = w.linear(prefix + "w1")
        self.w2: Weight = w.linear(prefix + "w2")
        self.w3: Weight = w.linear(prefix + "w3")
        self.limit = swiglu_limit

    def __call__(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        gate = self.k.linear(x, self.w1).float()
        up = self.k.linear(x, self.w3).float()
        if self.limit > 0:
            up = torch.clamp(up, min=-self.limit, max=self.limit)
            gate = torch.clamp(gate, max=self.limit)
        h = F.silu(gate) * up
        if weights is not None:
            h = weights * h
        return self.k.linear(h.to(x.dtype), self.w2)


class MoE:
    def __init__(self, args: ModelArgs, layer: int, w: WeightLoader, prefix: str):
        self.k = w.k
        self.layer = layer
        self.n_experts, self.topk = args.moe_experts(layer)
        self.args = args
        self.gate = w.linear(prefix + "gate", widen=True)  # the router runs in fp32
        self.gate_bias = w.tensor(prefix + "gate.bias").float()
        self.gate_bias_vl = w.tensor(prefix + "gate.bias_vl").float() if w.has(prefix + "gate.bias_vl") else None
        self.experts = [Expert(w, f"{prefix}experts.{e}.", args.swiglu_limit) for e in range(self.n_experts)]
        self.shared = Expert(w, prefix + "shared_experts.", args.swiglu_limit)

    def route(self, x: torch.Tensor, chunk: Chunk | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k] fp32, expert ids [N, k]); ids forced when the chunk carries selections."""
        a = self.args
        scores = self.k.linear(x.float(), self.gate) / a.gate_temp
        if a.score_func == "softmax":
            scores = scores.softmax(dim=-1)
        elif a.score_func == "sigmoid":
            scores = scores.sigmoid()
        else:
            scores = F.softplus(scores).sqrt()
        bias = self.gate_bias
        if chunk is not None and chunk.image_mask is not None and self.gate_bias_vl is not None:
            bias = torch.where(chunk.image_mask.unsqueeze(-1), self.gate_bias_vl, bias)
        ids = topk_lowest_index(scores + bias, self.topk)
        if chunk is not None and chunk.select is not None:
            forced = chunk.select.rows(chunk.select.moe_ids, self.layer, chunk.positions[: chunk.n])
            if forced is not None:
                ids[: chunk.n] = forced
        weights = scores.gather(1, ids)
        if a.norm_topk_prob and self.topk > 1:
            weights /= self.k.small_sum(weights, -1).unsqueeze(-1) + 1e-20
        weights *= a.route_scale
        return weights, ids

    def __call__(self, x: torch.Tensor, chunk: Chunk | None) -> torch.Tensor:
        weights, ids = self.route(x, chunk)
        if chunk is not None and chunk.trace is not None:
            chunk.trace.setdefault("moe_ids", {})[self.layer] = ids[: chunk.n]
        y = torch.zeros_like(x, dtype=torch.float32)
        # (row, slot) pairs grouped by expert, rows ascending inside each group (a stable sort of the flat
        # picks), with one host read of the group sizes instead of one per expert
        flat = ids.flatten()
        order = torch.sort(flat, stable=True).indices
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        start = 0
        for e, count in enumerate(counts):  # ascending expert id: the summation order of the reference
            if count:
                pairs = order[start:start + count]
                rows, slot = pairs // self.topk, pairs % self.topk
                y[rows] += self.experts[e](x[rows], weights[rows, slot, None])
                start += count
        y += self.shared(x)
        return y.to(x.dtype)
