"""The kernel interface: one backend's ops as a typed record (`Kernels`), built by keyword beside each
backend's code (dsflash/kernels/__init__.py for the reference, dsflash/kernels/cuda/ for Triton)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import Tensor

from dsflash.kernels.cpu import Weight


class Bank(Protocol):
    """One projection's routed-expert weights as a backend's `expert_bank` stacks them: bank[e] is expert e's."""

    def __getitem__(self, expert: int, /) -> Weight: ...


BankT = TypeVar("BankT", bound=Bank)


class MoeRoute(Protocol):
    """(gate logits [N, E] fp32, bias [E] or [N, E], k, score_func, temp, norm, scale, forced ids or None,
    ascending) -> (weights fp32 [N, k], expert ids [N, k]) as model/moe.py's `Gate.route` computes them, or
    None where the kernel does not apply (the model then runs its formula)."""

    def __call__(self, logits: Tensor, bias: Tensor, k: int, score_func: str, temp: float, norm: bool,
                 scale: float, ids: Tensor | None = None, ascending: bool = False
                 ) -> tuple[Tensor, Tensor] | None: ...


def run_here(fn: Callable[..., Any], *args: Any, lane: int = 0) -> Any:
    """`Kernels.fork` of a backend without side streams: fn(*args), in place."""
    return fn(*args)


def nothing_forked(lane: int = 0) -> None:
    """`Kernels.join` of a backend without side streams."""


class Fp4FakeQuant(Protocol):
    """(x bf16, block, e4m3_scale) -> x through E2M1 and back: quant.fp4_fake_quant."""

    def __call__(self, x: Tensor, block: int, e4m3_scale: bool) -> Tensor: ...


