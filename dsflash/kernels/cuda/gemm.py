"""The GEMMs: activation quantisation, the block-scaled FP8/FP4 GEMM, the plain bf16/fp32 GEMM, the in-order
sum of K-range partials; `linear` and `grouped_linear`.

Numerics (spec §3; the CUDA backend's own, numerics.CUDA_NUMERICS_VERSION):
- FP8/FP4 linear: the activation is quantised to E4M3 per 32 values with a power-of-two scale (the
  exponent-bit trick, bit-exact with numerics/quant.py); the GEMM is the dequantised matmul of Q8(x) and W
  up to fp32 summation order, as the spec defines it: both operands are exactly dequantised to bf16 (E4M3
  and E2M1 codes have at most 3 mantissa bits and every scale is a power of two) and each K range (fixed by
  the weight's shape, quant.k_range_blocks) is one tensor-core MMA chain in K order from a fresh fp32
  accumulator; the range sums are added in order and rounded once to bf16. The CPU reference instead sums
  each 32-wide block apart and adds the scaled block sums (kernels/cpu.py): another fp32 order over the same
  exact products (FIDELITY.md measures the difference). A decode call dequantises its tiles in registers
  (FP8 codes, FP4 words that shifts and masks turn into f16 pairs of value / 2^14); from DEQUANT_MIN_M rows
  both operands are dequantised to bf16 in memory first and the plain GEMM below runs the same chains at
  the tensor cores' rate. Every tile's MMAs are k16 steps in K order, so the bits never depend on M.
- bf16/fp32 linear: one tiled dot with fp32 accumulation over K in fixed BK steps (fp32 weights use
  3xTF32 tensor-core products by default, IEEE fp32 FMA dots on request); output in the weight's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.kernels.cpu import Weight
from dsflash.numerics import BLOCK
from dsflash.numerics.quant import K_RANGE_GROUP, k_range_blocks

from .common import FP_FUSION, PDL_LAUNCH, TL_BLOCK, block_scales, grid_entry, quant_tile, scale_bytes, times_blocks
from .configs import (
    ACT_QUANT_BLOCKS,
    ACT_QUANT_ROWS,
    DEQUANT_MIN_M,
    FP4_PRECONVERT_M,
    FUSE_QUANT_MAX_M,
    PLAIN_WIDE_MIN_M,
    SPREAD_MAX_M,
    LinearConfig,
    dequant_gemm_config,
    linear_config,
    ordered_sum_config,
    plain_k_per_split,
    plain_wide_config,
)
from .weights import CudaWeight, dequant_weight, fp4_to_fp8, to_cuda_weight

_ONE_WORD = tl.constexpr(0x7F7F7F7F)  # four E8M0 bytes of 2^0


# ---------------------------------------------------------------------------------------------
# activation quantisation (the standalone kernel; the fused GEMM prologue is common.quant_tile)
# ---------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["M"])
def _act_quant_kernel(x_ptr, q_ptr, e_ptr, M, KB, stride_xm, stride_qm,
                      BLOCK_M: tl.constexpr, BLOCK_KB: tl.constexpr, DEQUANTISE: tl.constexpr):
    grid_entry()
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    for j in tl.static_range(BLOCK_KB):
        kb = pid_k * BLOCK_KB + j
        if kb < KB:
            cols = kb * TL_BLOCK + tl.arange(0, TL_BLOCK)
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=rmask[:, None], other=0.0)
            q, e, s = quant_tile(x.to(tl.float32))
            if DEQUANTISE:  # Q8(x) as bf16: the code times its power-of-two scale, exact
                q = (q.to(tl.float32) * s[:, None]).to(tl.bfloat16)
            tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], q, mask=rmask[:, None])
            if not DEQUANTISE:  # byte kb % 4 of word (kb // 4, row): words [ceil(KB/4), M]
                tl.store(e_ptr + ((kb // 4) * M + rows).to(tl.int64) * 4 + kb % 4, e.to(tl.uint8), mask=rmask)


def _act_quant(x: torch.Tensor, q: torch.Tensor, e: torch.Tensor, dequantise: bool) -> None:
    m, kb = x.size(0), x.size(1) // BLOCK
    if m:
        grid = (triton.cdiv(m, ACT_QUANT_ROWS), triton.cdiv(kb, ACT_QUANT_BLOCKS))
        _act_quant_kernel[grid](x, q, e, m, kb, x.stride(0), q.stride(0), BLOCK_M=ACT_QUANT_ROWS,
                                BLOCK_KB=ACT_QUANT_BLOCKS, DEQUANTISE=dequantise, num_warps=4,
                                enable_fp_fusion=FP_FUSION, launch_pdl=PDL_LAUNCH)


def quant_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [M, K] -> (E4M3 codes float8_e4m3fn [M, K], scale words int32 [ceil(K/128), M]: byte j of
    word c is the E8M0 exponent of row's K block 4c+j, padded with 127). Bit-exact with
    quant.fp8_act_codes; `act_scales` decodes the words to its [M, K/32] float32 form."""
    assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.size(1) % BLOCK == 0
    x = x.contiguous()
    m, k = x.shape
    kb = k // BLOCK
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    e = torch.empty((triton.cdiv(kb, K_RANGE_GROUP), m, K_RANGE_GROUP), dtype=torch.uint8, device=x.device)
    if kb % K_RANGE_GROUP:
        e[-1] = 127  # bytes past the last K block: 2^0
    _act_quant(x, q, e, False)
    return q, e.view(torch.int32)[..., 0]


