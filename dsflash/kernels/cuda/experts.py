"""Routed experts: one projection of all experts stacked in a bank, and one launch for every (row, slot)
pair of a step (per-expert tiles for a prefill's many slots), with no host read of the routing."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from dsflash.kernels.cpu import Weight

from .configs import (
    EXPERT_TILE_MIN_SLOTS,
    EXPERT_WIDEN_BYTES,
    EXPERT_WIDEN_MIN_SLOTS,
    LinearConfig,
    dequant_gemm_config,
    linear_config,
)
from .gemm import block_scaled_gemm, dequant_act, dequantised_gemm
from .weights import CudaWeight, dequant_weight, to_cuda_weight


@dataclass
class ExpertBank:
    """One projection (w1, w2 or w3) of all routed experts, stacked: `values` [E, out, ...] and `scale`
    [E, ...] in CudaWeight's layout. `bank[e]` is expert e's CudaWeight, a view (no copy)."""

    kind: str
    values: torch.Tensor
    scale: torch.Tensor
    scale_rows: int

    def __getitem__(self, e: int) -> CudaWeight:
        return CudaWeight(self.kind, self.values[e], self.scale[e], self.scale_rows)

    @property
    def scale_e8m0(self) -> bool:
        return self.scale.dtype == torch.int32


def expert_bank(weights: list[Weight]) -> ExpertBank:
    """Stack the experts' weights of one projection (fp8/fp4 of one shape and scale layout)."""
    ws = [w if isinstance(w, CudaWeight) else to_cuda_weight(w) for w in weights]
    first = ws[0]
    for w in ws:
        if (w.kind, w.values.shape, w.scale.shape, w.scale.dtype, w.scale_rows) != (
                first.kind, first.values.shape, first.scale.shape, first.scale.dtype, first.scale_rows):
            raise ValueError("routed experts of one layer differ in kind, shape or scale layout")
    return ExpertBank(first.kind, torch.stack([w.values for w in ws]), torch.stack([w.scale for w in ws]),
                      first.scale_rows)


def expert_slots(like: CudaWeight, count: int, pinned: bool = False) -> ExpertBank:
    """An uninitialised bank of `count` weights shaped like `like` (an expert cache's slots), on its device
    or, `pinned`, in pinned host memory (the host tier's experts, copied to the slots by DMA)."""
    where = {"device": "cpu", "pin_memory": True} if pinned else {"device": like.values.device}
    return ExpertBank(like.kind, torch.empty((count, *like.values.shape), dtype=like.values.dtype, **where),
                      torch.empty((count, *like.scale.shape), dtype=like.scale.dtype, **where), like.scale_rows)


def expert_put(bank: ExpertBank, i: int, w: CudaWeight) -> None:
    """Copy w into entry i, asynchronously on the current stream (from pinned memory: a DMA)."""
    if (w.kind, w.values.shape, w.scale.shape, w.scale.dtype, w.scale_rows) != (
            bank.kind, bank.values.shape[1:], bank.scale.shape[1:], bank.scale.dtype, bank.scale_rows):
        raise ValueError("an expert's weight differs in kind, shape or scale layout from its bank's")
    bank.values[i].copy_(w.values, non_blocking=True)
    bank.scale[i].copy_(w.scale, non_blocking=True)


