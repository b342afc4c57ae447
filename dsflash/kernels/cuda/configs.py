"""Every tile configuration and row/size threshold of the CUDA kernels, in one place.

Batch invariance: a row's bits never depend on how many rows share the call. Every kernel's tile
shape, K step and K split is a function of the weight's (N, K) or of the head/dim sizes only (never
of M), there is no autotuning and no atomics, and each output element is computed by the same
instruction sequence wherever its row sits in a tile. The M-dependent choices below give identical bits
by construction and are tested to: fusing the activation quantisation into the GEMM (the quantisation is
exact bit arithmetic); from DEQUANT_MIN_M rows, FP8/FP4 operands dequantised to bf16 before the GEMM
instead of in its tiles (the same exact values, the same MMA chain); for M <= 16, 16-row tiles, and
running the K ranges as separate programs whose sums a second kernel adds in range order (one program adds
them in the same order); for M <= 64, the attention's output channels over several programs (each
computes the same scores); for M >= 128, widening FP4 weights to E4M3 once per call instead of per tile;
for plain GEMMs of M >= 512, N-wide tiles (the same MMA per output element) with the shape-fixed K
ranges added in one program.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton

# ---------------------------------------------------------------------------------------------
# GEMMs: M-dependent choices that never change bits (see above and the invariance tests)
# ---------------------------------------------------------------------------------------------
FUSE_QUANT_MAX_M = 16  # up to this many rows the GEMM quantises its own activation tile (2-3 us faster)
NARROW_TILE_MAX_M = 16  # up to this many rows FP8/FP4 GEMMs use 16-row swapped tiles (same bits as 64-row ones)
LARGE_TILE_MIN_M = 4096  # from this many rows FP8 GEMMs use 128x128 tiles (same bits as 64-row ones)
SPREAD_MAX_M = 16  # up to this many rows a GEMM's K ranges run as separate programs (sums added in order)
FP4_PRECONVERT_M = 128  # from this many rows FP4 weights are widened to E4M3 once per call, not per tile
ACT_QUANT_ROWS = 32  # rows per program of the standalone activation quantisation
ACT_QUANT_BLOCKS = 8  # ... and K blocks per program
FP4_WIDEN_WORDS = 1024  # FP4 weight words per program of the widening to E4M3
DEQUANT_MIN_M = 1024  # from this many rows FP8/FP4 GEMMs dequantise both operands to bf16 first (same bits)
DEQUANT_ROWS = 32  # weight rows per program of the dequantisation to bf16
ORDERED_SUM_SMALL = 1 << 17  # outputs up to which the in-order sum of K-range partials takes small programs


@dataclass(frozen=True)
class LinearConfig:
    BM: int
    BN: int
    BK: int  # FP8/FP4: the K of one MMA step (tl.dot), 32, 64 or 128 -- the bits never depend on it
    num_warps: int
    num_stages: int
    GROUP_M: int = 8
    swap: bool = False  # FP8/FP4: the weight tile as the MMA's A operand (gemm._mma)


def linear_config(kind: str, n: int, k: int, m: int | None = None) -> LinearConfig:
    """The tile config for a weight of this kind and shape: a function of (kind, N, K) only. M picks between
    FP8/FP4 configs whose bits are equal (measured on every V4.1 layer shape:
    bench/results/mma-tiles-2026-11-30.txt; tested by tests/test_kernels_cuda.py), so a row's result never
    depends on M."""
    if kind in ("fp8", "fp4"):
        if m is not None and m <= NARROW_TILE_MAX_M:
            # 16-row tiles as the N of a wgmma whose M is 64 weight rows (swap): the MMA of the 64-row tiles,
            # without their 48 idle rows (mma.sync's 16-row tiles accumulate in another way: other bits); a whole
            # scale word's 128 columns a tl.dot (eight k16 wgmmas between waits; the same chain as 32-wide steps)
            return LinearConfig(BM=16, BN=64, BK=128, num_warps=4, num_stages=4, swap=True)
        if kind == "fp8" and m is not None and m >= LARGE_TILE_MIN_M:
            # 128x128 tiles, two warpgroups: with f16 operands 8-27% faster than 64x64 on every fp8 layer at
            # M=8192 (slower at M=512, and on FP4 experts widened to E4M3, whose per-32 weight scales crowd
            # the registers: bench/results/prefill-gemm-f16-2026-11-30.txt)
            return LinearConfig(BM=128, BN=128, BK=32, num_warps=8, num_stages=2)
        # one warpgroup, m64n64k32 wgmmas: the best measured compromise at every other size
        return LinearConfig(BM=64, BN=64, BK=32, num_warps=4, num_stages=4)
    if kind == "bf16":
        if n >= 4096:
            return LinearConfig(BM=64, BN=128, BK=64, num_warps=4, num_stages=4)
        return LinearConfig(BM=64, BN=16 if n <= 1024 else 64, BK=128, num_warps=4, num_stages=4)
    # fp32: 3xTF32 tensor-core dots (see linear's fp32_precision)
    return LinearConfig(BM=16, BN=16 if n < 4096 else 64, BK=32, num_warps=4, num_stages=3)


def dequant_gemm_config(n: int) -> LinearConfig:
    """The tile of an FP8/FP4 GEMM from DEQUANT_MIN_M rows, over operands dequantised to bf16 in memory: the
    plain GEMM's kernel, one program adding its K ranges in order (the same MMA chain per output element as
    the register-dequantising tiles, tested)."""
    return LinearConfig(BM=128, BN=128 if n >= 128 else 64, BK=64, num_warps=8, num_stages=3)


PLAIN_SPLIT_PROGRAMS = 256  # a narrow bf16/fp32 weight's K is split until its tiles x splits reach this
PLAIN_SPLIT_MIN_STEPS = 4  # ... keeping at least this many BK steps per split
PLAIN_WIDE_MIN_M = 512  # from this many rows: N-wide tiles, the K ranges in one program (same bits, tested)


def plain_k_per_split(cfg: LinearConfig, n: int, k: int) -> int:
    """The K range of one program of a bf16/fp32 GEMM: all of K for wide weights; for narrow ones (the mHC
    projections' 24 outputs over 20480 inputs, the router) a split fixed by the shape, so every row of
    every call sums the same partials in the same order."""
    steps = triton.cdiv(k, cfg.BK)
    tiles = triton.cdiv(n, cfg.BN)
    splits = max(1, min(triton.cdiv(PLAIN_SPLIT_PROGRAMS, tiles), steps // PLAIN_SPLIT_MIN_STEPS))
    return triton.cdiv(steps, splits) * cfg.BK


def plain_wide_config(cfg: LinearConfig, n: int) -> LinearConfig:
    """A plain GEMM's tile from PLAIN_WIDE_MIN_M rows: cfg widened along N (fewer re-reads of x, the same MMA
    per output element) with its K step, so its bits are cfg's."""
    return LinearConfig(BM=cfg.BM, BN=min(128, max(16, triton.next_power_of_2(n))), BK=cfg.BK, num_warps=4,
                        num_stages=3)