@dataclass(frozen=True)
class Kernels(Generic[BankT]):
    """One backend's ops. BankT: its stacked routed-expert weights (what its `expert_bank` makes and its
    `expert_linear` takes).

    The fused ops (`moe_route`, `collapse`, `expand`, `softmax_pool`, `engram_gate`, `window_source`,
    `window_rows`, `attention_indices`, `fp4_dequant_picked`) are optional: the formula each one fuses is the
    model's (dsflash/model: moe.route, mhc.hc_pre, mhc.hc_post, attention.softmax_pool, engram.engram_gate,
    attention.window_source, attention.window_rows, attention.attention_indices, attention.picked_entries),
    written from this record's primitive ops; None (the reference backend) runs that formula, and a fused
    kernel must give its bits on its backend."""

    name: str
    device: torch.device
    # rows of a forward are padded to a multiple of this: the reference backend's CPU BLAS and vector
    # loops are only batch-invariant on whole tiles; the CUDA kernels are invariant at any row count
    row_tile: int
    linear: Callable[[Tensor, Weight], Tensor]  # (x [N, in], weight) -> [N, out]
    sparse_attn: Callable[[Tensor, Tensor, Tensor, Tensor, float], Tensor]  # (q, kv, sink, idx, scale) -> bf16
    # (mixes, scale, base, hc, iters, eps) -> (pre, post, comb), fp32
    hc_split_sinkhorn: Callable[[Tensor, Tensor, Tensor, int, int, float], tuple[Tensor, Tensor, Tensor]]
    grouped_linear: Callable[[Tensor, Tensor], Tensor]  # (x [N, G, D], w [G, R, D]) -> [N, G, R], bf16
    expert_bank: Callable[[list[Weight]], BankT]  # one projection's routed-expert Weights -> the bank
    # (a weight, count, pinned) -> a bank of `count` entries shaped like it, on the device or (pinned) in
    # pinned host memory: the expert cache's slots and the host tier's experts (model/expert_cache.py)
    expert_slots: Callable[[Weight, int, bool], BankT]
    # (bank, entry, weight) -> None: the weight copied into the entry (asynchronously, on the current stream)
    expert_put: Callable[[BankT, int, Weight], None]
    # (x, bank, expert per slot, slots per row) -> bf16 [slots, out]
    expert_linear: Callable[[Tensor, BankT, Tensor, int], Tensor]
    # MoE layers of at most this many rows run every (row, slot) pair through expert_linear (no host read
    # of the routing); larger chunks loop over the experts they use (the CPU's; CUDA's expert_linear takes all)
    slot_moe_rows: int
    # (q, keys, weights, visible, keep_blocks or None, block) -> the indexer's bf16 scores
    index_scores: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor | None, int], Tensor]
    # (scores, k, visible, width) -> the k best entries per row, ascending, -1 padded
    topk_indices: Callable[[Tensor, int, Tensor, int], Tensor]
    # (scores, visible, topk_blocks, block) -> the kept candidate blocks, bool
    candidate_blocks: Callable[[Tensor, Tensor, int, int], Tensor]
    moe_route: MoeRoute | None
    mean_square: Callable[[Tensor], Tensor]  # mean(x^2) over the last dim, keepdim
    row_sum: Callable[[Tensor], Tensor]  # sum over the last dim
    small_sum: Callable[[Tensor, int], Tensor]  # (x, dim) -> the sum over a short dim
    stream_mean: Callable[[Tensor], Tensor]  # mean over dim 1 (the mHC streams)
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]  # (x, weight, eps) -> RMSNorm of x in x's dtype
    # (values, x, eps) -> values * rsqrt(mean(x^2) + eps), fp32 (the mHC mixes)
    rms_scale: Callable[[Tensor, Tensor, float], Tensor]
    fp8_fake_quant: Callable[[Tensor], Tensor]  # quant.fp8_fake_quant: window KV
    fp4_fake_quant: Fp4FakeQuant  # index queries
    # packing.quant_packed (x, block, e4m3_scale): the compressed KV and index keys as the state holds them
    fp4_quant_packed: Callable[[Tensor, int, bool], Tensor]
    # packing.dequant_packed (packed, d, block, e4m3_scale): their values, read back (fp4_fake_quant's bits)
    fp4_dequant_packed: Callable[[Tensor, int, int, bool], Tensor]
    # attention.picked_entries: (packed, picks, d, block, e4m3_scale) -> the picked rows' values
    fp4_dequant_picked: Callable[[Tensor, Tensor, int, int, bool], Tensor] | None
    # attention.window_source: (positions, n, window, capacity) -> (ring slots read, indices, ring slots written)
    window_source: Callable[[Tensor, int, int, int], tuple[Tensor, Tensor, Tensor]] | None
    # attention.window_rows: (ring rows, slots, written slots, kv, n, compressed rows or None) -> the source rows
    # (the ring updated)
    window_rows: Callable[[Tensor, Tensor, Tensor, Tensor, int, Tensor | None], Tensor] | None
    # attention.attention_indices: (window indices, picks, offset, local) -> the attention's indices
    attention_indices: Callable[[Tensor, Tensor, int, bool], Tensor] | None
    collapse: Callable[[Tensor, Tensor], Tensor] | None  # model/mhc.py hc_pre: (h, pre_mix) -> [N, D]
    expand: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor] | None  # model/mhc.py hc_post: (y, residual, post, comb)
    # (routed experts' rows [N, k, D], shared expert's [N, D]) -> the MoE output [N, D]
    moe_sum: Callable[[Tensor, Tensor], Tensor]
    # (gate, up [..., D], limit, weights [..., 1] or None) -> an expert's hidden rows
    swiglu: Callable[[Tensor, Tensor, float, Tensor | None], Tensor]
    softmax_pool: Callable[[Tensor, Tensor], Tensor] | None  # attention.softmax_pool: (kv, score)
    engram_rows: Callable[[Tensor, Tensor, Tensor], Tensor]  # (FP8 table, its scales, ids) -> the rows, bf16
    # engram.engram_gate: (h, key, value, qk_weight, eps, image mask or None) -> h + the gated value
    engram_gate: Callable[[Tensor, Tensor, Tensor, Tensor, float, Tensor | None], Tensor] | None
    # (x, factor table, positions, dim, inverse) -> x, its last dim channels rotated in place
    rope_rotate: Callable[[Tensor, Tensor, Tensor, int, bool], Tensor]
    # (kind, stored tensor, stored scale or None) -> the backend's weight on `device`
    weight: Callable[[str, Tensor, Tensor | None], Weight]
    # (fn, *args, lane=0) -> fn(*args), whose kernels may run beside what the caller launches next until it calls
    # `join(lane)` (forks of different lanes run beside each other too, and are joined apart)
    # (work off the critical path: a site's mHC mixes, which only the sub-layer's output needs; the shared expert
    # beside the routed ones). The caller keeps fn's inputs alive and unchanged until `join`, and reads fn's
    # outputs only after it. Same kernels, same bits
    fork: Callable[..., Any] = run_here
    join: Callable[..., None] = nothing_forked
