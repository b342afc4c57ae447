"""The indexer: the scores in one kernel (per-head dots, the composition's bf16 rounding points, the heads
added in order, the masks); top-k and candidate blocks by a radix select of 16-bit order keys, one program
per row (lowest index first among equal scores), or torch's sort for a few long rows (the same picks)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.kernels import cpu

from .common import FP_FUSION, PDL_LAUNCH, grid_entry
from .configs import INDEX_SCORE_ENTRIES, INDEX_SCORE_ROWS, TOPK_BLOCK, TOPK_KERNEL_MAX_SCORES, TOPK_KERNEL_MIN_ROWS


@triton.jit
def _index_head_term(q_ptr, w_ptr, keys, rows, rmask, h, H: tl.constexpr, D: tl.constexpr):
    """Head h's relu(q.k) times its weight, rounded as cpu.index_scores rounds it: the logit to bf16 (the
    einsum's output), the weighted term to bf16 (a bf16 product), then widened for the head sum."""
    q = tl.load(q_ptr + rows[:, None].to(tl.int64) * (H * D) + h * D + tl.arange(0, D)[None, :],
                mask=rmask[:, None], other=0.0)
    logit = tl.dot(q, keys).to(tl.bfloat16).to(tl.float32)
    w = tl.load(w_ptr + rows.to(tl.int64) * H + h, mask=rmask, other=0.0).to(tl.float32)
    return (tl.maximum(logit, 0.0) * w[:, None]).to(tl.bfloat16).to(tl.float32)


@triton.jit(do_not_specialize=["N", "E"])
def _index_scores_kernel(q_ptr, k_ptr, w_ptr, vis_ptr, keep_ptr, o_ptr, N, E, stride_keep,
                         H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, KEEP: tl.constexpr,
                         R: tl.constexpr, BE: tl.constexpr):
    """scores[n, e] of cpu.index_scores for R query rows and BE entries: one dot per head against the
    entries' keys (loaded once), the heads added in order from head 0 as small_sum does, then the masks."""
    grid_entry()
    rows = tl.program_id(0) * R + tl.arange(0, R)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    rmask = rows < N
    emask = e < E
    keys = tl.load(k_ptr + e[None, :].to(tl.int64) * D + tl.arange(0, D)[:, None], mask=emask[None, :], other=0.0)
    total = _index_head_term(q_ptr, w_ptr, keys, rows, rmask, 0, H, D)
    for h in range(1, H):
        total += _index_head_term(q_ptr, w_ptr, keys, rows, rmask, h, H, D)
    vis = tl.load(vis_ptr + rows, mask=rmask, other=0)
    hide = e[None, :] >= vis[:, None]
    if KEEP:
        kept = tl.load(keep_ptr + rows[:, None].to(tl.int64) * stride_keep + e[None, :] // BLOCK,
                       mask=rmask[:, None] & emask[None, :], other=0)
        hide = hide | (kept == 0)
    out = tl.where(hide, float("-inf"), total).to(tl.bfloat16)
    tl.store(o_ptr + rows[:, None].to(tl.int64) * E + e[None, :], out, mask=rmask[:, None] & emask[None, :])


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, visible: torch.Tensor,
                 keep_blocks: torch.Tensor | None, block: int) -> torch.Tensor:
    """cpu.index_scores with this backend's small_sum (fp32 adds from head 0, then bf16) in one launch, no
    [N, H, T] logits in memory. The per-head dot (K = D in one chain of MMAs, fp32 accumulation) is the
    bf16 GEMM's (tests/test_kernels_cuda.py)."""
    n, h, d = q.shape
    e = keys.size(0)
    q = q.to(torch.bfloat16).contiguous()
    keys = keys.to(torch.bfloat16).contiguous()
    weights = weights.to(torch.bfloat16).contiguous()
    vis = visible.reshape(n).contiguous()
    out = torch.empty((n, e), dtype=torch.bfloat16, device=q.device)
    if n == 0 or e == 0:
        return out
    keep = keep_blocks.contiguous().view(torch.uint8) if keep_blocks is not None else out
    grid = (triton.cdiv(n, INDEX_SCORE_ROWS), triton.cdiv(e, INDEX_SCORE_ENTRIES))
    _index_scores_kernel[grid](q, keys, weights, vis, keep, out, n, e, keep.stride(0) if keep_blocks is not None else 0,
                               H=h, D=d, BLOCK=block, KEEP=keep_blocks is not None, R=INDEX_SCORE_ROWS,
                               BE=INDEX_SCORE_ENTRIES, num_warps=4, num_stages=2, enable_fp_fusion=False,
                               launch_pdl=PDL_LAUNCH)
    return out


@triton.jit
def _order_keys(s_ptr, row, base, E, group, newest, GROUP: tl.constexpr, CAND: tl.constexpr, BLOCK: tl.constexpr):
    """Items base .. base + BLOCK of a row as 16-bit keys ordered like their bf16 values (-0 = +0, NaN
    above +inf as torch's sort has it): an item is one score (group 1) or the max of `group` consecutive
    scores (candidate blocks, GROUP >= group a power of two; the newest block +inf when CAND). Returns
    (keys, in range, item values)."""
    i = base + tl.arange(0, BLOCK)
    j = tl.arange(0, GROUP)
    e = i[:, None] * group + j[None, :]
    v = tl.load(s_ptr + row * E + e, mask=(e < E) & (j[None, :] < group), other=float("-inf"))
    v = tl.max(v.to(tl.float32), axis=1)
    if CAND:
        v = tl.where(i == newest, float("inf"), v)
    b = v.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    b = tl.where(b == 0x8000, 0, b)
    key = tl.where((b & 0x8000) != 0, b ^ 0xFFFF, b | 0x8000)
    key = tl.where((b & 0x7FFF) > 0x7F80, 0xFFFF, key)
    return key, i < tl.cdiv(E, group), v


