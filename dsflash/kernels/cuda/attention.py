"""Sparse attention with sinks: one program per (query, 64 heads, output channels); online softmax over
the reference's blocks of 64 indices (cpu.SPARSE_ATTN_BLOCK) with the probabilities rounded to bf16 before
the PV product, fp32 running max/denominator, sink added last. Each program computes every score; up to 64
queries split the 512 output channels 4 ways and compute their score tiles side by side in a launch before.
And the indices it reads: the window's and the compressed picks' merged valid-first in one launch
(`attention_indices`), the window's from the positions in another (`window_source`), and its source rows
gathered from the window ring, the chunk and the picks with the ring's update in a third (`window_rows`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.kernels.cpu import SPARSE_ATTN_BLOCK

from .common import FP_FUSION, PDL_LAUNCH, grid_entry
from .configs import SPARSE_ATTN_SLICE, SPARSE_ATTN_SPLIT_MAX_N


@triton.jit
def _block_rows(idx_row, start, KI, BLOCK_I: tl.constexpr):
    """The kv rows of the index block at `start` (0 where an index is -1 or past KI) and their validity."""
    ri = tl.arange(0, BLOCK_I)
    ids = tl.load(idx_row + start + ri, mask=(start + ri) < KI, other=-1)
    valid = ids != -1
    return tl.where(valid, ids, 0).to(tl.int64), valid


@triton.jit
def _score_tile(s_ptr, n, H, rh, KP, start, BLOCK_I: tl.constexpr):
    """Where the scores apart keep the tile of (query n, heads rh, index block at `start`)."""
    return s_ptr + (n * H + rh).to(tl.int64)[:, None] * KP + start + tl.arange(0, BLOCK_I)[None, :]


@triton.jit
def _block_scores(q, kv_ptr, idx_row, start, KI, stride_kv, rd, dmask, BLOCK_I: tl.constexpr):
    """Unscaled scores [heads, BLOCK_I] of the index block at `start` (-inf where an index is -1 or past KI), its
    kv rows and their validity: one tile shape for both kernels that compute them, so the same bits. The chain
    scales them itself: with FP fusion on, `s * scale - m` may become one FMA, and it must be the same FMA whether
    s comes from the registers or from the scores apart (scaled there, the stored rounding differed on the H100)."""
    rows, valid = _block_rows(idx_row, start, KI, BLOCK_I)
    kv = tl.load(kv_ptr + rows[:, None] * stride_kv + rd[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
    s = tl.where(valid[None, :], tl.dot(q, tl.trans(kv)), float("-inf"))
    return s, kv, rows, valid


@triton.jit
def _load_q(q_ptr, n, rh, rd, hmask, dmask, stride_qn, stride_qh):
    return tl.load(q_ptr + n.to(tl.int64) * stride_qn + rh[:, None] * stride_qh + rd[None, :],
                   mask=hmask[:, None] & dmask[None, :], other=0.0)


@triton.jit
def _attn_scores_kernel(q_ptr, kv_ptr, idx_ptr, s_ptr, H, D, KI, KP, stride_qn, stride_qh, stride_kv,
                        stride_in, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_I: tl.constexpr):
    """Program (query, head block, index block): the block's scores, stored at s[query, head, KP columns] for
    _sparse_attn_kernel's SCORES pass -- a decode row's ten score tiles side by side instead of in its chain."""
    grid_entry()
    n = tl.program_id(0)
    rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rd = tl.arange(0, BLOCK_D)
    hmask = rh < H
    dmask = rd < D
    start = tl.program_id(2) * BLOCK_I
    q = _load_q(q_ptr, n, rh, rd, hmask, dmask, stride_qn, stride_qh)
    s, _, _, _ = _block_scores(q, kv_ptr, idx_ptr + n.to(tl.int64) * stride_in, start, KI, stride_kv, rd, dmask,
                               BLOCK_I)
    tl.store(_score_tile(s_ptr, n, H, rh, KP, start, BLOCK_I), s, mask=hmask[:, None])


@triton.jit
def _sparse_attn_kernel(q_ptr, kv_ptr, sink_ptr, idx_ptr, o_ptr, s_ptr, H, D, KI, KP, scale,
                        stride_qn, stride_qh, stride_kv, stride_in, stride_on, stride_oh,
                        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_I: tl.constexpr,
                        BLOCK_O: tl.constexpr, SCORES: tl.constexpr):
    """Program (query, head block, output slice): the softmax over the picked rows needs every channel
    (the scores), the output only its BLOCK_O channels. Programs of one query recompute the same scores
    (same tiles: the same bits) so a decode row spreads over D / BLOCK_O programs. SCORES (a few queries): the
    scores come from _attn_scores_kernel's tiles, so the chain of blocks holds only the softmax and the PV
    product -- the same operations on the same values."""
    grid_entry()
    n = tl.program_id(0)
    hb = tl.program_id(1)
    rh = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    rd = tl.arange(0, BLOCK_D)
    ro = tl.program_id(2) * BLOCK_O + tl.arange(0, BLOCK_O)
    hmask = rh < H
    dmask = rd < D
    omask = ro < D
    if not SCORES:
        q = _load_q(q_ptr, n, rh, rd, hmask, dmask, stride_qn, stride_qh)
    idx_row = idx_ptr + n.to(tl.int64) * stride_in
    m_i = tl.full([BLOCK_H], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_O], dtype=tl.float32)
    for start in range(0, KI, BLOCK_I):
        if SCORES:
            rows, valid = _block_rows(idx_row, start, KI, BLOCK_I)
            s = tl.load(_score_tile(s_ptr, n, H, rh, KP, start, BLOCK_I), mask=hmask[:, None], other=0.0)
            # through an MMA of zeros (adds +0) into the accumulator layout the chain's own score tile has: the
            # row sums below reduce in the layout's order, and another layout gives other bits on the GPU
            s = tl.dot(tl.zeros([BLOCK_H, 16], tl.bfloat16), tl.zeros([16, BLOCK_I], tl.bfloat16), acc=s)
        else:
            s, kv, rows, valid = _block_scores(q, kv_ptr, idx_row, start, KI, stride_kv, rd, dmask, BLOCK_I)
        s = s * scale
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if SCORES or BLOCK_O < BLOCK_D:
            kv = tl.load(kv_ptr + rows[:, None] * stride_kv + ro[None, :], mask=valid[:, None] & omask[None, :],
                         other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), kv)
        m_i = m_new
    sink = tl.load(sink_ptr + rh, mask=hmask, other=0.0)
    l_i = l_i + tl.exp(sink - m_i)
    o = tl.math.div_rn(acc, l_i[:, None])
    tl.store(o_ptr + n.to(tl.int64) * stride_on + rh[:, None] * stride_oh + ro[None, :], o.to(tl.bfloat16),
             mask=hmask[:, None] & omask[None, :])


@triton.jit
def _ring_slot(p, CAPACITY: tl.constexpr):
    """A position's ring slot: the floor remainder, as torch's % of a negative position."""
    return (p % CAPACITY + CAPACITY) % CAPACITY


@triton.jit(do_not_specialize=["n", "keep"])
def _window_source_kernel(pos_ptr, slot_ptr, idx_ptr, written_ptr, n, keep, WINDOW: tl.constexpr,
                          CAPACITY: tl.constexpr, BW: tl.constexpr):
    """Program r: row r's window indices; program 0 also the ring slots read, and each of the last `keep` real
    rows its ring slot."""
    grid_entry()
    r = tl.program_id(0)
    j = tl.arange(0, BW)
    p0, p = tl.load(pos_ptr), tl.load(pos_ptr + r)
    first = p0 - WINDOW
    pos = tl.maximum(p - WINDOW + 1, 0) + j
    tl.store(idx_ptr + r.to(tl.int64) * WINDOW + j, tl.where(pos > p, -1, pos - first), mask=j < WINDOW)
    if r == 0:
        tl.store(slot_ptr + j, _ring_slot(first + j, CAPACITY), mask=j < WINDOW)
    if (r >= n - keep) & (r < n):
        tl.store(written_ptr + r - (n - keep), _ring_slot(p, CAPACITY))


def window_source(positions: torch.Tensor, n: int, window: int, capacity: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """model/attention.window_source in one launch (int64 positions [rows] -> slots [window], indices
    [rows, window], written slots [min(n, capacity)]), entry for entry."""
    positions = positions.contiguous()
    assert positions.dtype == torch.int64 and positions.numel() >= max(n, 1)
    rows, keep = positions.numel(), min(n, capacity)
    slots = torch.empty(window, dtype=torch.int64, device=positions.device)
    idx = torch.empty((rows, window), dtype=torch.int64, device=positions.device)
    written = torch.empty(keep, dtype=torch.int64, device=positions.device)
    _window_source_kernel[(rows,)](positions, slots, idx, written, n, keep, WINDOW=window, CAPACITY=capacity,
                                   BW=triton.next_power_of_2(window), num_warps=4, enable_fp_fusion=FP_FUSION,
                                   launch_pdl=PDL_LAUNCH)
    return slots, idx, written


@triton.jit(do_not_specialize=["rows", "n", "keep"])
def _window_rows_kernel(ring_ptr, slot_ptr, written_ptr, kv_ptr, comp_ptr, o_ptr, rows, n, keep, D: tl.constexpr,
                        WINDOW: tl.constexpr, BD: tl.constexpr):
    """Program i: source row i -- ring row slots[i] for i < WINDOW, then the chunk's kv rows, then the compressed
    rows; the program of each of the last `keep` real kv rows also writes it into the ring at its slot (no slot
    read here: the caller's condition)."""
    grid_entry()
    i = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)
    mask = d < D
    if i < WINDOW:
        row = tl.load(ring_ptr + tl.load(slot_ptr + i) * D + d, mask=mask)
    elif i < WINDOW + rows:
        row = tl.load(kv_ptr + (i - WINDOW) * D + d, mask=mask)
        r = i - WINDOW - (n - keep)
        if (r >= 0) & (r < keep):
            tl.store(ring_ptr + tl.load(written_ptr + r) * D + d, row, mask=mask)
    else:
        row = tl.load(comp_ptr + (i - WINDOW - rows) * D + d, mask=mask)
    tl.store(o_ptr + i * D + d, row, mask=mask)