def dequant_act(x: torch.Tensor) -> torch.Tensor:
    """bf16 [M, K] -> Q8(x) as bf16 [M, K]: each E4M3 code of quant_act times its block's scale (exact)."""
    assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.size(1) % BLOCK == 0
    x = x.contiguous()
    q = torch.empty_like(x)
    _act_quant(x, q, q, True)
    return q


def act_scales(words: torch.Tensor, k: int) -> torch.Tensor:
    """Scale words [ceil(K/128), M] -> float32 scales [M, K/32] (for tests)."""
    e = words.contiguous().unsqueeze(-1).view(torch.uint8)  # [KC, M, 4]
    e = e.permute(1, 0, 2).reshape(words.size(1), -1)[:, : k // BLOCK]
    return (e.to(torch.int32) << 23).view(torch.float32)


# ---------------------------------------------------------------------------------------------
# block-scaled FP8/FP4 GEMM
# ---------------------------------------------------------------------------------------------
@triton.jit
def _fp4_word_values(w, BN: tl.constexpr, BK: tl.constexpr):
    """FP4 words [BN, BK/8] (fp4_words) -> f16 [BN, BK]: each value / 2^14."""
    i = tl.arange(0, 4)[None, None, :]
    # register i of a word: elements 2i and 2i + 1 as its two f16 halves
    r = ((w[:, :, None] << (3 * i)) & 0x0E000E00) | ((w[:, :, None] << i) & -2147450880)  # 0x80008000
    return _pair_halves(r, BN, BK).to(tl.float16, bitcast=True)


@triton.jit
def _pair_halves(r, BN: tl.constexpr, BK: tl.constexpr):
    """int32 registers of element pairs (2p, 2p + 1), BK / 2 a row in any [BN, ...] shape -> their 16-bit
    halves int16 [BN, BK], the low half first."""
    r = tl.reshape(r, [BN, BK // 2])
    return tl.reshape(tl.join((r & 0xFFFF).to(tl.int16), (r >> 16).to(tl.int16)), [BN, BK])


# a packed bf16 product, as an FMA adding -0 (x + -0 is x, signed zeros too; mul.bf16x2 needs sm_90, this sm_80):
# one rounding, and subnormals kept (E2M1's 0.5 is one below, as 0.5 x 2^-126)
BF16X2_MUL_ASM = tl.constexpr("{ .reg .b32 z; mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, $1, $2, z; }")


@triton.jit
def _fp4_scaled_values(w, bw, first, NB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """FP4 words [BN, BK/8] (fp4_words) with their E8M0 scale words bw [BN] -> bf16 [BN, BK], each value
    times its block's scale (blocks first .. first + NB - 1 of the words). The word's shifts and masks give
    elements 2i and 2i + 1 as one register's two bf16 halves of value x 2^-126 (the magnitude three bits
    lower than the f16 route's, E2M1's 0.5 a bf16 subnormal), and one packed product with 2^(b-1) (b <= 128:
    weights.py keeps E8M0 words for FP4 only then) gives value x 2^(b-127), exactly: one instruction per pair
    where the f16 route converts each value to fp32, multiplies and packs it back (SASS of the decode slot
    tile: 1,016 -> 704 instructions)."""
    scale = (scale_bytes(bw, first, NB) + 126)[:, :, None, None]  # bf16 exponent field of 2^(b-1)
    i = tl.arange(0, 4)[None, None, None, :]
    w4 = tl.reshape(w, [BN, NB, TL_BLOCK // 8])[:, :, :, None]  # a block's 4 words
    r = (((w4 << (3 * i)) >> 3) & 0x01C001C0) | ((w4 << i) & -2147450880)  # 0x80008000
    r = tl.inline_asm_elementwise(BF16X2_MUL_ASM, "=r,r,r", [r, (scale << 7) | (scale << 23)], dtype=tl.int32,
                                  is_pure=True, pack=1)
    return _pair_halves(r, BN, BK).to(tl.bfloat16, bitcast=True)


@triton.jit
def _tile_ids(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def _expert_tile(tile_ptr, slot_ptr, expert_lo, expert_hi, slots_per_row, BM: tl.constexpr):
    """Program t = program_id(2) of experts.py's tile table (rows (expert, first, count): slots slot[first ..
    first + count), grouped by expert) -> (its expert relative to expert_lo, its slot count -- 0 for the table's
    spare tiles and for experts outside [expert_lo, expert_hi), which then do no work --, the row mask, the
    output rows (the slots) and the activation rows (slot // slots_per_row))."""
    t = tl.program_id(2)
    e = tl.load(tile_ptr + 3 * t).to(tl.int64)
    count = tl.load(tile_ptr + 3 * t + 2)
    count = tl.where((e >= expert_lo) & (e < expert_hi), count, 0)
    mmask = tl.arange(0, BM) < count
    out_rows = tl.load(slot_ptr + tl.load(tile_ptr + 3 * t + 1) + tl.arange(0, BM), mask=mmask, other=0)
    return e - expert_lo, count, mmask, out_rows, out_rows // slots_per_row


@triton.jit
def _load_step(x_rows, w_rows, k0, K, mmask, nmask, FP4: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr):
    """The activation and weight tiles of the BK columns from k0, as stored (zeros past K). EVEN: the tiles
    never cross N's or K's end (every V4.1 shape), so only the activation's rows are masked."""
    rk = tl.arange(0, BK)
    if EVEN:
        a = tl.load(x_rows + k0, mask=mmask[:, None], other=0.0)
        w = tl.load(w_rows + (k0 // 8 if FP4 else k0))
    else:
        a = tl.load(x_rows + k0, mask=mmask[:, None] & (k0 + rk < K)[None, :], other=0.0)
        if FP4:  # eight values a word
            rw = tl.arange(0, BK // 8)
            w = tl.load(w_rows + k0 // 8, mask=nmask[:, None] & (k0 // 8 + rw < K // 8)[None, :], other=0)
        else:
            w = tl.load(w_rows + k0, mask=nmask[None, :] & (k0 + rk < K)[:, None], other=0.0)
    return a, w


@triton.jit
def _step_operands(a, w, aw, bw, j: tl.constexpr, k0, ws_rows, stride_wsk, nmask, FP4: tl.constexpr,
                   ACT: tl.constexpr, SCALE_E8M0: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr):
    """One MMA step's operands (step j of a chunk's BK-wide steps), exactly dequantised to bf16: A [BM, BK] =
    Q8(x) (codes times their power-of-two scale) and B [BK, BN] = W^T (codes times the weight's scale). E4M3
    and E2M1 codes have at most 3 mantissa bits and the scales are powers of two, so both products are exact
    in bf16 (a float32 weight scale that is no power of two -- never a checkpoint's -- is rounded here). The
    scales multiply [rows, blocks, 32] views of the tiles: one scale decoded per row and block, not per value."""
    NB: tl.constexpr = BK // TL_BLOCK  # blocks per step
    if ACT == "quantise":  # quantised per 32-wide block: the step's blocks as rows
        q, _e, q_s = quant_tile(tl.reshape(a.to(tl.float32), [BM * NB, TL_BLOCK]))
        a_d = tl.reshape(q.to(tl.float32) * q_s[:, None], [BM, BK]).to(tl.bfloat16)
    elif ACT == "codes":
        a_d = times_blocks(a.to(tl.float32), block_scales(aw, j * NB, NB), BM, NB).to(tl.bfloat16)
    else:  # "bf16": Q8(x) dequantised already
        a_d = a
    if SCALE_E8M0 and FP4:  # each pair scaled as it is decoded
        b_d = tl.trans(_fp4_scaled_values(w, bw, j * NB, NB, BN, BK))
    else:
        if SCALE_E8M0:
            b_s = block_scales(bw, j * NB, NB)
        else:  # float32 scales [4 ceil(KB / 4), rows], padded with 1.0
            kb = k0 // TL_BLOCK + tl.arange(0, NB)
            b_s = tl.load(ws_rows[:, None] + kb[None, :] * stride_wsk, mask=nmask[:, None], other=1.0)
        if FP4:  # the f16 values are value / 2^14, their scale 2^14 larger
            b_d = tl.trans(times_blocks(_fp4_word_values(w, BN, BK).to(tl.float32), b_s * 16384.0, BN, NB))
        else:  # [BK, BN]: the blocks run down the rows
            b_d = tl.reshape(tl.reshape(w.to(tl.float32), [NB, TL_BLOCK, BN]) * tl.trans(b_s)[:, None, :], [BK, BN])
    return a_d, b_d.to(tl.bfloat16)


@triton.jit
def _mma(a, b, acc, SWAP: tl.constexpr):
    """acc + A B, one tensor-core MMA chain in K order. SWAP: acc is the transposed [BN, BM] sum and the
    weight tile is the MMA's A operand: a decode's few rows cannot fill a Hopper wgmma's 64-row M, 64 weight
    rows can (and only wgmma gives the large tiles' bits: mma.sync accumulates another way)."""
    if SWAP:
        acc = tl.dot(tl.trans(b), tl.trans(a), acc)
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit(do_not_specialize=["M", "stride_xs", "stride_pk", "expert_lo", "expert_hi"])
def _bs_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, slot_ptr, tile_ptr, M, N, KB, chunks_per_split,
                    stride_xm, stride_wn, stride_wsk, stride_ym, stride_xs, stride_pk, stride_we, stride_wse,
                    slots_per_row, expert_lo, expert_hi,
                    FP4: tl.constexpr, ACT: tl.constexpr, SCALE_ROWS: tl.constexpr,
                    SCALE_E8M0: tl.constexpr, SPREAD: tl.constexpr, SLOTS: tl.constexpr, GROUPED: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                    RANGES: tl.constexpr, SWAP: tl.constexpr, EVEN: tl.constexpr):
    """y[M, N] = the product of the exactly dequantised operands (see linear), fp32 sums rounded once to bf16.
    K runs in chunks of 4 blocks (one scale word); the chunks form ranges of `chunks_per_split`
    (quant.k_range_blocks, fixed by the weight's shape): each range is one tensor-core MMA chain in K order from a
    fresh fp32 accumulator, and the range sums are added in range order.
    The loads are plain, so that Triton's pipeliner streams them through shared memory (cp.async,
    num_stages deep): a register double buffer measured 2-3x slower at large M (bench/results).
    SPREAD: program_id(1) takes one range and stores its sum to part[s, m, n], which _ordered_sum_kernel
    adds in range order -- the bits of one program looping over the ranges.
    SLOTS (routed experts): program_id(2) is slot s, one output row computed as a one-row call would
    compute it, with activation row s // slots_per_row and expert slot[s] of a stacked weight bank.
    GROUPED (routed experts, many slots): program_id(2) is tile t of up to BM slots of one expert
    (tile[t] = (expert, first, count): slots slot[first .. first + count), grouped by expert); each slot's
    row is computed as in SLOTS (a row's bits never depend on its tile) and stored at its slot's row; only the
    tiles of experts [expert_lo, expert_hi) work, the bank at w_ptr holding just those experts."""
    grid_entry()
    if SLOTS:
        s = tl.program_id(2)
        e = tl.load(slot_ptr + s).to(tl.int64)
        w_ptr += e * stride_we
        ws_ptr += e * stride_wse
        x_ptr += (s // slots_per_row).to(tl.int64) * stride_xm
        xs_ptr += s // slots_per_row
        y_ptr += s.to(tl.int64) * stride_ym
        part_ptr += s.to(tl.int64) * N
    pid_m, pid_n = _tile_ids(M, N, BM, BN, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mmask = rm < M
    nmask = rn < N
    rk = tl.arange(0, BK)
    in_rows = rm  # activation rows
    out_rows = rm  # output rows
    KC = tl.cdiv(KB, 4)
    if GROUPED:
        e, count, mmask, out_rows, in_rows = _expert_tile(tile_ptr, slot_ptr, expert_lo, expert_hi, slots_per_row, BM)
        w_ptr += e * stride_we
        ws_ptr += e * stride_wse
        KC = tl.where(count > 0, KC, 0)
    x_rows = x_ptr + in_rows[:, None].to(tl.int64) * stride_xm + rk[None, :]
    if FP4:  # a step's BK / 8 words per weight row
        w_rows = ((w_ptr + rn[:, None].to(tl.int64) * stride_wn).to(tl.pointer_type(tl.int32))
                  + tl.arange(0, BK // 8)[None, :])
    else:
        w_rows = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    ws_rows = ws_ptr + rn // SCALE_ROWS  # each weight row's scales (a column of the scale words)
    xs_rows = xs_ptr + in_rows
    c_lo = 0
    c_hi = KC
    if SPREAD:
        c_lo = tl.program_id(1) * chunks_per_split
        c_hi = tl.minimum(c_lo + chunks_per_split, KC)
    if ACT == "codes":
        aw_next = tl.load(xs_rows + c_lo * stride_xs, mask=mmask, other=_ONE_WORD)
    if SCALE_E8M0:
        bw_next = tl.load(ws_rows + c_lo * stride_wsk, mask=nmask, other=_ONE_WORD)
    # one loop over the chunks (a loop per range would drain Triton's load pipeline at every range end).
    # RANGES (the program crosses range ends): `total` sums the current range, added to `acc` where the
    # range ends -- a second accumulator, ~70 more registers on 64x64 tiles, so only where needed
    if SWAP:  # see _mma
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    if RANGES:
        total = tl.zeros_like(acc)
    for c in range(c_lo, c_hi):
        more = c + 1 < c_hi
        aw = 0
        bw = 0
        if ACT == "codes":
            aw = aw_next
            aw_next = tl.load(xs_rows + (c + 1) * stride_xs, mask=mmask & more, other=_ONE_WORD)
        if SCALE_E8M0:
            bw = bw_next
            bw_next = tl.load(ws_rows + (c + 1) * stride_wsk, mask=nmask & more, other=_ONE_WORD)
        for j in tl.static_range(4 * TL_BLOCK // BK):  # the chunk in BK-wide MMA steps
            k0 = c * 4 * TL_BLOCK + j * BK
            a, w = _load_step(x_rows, w_rows, k0, KB * TL_BLOCK, mmask, nmask, FP4, BK, EVEN)
            # one MMA chain over the range: a block past K adds 0 products to a sum that is never -0
            a, b = _step_operands(a, w, aw, bw, j, k0, ws_rows, stride_wsk, nmask, FP4, ACT, SCALE_E8M0,
                                  BM, BN, BK)
            if RANGES:
                total = _mma(a, b, total, SWAP)
            else:
                acc = _mma(a, b, acc, SWAP)
        if RANGES:
            if ((c + 1) % chunks_per_split == 0) | (c + 1 == KC):  # the range ends
                acc += total
                total = tl.zeros_like(total)
    if SWAP:
        acc = tl.trans(acc)
    # SPREAD: acc is this program's range sum, stored for _ordered_sum_kernel
    mask = mmask[:, None] & nmask[None, :]
    if SPREAD:
        part = part_ptr + tl.program_id(1) * stride_pk + rm[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(part, acc, mask=mask)
    else:
        tl.store(y_ptr + out_rows[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(tl.bfloat16), mask=mask)


@triton.jit
def _load_eight(p, mn, mask, kb, KB):
    """part[kb .. kb+7] at p (rows mn apart), 0 past KB."""
    v0 = tl.load(p, mask=mask & (kb < KB), other=0.0)
    v1 = tl.load(p + mn, mask=mask & (kb + 1 < KB), other=0.0)
    v2 = tl.load(p + 2 * mn, mask=mask & (kb + 2 < KB), other=0.0)
    v3 = tl.load(p + 3 * mn, mask=mask & (kb + 3 < KB), other=0.0)
    v4 = tl.load(p + 4 * mn, mask=mask & (kb + 4 < KB), other=0.0)
    v5 = tl.load(p + 5 * mn, mask=mask & (kb + 5 < KB), other=0.0)
    v6 = tl.load(p + 6 * mn, mask=mask & (kb + 6 < KB), other=0.0)
    v7 = tl.load(p + 7 * mn, mask=mask & (kb + 7 < KB), other=0.0)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _add_eight(acc, v0, v1, v2, v3, v4, v5, v6, v7):
    return ((((((((acc + v0) + v1) + v2) + v3) + v4) + v5) + v6) + v7)


@triton.jit(do_not_specialize=["M"])
def _ordered_sum_kernel(part_ptr, y_ptr, M, N, KB, stride_ym, BLOCK: tl.constexpr):
    """y[m, n] = ((0 + part[0, m, n]) + part[1, m, n]) + ..., fp32 adds in K order, stored in y's dtype;
    32 loads are issued before their adds so the chain waits on one latency per 32 blocks. A block past
    KB adds +0 to an accumulator that is never -0."""
    grid_entry()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mn = M * N
    mask = offs < mn
    p = part_ptr + offs.to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for kb0 in range(0, KB, 32):
        a0, a1, a2, a3, a4, a5, a6, a7 = _load_eight(p, mn, mask, kb0, KB)
        b0, b1, b2, b3, b4, b5, b6, b7 = _load_eight(p + 8 * mn, mn, mask, kb0 + 8, KB)
        c0, c1, c2, c3, c4, c5, c6, c7 = _load_eight(p + 16 * mn, mn, mask, kb0 + 16, KB)
        d0, d1, d2, d3, d4, d5, d6, d7 = _load_eight(p + 24 * mn, mn, mask, kb0 + 24, KB)
        acc = _add_eight(acc, a0, a1, a2, a3, a4, a5, a6, a7)
        acc = _add_eight(acc, b0, b1, b2, b3, b4, b5, b6, b7)
        acc = _add_eight(acc, c0, c1, c2, c3, c4, c5, c6, c7)
        acc = _add_eight(acc, d0, d1, d2, d3, d4, d5, d6, d7)
        p += 32 * mn
    m = offs // N
    n = offs % N
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _ordered_sum(part: torch.Tensor, y: torch.Tensor, terms: int) -> None:
    """y[m, n] = the in-order fp32 sum of part[0..terms-1, m, n] (part contiguous [terms, M, N])."""
    m, n = y.shape
    block, warps = ordered_sum_config(m * n)
    _ordered_sum_kernel[(triton.cdiv(m * n, block),)](part, y, m, n, terms, y.stride(0), BLOCK=block,
                                                      num_warps=warps, enable_fp_fusion=FP_FUSION,
                                                      launch_pdl=PDL_LAUNCH)


def _range_blocks(w: Weight, n: int, kb: int) -> int:
    """K blocks per summation range: a tensor-parallel shard sums by its whole weight's K ranges (an expert
    bank has no such field)."""
    return k_range_blocks(getattr(w, "k_range_out", None) or n, kb)


def block_scaled_gemm(a: torch.Tensor, a_s: torch.Tensor, wv: torch.Tensor, w: Weight, y: torch.Tensor, *,
                      fp4: bool, act: str, cfg: LinearConfig, spread: bool | None,
                      slots: torch.Tensor | None = None, slots_per_row: int = 1,
                      tiles: torch.Tensor | None = None, experts: tuple[int, int] | None = None) -> None:
    """Launch the block-scaled GEMM into y (and the sum of the K ranges when they run as separate programs).
    With `slots`, y's row s is activation row s // slots_per_row times the bank's expert slots[s]; with
    `tiles` too (experts.py's expert tiles), `slots` is the slot order grouped by expert and tile t takes up
    to BM of them, only those of `experts` (lo, hi) when given, the bank then holding experts lo .. hi - 1.
    `act`: what `a` holds -- "codes" (quant_act's E4M3 codes, `a_s` their scale words), "quantise" (the bf16
    activation, quantised in the tiles) or "bf16" (Q8(x) as bf16: dequant_act)."""
    n, k = y.size(1), a.size(1)
    kb = k // BLOCK
    cps = _range_blocks(w, n, kb) // K_RANGE_GROUP
    splits = triton.cdiv(triton.cdiv(kb, K_RANGE_GROUP), cps)
    rows = y.size(0)
    stacked = slots is not None and tiles is None
    m = 1 if slots is not None else rows  # rows per program column: a slot is a one-row call
    if spread is None:  # a decode tile's K chain is latency-bound: its ranges run side by side (measured:
        # bench/results/decode-gemm-2026-11-30.txt)
        spread = m <= SPREAD_MAX_M
    spread = spread and splits > 1 and tiles is None
    part = torch.empty((splits, rows, n), dtype=torch.float32, device=a.device) if spread else y
    programs = rows if stacked else tiles.size(0) if tiles is not None else 1
    grid = (triton.cdiv(m, cfg.BM) * triton.cdiv(n, cfg.BN), splits if spread else 1, programs)
    lo, hi = experts or (0, wv.size(0))  # without `experts`: all of a bank's experts (unused without tiles)
    _bs_gemm_kernel[grid](a, a_s, wv, w.scale, y, part, slots if slots is not None else y,
                          tiles if tiles is not None else y, m, n, kb, cps,
                          a.stride(0), wv.stride(-2), w.scale.stride(-2), y.stride(0),
                          a_s.stride(0) if act == "codes" else m, rows * n,
                          wv.stride(0) if slots is not None else 0, w.scale.stride(0) if slots is not None else 0,
                          slots_per_row, lo, hi, FP4=fp4, ACT=act, SCALE_ROWS=w.scale_rows,
                          SCALE_E8M0=w.scale_e8m0, SPREAD=spread, SLOTS=stacked, GROUPED=tiles is not None, BM=cfg.BM,
                          BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M, RANGES=splits > 1 and not spread, SWAP=cfg.swap,
                          EVEN=kb % K_RANGE_GROUP == 0 and n % cfg.BN == 0, num_warps=cfg.num_warps,
                          num_stages=cfg.num_stages, enable_fp_fusion=FP_FUSION, launch_pdl=PDL_LAUNCH)
    if spread:
        _ordered_sum(part, y, splits)


# ---------------------------------------------------------------------------------------------
# plain bf16 / fp32 GEMM
# ---------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["M", "expert_lo", "expert_hi"])
def _plain_gemm_kernel(x_ptr, w_ptr, y_ptr, part_ptr, slot_ptr, tile_ptr, M, N, K, k_per_split, part_cols,
                       stride_xm, stride_wn, stride_ym, group_x, group_w, group_y, slots_per_row, expert_lo,
                       expert_hi, PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       GROUP_M: tl.constexpr, SPLIT: tl.constexpr, RANGES: tl.constexpr, GATHER: tl.constexpr):
    # program_id(1) picks one of several independent GEMMs laid side by side (grouped `wo_a`); each is
    # computed exactly as a single call with the same config would. The K ranges [s * k_per_split, (s + 1) *
    # k_per_split) are fixed by the weight's shape, never by M; each range's dots chain from a zero
    # accumulator and the range sums add in s order. SPLIT: program_id(2) takes range s and stores its fp32
    # sum to part[s, m, g * N + n] (part_cols = groups * N columns) for _ordered_sum_kernel. RANGES (large M):
    # one program runs every range and adds their sums in order itself: the same bits, no partials in memory.
    # GATHER (a prefill's routed experts, operands dequantised): program_id(2) is tile t of up to BM slots of one
    # expert as _bs_gemm_kernel's GROUPED, the bank's experts group_w apart (only [expert_lo, expert_hi) here).
    grid_entry()
    g = tl.program_id(1).to(tl.int64)
    x_ptr += g * group_x
    w_ptr += g * group_w
    y_ptr += g * group_y
    pid_m, pid_n = _tile_ids(M, N, BM, BN, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    mmask = rm < M
    nmask = rn < N
    in_rows = rm
    out_rows = rm
    k_lo = 0
    k_hi = K
    if GATHER:
        e, count, mmask, out_rows, in_rows = _expert_tile(tile_ptr, slot_ptr, expert_lo, expert_hi, slots_per_row, BM)
        w_ptr += e * group_w
        k_hi = tl.where(count > 0, K, 0)
    xp = x_ptr + in_rows[:, None].to(tl.int64) * stride_xm + rk[None, :]
    wp = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    if SPLIT:
        k_lo = tl.program_id(2) * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if RANGES:
        total = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        kmask = (k0 + rk) < k_hi  # k_per_split is a multiple of BK: only K's end cuts a step
        a = tl.load(xp + k0, mask=mmask[:, None] & kmask[None, :], other=0.0)
        # a bf16-stored fp32 weight widens exactly here (its low TF32 part is 0: the same products)
        b = tl.load(wp + k0, mask=nmask[None, :] & kmask[:, None], other=0.0).to(a.dtype)
        acc = tl.dot(a, b, acc, input_precision=PREC)
        if RANGES:
            if ((k0 + BK) % k_per_split == 0) | (k0 + BK >= K):  # the range ends
                total += acc
                acc = tl.zeros([BM, BN], dtype=tl.float32)
    if RANGES:
        acc = total
    if SPLIT:
        part = (part_ptr + tl.program_id(2).to(tl.int64) * M * part_cols + rm[:, None].to(tl.int64) * part_cols
                + g * N + rn[None, :])
        tl.store(part, acc, mask=mmask[:, None] & nmask[None, :])
    else:
        y = y_ptr + out_rows[:, None].to(tl.int64) * stride_ym + rn[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def _plain_gemm(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, kind: str, groups: int, prec: str,
                config: LinearConfig | None) -> None:
    """y[:, g] = x[:, g] @ w[g]^T for each of `groups` bf16/fp32 GEMMs (x [M, groups * K] rows, w [groups, N,
    K], y [M, groups * N]). The K ranges come from the weight's shape (plain_k_per_split of its
    linear_config); from PLAIN_WIDE_MIN_M rows the tile is wider along N (fewer re-reads of x, same MMA per
    output element) and one program adds its ranges (no [splits, M, N] partials): the same bits."""
    m = y.size(0)
    n, k = w.shape[-2:]
    cfg = config or linear_config(kind, n, k)
    k_per_split = plain_k_per_split(cfg, n, k)
    splits = triton.cdiv(k, k_per_split)
    wide = config is None and m >= PLAIN_WIDE_MIN_M
    if wide:
        cfg = plain_wide_config(cfg, n)
    split = splits > 1 and not wide
    part = torch.empty((splits, m, groups * n), dtype=torch.float32, device=x.device) if split else y
    grid = (triton.cdiv(m, cfg.BM) * triton.cdiv(n, cfg.BN), groups, splits if split else 1)
    _plain_gemm_kernel[grid](x, w, y, part, y, y, m, n, k, k_per_split, groups * n, x.stride(0), w.stride(-2),
                             y.stride(0), k, n * k, n, 1, 0, 0, PREC=prec, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK,
                             GROUP_M=cfg.GROUP_M, SPLIT=split, RANGES=wide and splits > 1, GATHER=False,
                             num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=FP_FUSION,
                             launch_pdl=PDL_LAUNCH)
    if split:
        _ordered_sum(part, y, splits)


def dequantised_gemm(a: torch.Tensor, b: torch.Tensor, w: Weight, y: torch.Tensor, *,
                     slots: torch.Tensor | None = None, slots_per_row: int = 1, tiles: torch.Tensor | None = None,
                     experts: tuple[int, int] = (0, 1)) -> None:
    """y = a @ b^T over operands dequantised to bf16 in memory (dequant_act, weights.dequantise: exact) with the
    FP8/FP4 weight w's K ranges, one program adding them in order: per output element the MMA chain of the
    register-dequantising tiles, at the tensor cores' rate. With `tiles` (experts.py's expert tiles; b a bank
    [experts hi - lo, out, in]), y's rows are the slots as in block_scaled_gemm."""
    k = a.size(1)
    n = y.size(1)
    range_k = _range_blocks(w, n, k // BLOCK) * BLOCK
    cfg = dequant_gemm_config(n)
    m = cfg.BM if tiles is not None else a.size(0)  # rows per program column: a tile's slots
    grid = (triton.cdiv(m, cfg.BM) * triton.cdiv(n, cfg.BN), 1, tiles.size(0) if tiles is not None else 1)
    lo, hi = experts
    _plain_gemm_kernel[grid](a, b, y, y, slots if slots is not None else y, tiles if tiles is not None else y, m, n,
                             k, range_k, n, a.stride(0), b.stride(-2), y.stride(0), 0, b.stride(0) if b.dim() == 3
                             else 0, 0, slots_per_row, lo, hi, PREC="tf32", BM=cfg.BM, BN=cfg.BN, BK=cfg.BK,
                             GROUP_M=cfg.GROUP_M, SPLIT=False, RANGES=range_k < k, GATHER=tiles is not None,
                             num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=FP_FUSION,
                             launch_pdl=PDL_LAUNCH)


def linear(x: torch.Tensor, w: Weight, *, out: torch.Tensor | None = None,
           config: LinearConfig | None = None, fuse_quant: bool | None = None,
           spread: bool | None = None, preconvert: bool | None = None, dequantise: bool | None = None,
           fp32_precision: str = "tf32x3") -> torch.Tensor:
    """y = x @ W^T by the weight's storage kind (see cpu.linear). x: [M, in] on CUDA. fp8/fp4 take a
    bf16 activation and give bf16; bf16/fp32 weights give their own dtype. A non-CUDA-layout Weight
    is converted on the fly (convert once with to_cuda_weight instead).
    Keyword overrides are for tests and benchmarks: `config` (tile config), and four choices that
    never change bits: `fuse_quant`, `spread` (the K ranges as separate programs), `preconvert`
    (widen FP4 to E4M3 before the GEMM) and `dequantise` (both operands to bf16 in memory first, the plain
    GEMM's tiles; default from DEQUANT_MIN_M rows unless `config` names the tiles); `fp32_precision` for
    fp32 weights: "tf32x3" (default: three TF32 tensor-core products, measured closer to the CPU's fp32
    than the alternative and 3-4.5x faster) or "ieee" (fp32 FMA dots, one long K chain per output)."""
    if not isinstance(w, CudaWeight) or w.values.device != x.device:
        w = to_cuda_weight(w, x.device)
    assert x.dim() == 2 and x.size(1) == w.in_features, (tuple(x.shape), w.in_features)
    m, k = x.shape
    n = w.out_features
    if w.kind in ("fp8", "fp4"):
        if x.dtype != torch.bfloat16:
            raise TypeError(f"{w.kind} linear takes a bf16 activation, got {x.dtype}")
        cfg = config or linear_config(w.kind, n, k, m)
        y = out if out is not None else torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
        if m == 0:
            return y
        x = x.contiguous()
        if dequantise if dequantise is not None else config is None and m >= DEQUANT_MIN_M:
            # Q8(x) and W dequantised in memory once a call, then a tensor-core-rate GEMM
            dequantised_gemm(dequant_act(x), dequant_weight(w), w, y)
            return y
        fuse = m <= FUSE_QUANT_MAX_M if fuse_quant is None else fuse_quant
        a, a_s = (x, x) if fuse else quant_act(x)  # fused: a_s unused
        wv, fp4 = w.values, w.kind == "fp4"
        if fp4 and (m >= FP4_PRECONVERT_M if preconvert is None else preconvert):
            wv, fp4 = fp4_to_fp8(wv), False
        block_scaled_gemm(a, a_s, wv, w, y, fp4=fp4, act="quantise" if fuse else "codes", cfg=cfg, spread=spread)
        return y
    dtype = torch.float32 if w.kind == "fp32" else torch.bfloat16
    # a bf16 activation of an fp32 weight is widened here: widened in the kernel, 3xTF32 gives other bits
    # (Triton then takes another MMA path; docs/rejected-ideas.md)
    x = x.to(dtype).contiguous()
    y = out if out is not None else torch.empty((m, n), dtype=dtype, device=x.device)
    if m == 0:
        return y
    _plain_gemm(x, w.values, y, w.kind, 1, fp32_precision if dtype == torch.float32 else "tf32", config)
    return y


def grouped_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The grouped output projection: x [M, G, D] bf16, w [G, R, D] bf16 -> [M, G, R] bf16, one launch;
    group g's bits equal `linear(x[:, g], Weight("bf16", w[g]))`."""
    m, groups, d = x.shape
    r = w.size(1)
    x = x.to(torch.bfloat16).contiguous()
    w = w.to(torch.bfloat16).contiguous()
    y = torch.empty((m, groups, r), dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return y
    _plain_gemm(x.view(m, groups * d), w, y.view(m, groups * r), "bf16", groups, "tf32", None)
    return y