def expert_linear(x: torch.Tensor, bank: ExpertBank, experts: torch.Tensor, slots_per_row: int, *,
                  spread: bool | None = None, config: LinearConfig | None = None,
                  preconvert: bool | None = None) -> torch.Tensor:
    """Routed-expert GEMM over slots: row s of the result is x[s // slots_per_row] @ W_{experts[s]}^T,
    bf16 [len(experts), out], each row's bits those of `linear(x[row:row+1], bank[experts[s]])`. One launch
    whatever the routing (per group of experts for a prefill's dequantised bank), with no host read of it (a
    step stays capturable in a CUDA graph). `spread`, `config` and `preconvert` (tests, benchmarks) override
    three choices that never change bits: the K ranges as separate programs, the tile config, and a prefill's
    bank and activation dequantised to bf16 before its tiles."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"{bank.kind} expert linear takes a bf16 activation, got {x.dtype}")
    if experts.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"expert ids are int32 or int64, got {experts.dtype}")
    slots = experts.reshape(-1).contiguous()  # read as they come: no conversion launch a call
    n = bank.values.size(1)
    y = torch.empty((slots.numel(), n), dtype=torch.bfloat16, device=x.device)
    if slots.numel() == 0:
        return y
    # Q8(x) as bf16 once a call, not in each of the thousands of slot programs (K ranges x weight tiles x slots)
    a = dequant_act(x.contiguous())
    if config is None and slots.numel() >= EXPERT_TILE_MIN_SLOTS:
        # a prefill's slots: each expert's slots share tiles (the same bits as one-row tiles, tested). The tiles
        # dequantise their operands in registers, in the MMA's issue slots; dequantised to bf16 in memory once per
        # call, 128-row tiles run at the tensor cores' rate where an expert has enough rows to pay for it
        # (EXPERT_WIDEN_MIN_SLOTS). A group of experts at a time bounds the scratch; each launch's other tiles
        # exit at once
        experts_n = bank.values.size(0)
        if preconvert is None:
            preconvert = slots.numel() >= EXPERT_WIDEN_MIN_SLOTS * experts_n
        if preconvert:
            order, tiles = _expert_tiles(slots, experts_n, dequant_gemm_config(n).BM)
            group = max(1, EXPERT_WIDEN_BYTES // (2 * n * x.size(1)))
            for lo in range(0, experts_n, group):
                hi = min(lo + group, experts_n)
                dequantised_gemm(a, _dequantised(bank, lo, hi), bank[lo], y, slots=order, slots_per_row=slots_per_row,
                                 tiles=tiles, experts=(lo, hi))
            return y
        cfg = linear_config(bank.kind, n, x.size(1))
        order, tiles = _expert_tiles(slots, experts_n, cfg.BM)
        block_scaled_gemm(a, a, bank.values, bank, y, fp4=bank.kind == "fp4", act="bf16", cfg=cfg, spread=False,
                          slots=order, slots_per_row=slots_per_row, tiles=tiles)
        return y
    cfg = config or linear_config(bank.kind, n, x.size(1), m=1)  # each slot is a one-row product
    block_scaled_gemm(a, a, bank.values, bank, y, fp4=bank.kind == "fp4", act="bf16", cfg=cfg, spread=spread,
                      slots=slots, slots_per_row=slots_per_row)
    return y


def _dequantised(bank: ExpertBank, lo: int, hi: int) -> torch.Tensor:
    """Experts lo .. hi - 1 of a bank dequantised to bf16 [hi - lo, out, in]: one dequantisation of their
    weights stacked along the output rows (each expert's scale rows stay its own: out is a multiple of
    scale_rows)."""
    n = bank.values.size(1)
    assert n % bank.scale_rows == 0, (n, bank.scale_rows)
    values = bank.values[lo:hi].flatten(0, 1)
    scale = bank.scale[lo:hi].transpose(0, 1).flatten(1)  # [K words, experts x scale rows]
    return dequant_weight(CudaWeight(bank.kind, values, scale, bank.scale_rows)).view(hi - lo, n, -1)


def _expert_tiles(slots: torch.Tensor, experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the slots' indices grouped by expert, ascending within an expert; int32 [tiles, 3] rows (expert,
    first, count): tile t takes order[first:first + count], count <= bm). Device ops only, no host read of the
    routing: the table has a bound's length, cdiv(slots, bm) + experts, its spare tiles count 0."""
    order = torch.sort(slots, stable=True).indices.to(torch.int32)
    # scatter_add, not bincount: bincount reads its input's maximum back to the host, which a CUDA graph
    # capture refuses (and would bake one step's routing into the graph)
    counts = torch.zeros(experts, dtype=torch.int64, device=slots.device).scatter_add_(
        0, slots.long(), torch.ones_like(slots, dtype=torch.int64))
    per_expert = (counts + bm - 1) // bm
    ends = torch.cumsum(per_expert, 0)
    t = torch.arange(triton.cdiv(slots.numel(), bm) + experts, device=slots.device)
    expert = torch.searchsorted(ends, t, right=True).clamp(max=experts - 1)
    local = t - (ends[expert] - per_expert[expert])
    first = torch.cumsum(counts, 0)[expert] - counts[expert] + local * bm
    count = (counts[expert] - local * bm).clamp(0, bm) * (t < ends[-1])
    return order, torch.stack([expert, first, count], 1).to(torch.int32).contiguous()