def window_rows(ring: torch.Tensor, slots: torch.Tensor, written: torch.Tensor, kv: torch.Tensor, n: int,
                comp: torch.Tensor | None) -> torch.Tensor:
    """model/attention.window_rows in one launch, where no slot written is read (its condition): the source
    rows (ring rows at `slots`, kv, comp) as a new tensor, and the chunk's last real kv rows into the ring."""
    window, d, keep = slots.numel(), kv.size(1), written.numel()
    assert ring.is_contiguous() and ring.dtype == kv.dtype == torch.bfloat16 and ring.size(0) >= window + n >= keep
    kv, slots, written = kv.contiguous(), slots.contiguous(), written.contiguous()
    comp = kv[:0] if comp is None else comp.contiguous()
    rows = kv.size(0)
    out = torch.empty((window + rows + comp.size(0), d), dtype=torch.bfloat16, device=kv.device)
    _window_rows_kernel[(out.size(0),)](ring, slots, written, kv, comp, out, rows, n, keep, D=d, WINDOW=window,
                                        BD=triton.next_power_of_2(d), num_warps=4, enable_fp_fusion=FP_FUSION,
                                        launch_pdl=PDL_LAUNCH)
    return out


@triton.jit(do_not_specialize=["offset"])
def _attention_indices_kernel(w_ptr, p_ptr, o_ptr, W, P, offset, LOCAL: tl.constexpr, BW: tl.constexpr,
                              BP: tl.constexpr):
    """Program r: row r's window indices, then its picks (their slots r * P + j when LOCAL) past `offset`,
    scattered valid-first in order -- a valid entry to the count of valid ones before it, a -1 to the end --
    which is the reference's stable sort of the concatenation by validity."""
    grid_entry()
    r = tl.program_id(0).to(tl.int64)
    jw, jp = tl.arange(0, BW), tl.arange(0, BP)
    a = tl.load(w_ptr + r * W + jw, mask=jw < W, other=-1)
    b = tl.load(p_ptr + r * P + jp, mask=jp < P, other=-1)
    if LOCAL:
        b = tl.where(b >= 0, r * P + jp, -1)
    b = tl.where(b >= 0, b + offset, -1)
    va, vb = (a >= 0).to(tl.int32), (b >= 0).to(tl.int32)
    ca, cb = tl.cumsum(va, 0), tl.cumsum(vb, 0)  # valid entries up to and including each lane
    na, nb = tl.sum(va, 0), tl.sum(vb, 0)
    pa = tl.where(va != 0, ca - 1, na + nb + jw - ca)
    pb = tl.where(vb != 0, na + cb - 1, nb + W + jp - cb)
    out = o_ptr + r * (W + P)
    tl.store(out + pa, a, mask=jw < W)
    tl.store(out + pb, b, mask=jp < P)