def ordered_sum_config(outputs: int) -> tuple[int, int]:
    """(outputs per program, warps) of the in-order sum of K-range partials: the sum is a chain of dependent
    loads, so small outputs get many small programs (the bits never depend on it)."""
    return (64, 2) if outputs <= ORDERED_SUM_SMALL else (256, 4)


# ---------------------------------------------------------------------------------------------
# routed experts
# ---------------------------------------------------------------------------------------------
# MoE chunks of any size go through expert_linear (one launch per projection): one-row programs for a few
# rows, per-expert tiles from EXPERT_TILE_MIN_SLOTS slots (no host read of the routing, no loop over experts)
SLOT_MOE_ROWS = 1 << 62
EXPERT_TILE_MIN_SLOTS = 512  # from this many slots expert_linear groups each expert's slots into tiles
EXPERT_WIDEN_BYTES = 1 << 30  # a prefill's bank is dequantised to bf16 in groups of experts of at most this size
# ... when its experts have this many slots on average (the threshold measured for the E4M3 widening it
# replaced: w1 of an 8,192-row chunk, 48 experts 11.28 -> 8.78 ms; 384 experts 13.49 -> 13.92,
# bench/results/kernels-experts-widened-2026-12-01.md)
EXPERT_WIDEN_MIN_SLOTS = 256

# ---------------------------------------------------------------------------------------------
# sparse attention (its blocks of indices are the reference's cpu.SPARSE_ATTN_BLOCK: they set the rounding)
# ---------------------------------------------------------------------------------------------
SPARSE_ATTN_SPLIT_MAX_N = 64  # up to this many queries, each query's output channels spread over programs
# ... of this many channels: the chain of a decode row's index blocks is latency-bound, and 16 programs of 32
# channels finish it sooner than 4 of 128 (H100, 64 heads x 512, 640 indices: 22.1 -> 18.1 us at one query,
# the same bits: bench/results/attn-decode-h100-2026-12-06.md)
SPARSE_ATTN_SLICE = 32

# ---------------------------------------------------------------------------------------------
# indexer
# ---------------------------------------------------------------------------------------------
INDEX_SCORE_ROWS = 16  # query rows per scoring program (the dot's M)
INDEX_SCORE_ENTRIES = 64  # entries per scoring program
TOPK_BLOCK = 1024  # entries a top-k program reads per step
# One program per row reads a row five times, ~6 us per 1K scores: for a few long rows torch's sort, which
# spreads a row over the GPU, is faster (H200: 4K scores kernel 26 us vs sort 55; 64K scores, 8 rows 381 vs
# 104; 64K scores, 512 rows 974 vs 1,262: bench/results/kernels-indexer-2026-12-01.md). Both give the same
# picks (selection is exact), so the launch shape never changes a bit.
TOPK_KERNEL_MAX_SCORES = 8192
TOPK_KERNEL_MIN_ROWS = 512

# ---------------------------------------------------------------------------------------------
# mHC, quantisation and the elementwise ops
# ---------------------------------------------------------------------------------------------
HC_ROWS = 4  # rows per program of the mHC split, one warp (fixed: the layout sets each row's reduction order)
FAKE_QUANT_ROWS = 64  # quantisation groups per program (fake quantisation, packed FP4 quantise / read back)
MHC_BLOCK = 512  # channels per program of collapse, expand, the MoE sum, SwiGLU and the compressor's pooling
ROW_SUM_BLOCK = 256  # row_sum's lanes; Engram's gate reduces its row sums in the same order
RMS_BLOCK = 1024  # channels per program of the RMS scaling
ENGRAM_ROWS_BLOCK = 1024  # channels per program of Engram's row gather
ROPE_ROWS = 16  # (token, head) rows per program of the RoPE rotation
# side streams (side.py): work on more rows than this runs in place. A decode step's kernels fill a few SMs and
# gain from a second chain beside them (H100: box step 8.0-8.2 -> 6.9 ms); a prefill chunk's fill the GPU alone
# and lose to the contention (8K / 32K prefill 2-3 % slower forked: bench/results/side-streams-h100-2026-12-06.md)
SIDE_MAX_ROWS = 64