@triton.jit(do_not_specialize=["E", "k"])
def _topk_kernel(s_ptr, vis_ptr, o_ptr, E, k, width, group, GROUP: tl.constexpr, CAND: tl.constexpr,
                 BLOCK: tl.constexpr):
    """One row's k best items (lowest index first among equal keys), found by a radix select of the 16-bit
    key (four 4-bit digits from the top: the k-th best key, and how many items equal to it to take), then
    one pass in index order that emits them. CAND: items are candidate blocks; writes the keep mask
    (picked and not -inf) for every block. Else: writes the picks ascending, those at or past `visible`
    as -1, then -1 up to `width`."""
    grid_entry()
    row = tl.program_id(0).to(tl.int64)
    items = tl.cdiv(E, group)
    vis = tl.load(vis_ptr + row)
    newest = tl.where(vis > 0, (vis - 1) // group, -1)  # (Triton's // truncates: no block when none is visible)
    prefix = 0
    known = 0
    need = k
    digits = tl.arange(0, 16)
    for p in tl.static_range(4):
        shift = 12 - 4 * p
        counts = tl.zeros([16], dtype=tl.int32)
        for base in range(0, items, BLOCK):
            key, valid, _ = _order_keys(s_ptr, row, base, E, group, newest, GROUP, CAND, BLOCK)
            match = valid & ((key & known) == prefix)
            hit = match[:, None] & (((key >> shift) & 15)[:, None] == digits[None, :])
            counts += tl.sum(hit.to(tl.int32), axis=0)
        at_least = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts  # items with digit >= d
        chosen = tl.max(tl.where(at_least >= need, digits, 0), axis=0)
        need -= tl.sum(tl.where(digits > chosen, counts, 0), axis=0)
        prefix |= chosen << shift
        known |= 15 << shift
    ties = tl.full([], 0, tl.int32)
    written = tl.full([], 0, tl.int32)
    for base in range(0, items, BLOCK):
        key, valid, v = _order_keys(s_ptr, row, base, E, group, newest, GROUP, CAND, BLOCK)
        i = base + tl.arange(0, BLOCK)
        tie = valid & (key == prefix)
        rank = ties + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        pick = (valid & (key > prefix)) | (tie & (rank < need))
        if CAND:
            tl.store(o_ptr + row * items + i, (pick & (v > float("-inf"))).to(tl.int8), mask=valid)
        else:
            pos = written + tl.cumsum(pick.to(tl.int32), axis=0) - 1
            tl.store(o_ptr + row * width + pos, i.to(tl.int64), mask=pick & (i < vis))
            written += tl.sum((pick & (i < vis)).to(tl.int32), axis=0)
        ties += tl.sum(tie.to(tl.int32), axis=0)
    if not CAND:
        for base in range(0, width, BLOCK):
            j = base + tl.arange(0, BLOCK)
            tl.store(o_ptr + row * width + j, tl.full([BLOCK], -1, tl.int64), mask=(j >= written) & (j < width))


def _topk_by_kernel(scores: torch.Tensor, kernel: bool | None) -> bool:
    n, e = scores.shape
    return kernel if kernel is not None else e <= TOPK_KERNEL_MAX_SCORES or n >= TOPK_KERNEL_MIN_ROWS


def _topk(scores: torch.Tensor, visible: torch.Tensor, out: torch.Tensor, k: int, width: int, block: int,
          cand: bool) -> None:
    """One _topk_kernel program per row: the picks to out [N, width], or (`cand`) the keep mask of the
    candidate blocks of `block` scores to out [N, ceil(T / block)]."""
    n, e = scores.shape
    if n:
        group = triton.next_power_of_2(block)
        _topk_kernel[(n,)](scores.contiguous(), visible.reshape(n).contiguous(), out, e, k, width, block,
                           GROUP=group, CAND=cand, BLOCK=max(16, TOPK_BLOCK // group), num_warps=4,
                           enable_fp_fusion=FP_FUSION, launch_pdl=PDL_LAUNCH)


def topk_indices(scores: torch.Tensor, k: int, visible: torch.Tensor, width: int, *,
                 kernel: bool | None = None) -> torch.Tensor:
    """cpu.topk_indices: one program per row, or torch's sort for a few long rows (`kernel` forces either)."""
    if not _topk_by_kernel(scores, kernel):
        return cpu.topk_indices(scores, k, visible, width)
    out = torch.empty((scores.size(0), width), dtype=torch.int64, device=scores.device)
    _topk(scores, visible, out, k, width, 1, False)
    return out


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block: int, *,
                     kernel: bool | None = None) -> torch.Tensor:
    """cpu.candidate_blocks: one program per row taking the block maxima as it reads them, or torch's sort
    for a few long rows (as topk_indices)."""
    if not _topk_by_kernel(scores, kernel):
        return cpu.candidate_blocks(scores, visible, topk_blocks, block)
    n_blocks = triton.cdiv(scores.size(1), block)
    out = torch.empty((scores.size(0), n_blocks), dtype=torch.bool, device=scores.device)
    _topk(scores, visible, out.view(torch.int8), min(topk_blocks, n_blocks), 0, block, True)
    return out