def attention_indices(window_idx: torch.Tensor, picks: torch.Tensor, offset: int, local: bool) -> torch.Tensor:
    """model/attention.attention_indices in one launch (int64 [rows, window] and [rows, topk] -> int64
    [rows, window + topk]), entry for entry."""
    window_idx, picks = window_idx.contiguous(), picks.contiguous()
    assert window_idx.dtype == picks.dtype == torch.int64 and window_idx.size(0) == picks.size(0)
    (rows, w), p = window_idx.shape, picks.size(1)
    out = torch.empty((rows, w + p), dtype=torch.int64, device=picks.device)
    if rows:
        _attention_indices_kernel[(rows,)](window_idx, picks, out, w, p, offset, LOCAL=local,
                                           BW=triton.next_power_of_2(w), BP=triton.next_power_of_2(p),
                                           num_warps=4, enable_fp_fusion=FP_FUSION, launch_pdl=PDL_LAUNCH)
    return out


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                *, out: torch.Tensor | None = None, block_h: int | None = None,
                block_o: int | None = None, scores_apart: bool | None = None) -> torch.Tensor:
    """Single-KV-head attention over gathered rows with a per-head sink (see cpu.sparse_attn).
    q [N, H, D] bf16; kv [R, D] bf16; sink [H] fp32; idx [N, K] int (-1 = none). Returns bf16 [N, H, D].
    A few queries (a decode step) spread each query's output channels over programs and compute their score
    tiles side by side first (`_attn_scores_kernel`): the same bits (tests/test_kernels_cuda.py). `block_h` /
    `block_o` / `scores_apart` (experiments, tests) override the heads and the output channels per program and
    the score pass."""
    n, h, d = q.shape
    assert kv.dim() == 2 and kv.size(1) == d and idx.dim() == 2 and idx.size(0) == n
    q = q.to(torch.bfloat16)
    if q.stride(2) != 1:
        q = q.contiguous()
    kv = kv.to(torch.bfloat16)
    if kv.stride(1) != 1:
        kv = kv.contiguous()
    idx = idx.contiguous()
    if idx.dtype not in (torch.int32, torch.int64):
        idx = idx.long()
    sink = sink.float().contiguous()
    o = out if out is not None else torch.empty((n, h, d), dtype=torch.bfloat16, device=q.device)
    if n == 0:
        return o
    block_h = block_h or min(64, max(16, triton.next_power_of_2(h)))
    block_d = max(16, triton.next_power_of_2(d))
    warps = 8 if block_h * block_d >= 64 * 256 else 4
    few = n <= SPARSE_ATTN_SPLIT_MAX_N
    block_o = block_o or (min(block_d, SPARSE_ATTN_SLICE) if few else block_d)
    apart = few if scores_apart is None else scores_apart
    ki = idx.size(1)
    kp = triton.cdiv(ki, SPARSE_ATTN_BLOCK) * SPARSE_ATTN_BLOCK
    # without the pass apart the kernel never reads s_ptr: `o` stands in for it
    scores = torch.empty((n, h, kp), dtype=torch.float32, device=q.device) if apart else o
    tiles = dict(BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_I=SPARSE_ATTN_BLOCK, num_warps=warps, num_stages=2)
    if apart:
        _attn_scores_kernel[(n, triton.cdiv(h, block_h), kp // SPARSE_ATTN_BLOCK)](
            q, kv, idx, scores, h, d, ki, kp, q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), **tiles,
            enable_fp_fusion=FP_FUSION, launch_pdl=PDL_LAUNCH)
    _sparse_attn_kernel[(n, triton.cdiv(h, block_h), triton.cdiv(block_d, block_o))](
        q, kv, sink, idx, o, scores, h, d, ki, kp, float(scale), q.stride(0), q.stride(1), kv.stride(0),
        idx.stride(0), o.stride(0), o.stride(1), BLOCK_O=block_o, SCORES=apart, **tiles, enable_fp_fusion=FP_FUSION,
        launch_pdl=PDL_LAUNCH)
    return o


@triton.jit(do_not_specialize=["M"])
def _add_rows_fixed_point_kernel(src_ptr, idx_ptr, dst_ptr, factor_ptr, M, D, BLOCK_M: tl.constexpr,
                                 BLOCK_D: tl.constexpr):
    grid_entry()
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    target = tl.load(idx_ptr + rows, mask=rows < M, other=-1)
    cols = tl.arange(0, BLOCK_D)
    ok = (target >= 0)[:, None] & (cols < D)[None, :]
    v = tl.load(src_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], mask=ok, other=0.0)
    fixed = (v * tl.load(factor_ptr)).to(tl.int64)  # a power of two: exact; truncated toward zero, as torch's cast
    tl.atomic_add(dst_ptr + target[:, None] * D + cols[None, :], fixed, mask=ok)


def add_rows_fixed_point(dst: torch.Tensor, idx: torch.Tensor, src: torch.Tensor, factor: torch.Tensor) -> None:
    """dst[idx[i]] += trunc(src[i] * factor) for every idx[i] >= 0 (dst int64 [R, D], idx int64 [M], src fp32 [M,
    D], factor fp32 [] on the device, a power of two): integer atomics, so the sums are the same whatever order
    they land in (the training backward's kv gradient: train/backend.py kv_sums_fixed_point)."""
    m, d = src.shape
    if m:
        _add_rows_fixed_point_kernel[(triton.cdiv(m, 64),)](src.float().contiguous(), idx.contiguous(), dst, factor,
                                                            m, d, BLOCK_M=64, BLOCK_D=triton.next_power_of_2(d),
                                                            num_warps=4, enable_fp_fusion=FP_FUSION,
                                                            launch_pdl=PDL_LAUNCH)
