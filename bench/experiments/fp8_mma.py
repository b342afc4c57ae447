"""Experiment (GPU; the kernel also runs under Triton's interpreter): a candidate CUDA numerics 6.cuda2 for the FP8/FP4
linears -- each 32-wide K block one E4M3 x E4M3 tensor-core MMA (wgmma k32) from a zero accumulator, its sum times
the block's activation scale and then its weight scale, added in K order to the K range's sum; the range sums added
in order. That is the CPU reference's own structure (kernels/cpu.py `_block_scaled_gemm`: block partials, scaled,
range totals in order); 6.cuda1 instead converts every weight value to bf16 and runs one MMA chain per range, whose
conversions bound its decode tiles (bench/results/side-kv-attn-h100-2026-12-06.md: 480 instructions a 128-column
step, DRAM at 42 % of peak). Here the weight's bytes feed the MMA as they are stored (FP4 experts' packed bytes
widened to E4M3 codes in registers, 7 logic ops for eight: exact). What it must show before it can become the
backend's: its outputs against the CPU reference (equal where the tensor core's k32 sum is the fp32 sum), the same
bits at every row count (decode's swapped 16-row tiles with the ranges as separate programs, prefill's 64/128-row
tiles), and its time against 6.cuda1's `linear` per V4.1 shape.

    PYTHONPATH=$PWD python bench/experiments/fp8_mma.py > $OUT/fp8-mma.txt            (GPU)
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python bench/experiments/fp8_mma.py --check     (CPU: small shapes, with
    tests/interpreter_fixes.py)
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import triton
import triton.language as tl

from dsflash.kernels import cpu
from dsflash.kernels import cuda as kc
from dsflash.kernels.cuda.gemm import _ordered_sum
from dsflash.numerics import BLOCK
from dsflash.numerics.codecs import encode_e2m1
from dsflash.numerics.quant import k_range_blocks

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
REF_ROWS = 512  # rows compared with the CPU reference


# E2M1 s|e1 e0|m as the E4M3 byte s|0 0 e1 e0|m 0 0 is the value x 2^-6, exactly (the same exponent and mantissa
# bits; E2M1's subnormal 0.5 lands on E4M3's subnormal grid), so a code widens to (sign << 7) | (magnitude << 2)
# and the 2^6 goes into the block's scale. The weight is stored for it (`fp4_nibble_pairs`): in each 4-byte word of
# eight codes, byte j holds code j (low nibble) and code j + 4 (high), so one register's low nibbles widen to
# codes 0-3 and its high nibbles to codes 4-7, each four bytes in place: 7 logic ops for eight codes.
FP4_TO_E4M3_ASM = tl.constexpr(
    "{ .reg .b32 t; and.b32 $0, $2, 0x07070707; shl.b32 $0, $0, 2; and.b32 t, $2, 0x08080808; shl.b32 t, t, 4; "
    "or.b32 $0, $0, t; and.b32 $1, $2, 0x70707070; shr.b32 $1, $1, 2; and.b32 t, $2, 0x80808080; "
    "or.b32 $1, $1, t; }")


def fp4_nibble_pairs(codes: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes [N, K] -> bytes [N, K/2], byte j of each 4-byte word holding codes 8w + j (low nibble)
    and 8w + j + 4 (high nibble)."""
    c = codes.to(torch.uint8).view(codes.size(0), -1, 2, 4)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(codes.size(0), -1).contiguous()


@triton.jit
def _fp4_e4m3(w_rows, kb, nmask, BN: tl.constexpr, ASM: tl.constexpr):
    """Block kb of the weight rows' `fp4_nibble_pairs` bytes (w_rows: [BN] row pointers) -> E4M3 [BN, 32] of the
    values x 2^-6."""
    if ASM:
        packed = tl.load(w_rows[:, None] + kb * 16 + tl.arange(0, 16)[None, :], mask=nmask[:, None], other=0)
        lo, hi = tl.inline_asm_elementwise(FP4_TO_E4M3_ASM, "=r,=r,r", [packed], dtype=(tl.uint8, tl.uint8),
                                           is_pure=True, pack=4)
        e = tl.reshape(tl.permute(tl.join(tl.reshape(lo, [BN, 4, 4]), tl.reshape(hi, [BN, 4, 4])), (0, 1, 3, 2)),
                       [BN, 32])
    else:  # the same bits elementwise (Triton's interpreter has no inline PTX): code k's byte and nibble
        k = tl.arange(0, 32)
        byte = tl.load(w_rows[:, None] + kb * 16 + (4 * (k // 8) + k % 4)[None, :], mask=nmask[:, None], other=0)
        nib = (byte >> (4 * ((k % 8) // 4))[None, :].to(tl.uint8)) & 0xF
        e = ((nib & 7) << 2) | ((nib & 8) << 4)
    return e.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _byte_scale(word, j: tl.constexpr):
    """2^(e - 127) of E8M0 byte j of int32 scale words."""
    return (((word >> (8 * j)) & 0xFF) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _block_mma(x_rows, w_cols, kb, mmask, nmask, FP4: tl.constexpr, ASM: tl.constexpr, BN: tl.constexpr,
               SWAP: tl.constexpr):
    """K block kb's product of the E4M3 codes from a zero fp32 accumulator: [BM, BN], or [BN, BM] with SWAP.
    FP4: w_cols are the weight rows' pointers [BN] to `fp4_nibble_pairs` bytes, widened here."""
    a = tl.load(x_rows + kb * 32, mask=mmask[:, None], other=0.0)
    if FP4:
        w = tl.trans(_fp4_e4m3(w_cols, kb, nmask, BN, ASM))
    else:
        w = tl.load(w_cols + kb * 32, mask=nmask[None, :], other=0.0)
    if SWAP:
        blk = tl.dot(tl.trans(w), tl.trans(a))
    else:
        blk = tl.dot(a, w)
    return blk


@triton.jit
def _scaled_add(total, blk, xw, ww, j: tl.constexpr, FP4: tl.constexpr, SWAP: tl.constexpr):
    """total + blk * a_s * w_s, the scales byte j of the rows' words (powers of two: exact products; FP4's
    widened codes are 2^-6 of their values, so its scale is 2^6 larger)."""
    w_s = _byte_scale(ww, j)
    if FP4:
        w_s = w_s * 64.0
    if SWAP:
        total += blk * _byte_scale(xw, j)[None, :] * w_s[:, None]
    else:
        total += blk * _byte_scale(xw, j)[:, None] * w_s[None, :]
    return total


@triton.jit
def _fp8_mma_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, M, N, KB, chunks_per_range,
                    stride_xm, stride_xs, stride_wn, stride_wsk, stride_ym,
                    SCALE_ROWS: tl.constexpr, FP4: tl.constexpr, ASM: tl.constexpr, SPREAD: tl.constexpr,
                    SWAP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """y = the sum over K ranges of (the sum over the range's 32-wide blocks, in K order from 0, of
    (A_b W_b^T) * a_s * w_s), ranges added in order. x: E4M3 codes [M, K] with scale words [ceil(KB/4), M];
    w: E4M3 codes [N, K], or FP4 E2M1 bytes [N, K/2] (`fp4_nibble_pairs`, widened in registers), with scale
    words [ceil(KB/4), ceil(N/SCALE_ROWS)]; K a multiple of 128 (a chunk: four
    blocks, one scale word; a range is whole chunks). SPREAD: program_id(1) takes one range and stores its sum
    to part[r] for _ordered_sum. SWAP: the weight tile is the MMA's A operand (64 weight rows fill the wgmma's M
    where a decode's few rows cannot)."""
    pid_m = tl.program_id(0) // tl.cdiv(N, BN)
    pid_n = tl.program_id(0) % tl.cdiv(N, BN)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, 32)
    mmask = rm < M
    nmask = rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
    if FP4:  # the rows' packed bytes
        w_cols = w_ptr + rn.to(tl.int64) * stride_wn
    else:  # [32, BN]: W^T's block 0
        w_cols = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    kc = KB // 4
    c_lo = 0
    c_hi = kc
    if SPREAD:
        c_lo = tl.program_id(1) * chunks_per_range
        c_hi = tl.minimum(c_lo + chunks_per_range, kc)
    if SWAP:
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    total = tl.zeros_like(acc)
    for c in range(c_lo, c_hi):
        xw = tl.load(xs_ptr + c * stride_xs + rm, mask=mmask, other=0x7F7F7F7F)
        ww = tl.load(ws_ptr + c * stride_wsk + rn // SCALE_ROWS, mask=nmask, other=0x7F7F7F7F)
        # the chunk's four blocks, each its own MMA from zero, all issued before the first sum is read; then
        # their scaled sums added in K order
        b0 = _block_mma(x_rows, w_cols, 4 * c, mmask, nmask, FP4, ASM, BN, SWAP)
        b1 = _block_mma(x_rows, w_cols, 4 * c + 1, mmask, nmask, FP4, ASM, BN, SWAP)
        b2 = _block_mma(x_rows, w_cols, 4 * c + 2, mmask, nmask, FP4, ASM, BN, SWAP)
        b3 = _block_mma(x_rows, w_cols, 4 * c + 3, mmask, nmask, FP4, ASM, BN, SWAP)
        total = _scaled_add(total, b0, xw, ww, 0, FP4, SWAP)
        total = _scaled_add(total, b1, xw, ww, 1, FP4, SWAP)
        total = _scaled_add(total, b2, xw, ww, 2, FP4, SWAP)
        total = _scaled_add(total, b3, xw, ww, 3, FP4, SWAP)
        if (c + 1) % chunks_per_range == 0:  # the range ends (kc is whole ranges' chunks or the last one's)
            acc += total
            total = tl.zeros_like(total)
    acc += total  # the last range's sum when it is shorter (zeros otherwise: + 0 changes no non-negative-zero sum)
    if SWAP:
        acc = tl.trans(acc)
    mask = mmask[:, None] & nmask[None, :]
    if SPREAD:
        tl.store(part_ptr + tl.program_id(1) * M * N + rm[:, None].to(tl.int64) * N + rn[None, :], acc, mask=mask)
    else:
        tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(tl.bfloat16), mask=mask)


def fp8_mma_linear(x: torch.Tensor, w: kc.CudaWeight, packed: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 [M, K] @ an FP8/FP4 CudaWeight (E8M0 scale words) -> bf16 [M, N] under the candidate numerics; an FP4
    weight's codes come as `packed` (`fp4_nibble_pairs`)."""
    m, k = x.shape
    n, kb = w.out_features, k // BLOCK
    codes, words = kc.quant_act(x)
    wv = packed if w.kind == "fp4" else w.values
    assert kb % 4 == 0, "K a multiple of 128 (every V4.1 FP8/FP4 shape)"
    per = k_range_blocks(n, kb)
    swap = m <= 16  # a decode's few rows: the swapped 16-row tiles
    bm, bn = (16, 64) if swap else (64, 64)
    ranges = triton.cdiv(kb, per)
    spread = swap and ranges > 1
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    part = torch.empty((ranges, m, n), dtype=torch.float32, device=x.device) if spread else y
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), ranges if spread else 1)
    _fp8_mma_kernel[grid](codes, words, wv, w.scale, y, part, m, n, kb, per // 4, codes.stride(0), words.stride(0),
                          wv.stride(0), w.scale.stride(0), y.stride(0), SCALE_ROWS=w.scale_rows, FP4=w.kind == "fp4",
                          ASM=not INTERPRET, SPREAD=spread, SWAP=swap, BM=bm, BN=bn, num_warps=4, num_stages=4)
    if spread:
        _ordered_sum(part, y, ranges)
    return y


def compare(name: str, kind: str, n: int, k: int, rows: tuple[int, ...], device: str, time_it: bool) -> None:
    from tests.test_kernels_cuda import rand_act, rand_weight

    g = torch.Generator().manual_seed(7)
    w_ref = rand_weight(kind, n, k, g)
    x = rand_act(max(rows), k, g)
    # the CPU reference (the oracle) on the first REF_ROWS rows: its per-block partials of 8,192 rows would take
    # tens of GB
    ref = cpu.linear(x[:REF_ROWS], w_ref)
    w = kc.to_cuda_weight(w_ref, device)
    packed = fp4_nibble_pairs(encode_e2m1(w_ref.values)).to(device) if kind == "fp4" else None
    xd = x.to(device)
    mma = functools.partial(fp8_mma_linear, w=w, packed=packed)
    full = mma(xd).cpu()
    cuda1 = kc.linear(xd, w).cpu() if device == "cuda" else None
    for m in rows:
        y = mma(xd[:m]).cpu()
        r = min(m, REF_ROWS)
        equal = float((y[:r] == ref[:r]).float().mean())
        line = f"| {name} {k}->{n} | {m} | {int((y != full[:m]).sum())} | {equal:.4f} |"
        if cuda1 is not None:
            line += f" {float((cuda1[:r] == ref[:r]).float().mean()):.4f} |"
        if time_it:
            from dsflash.bench.kernels import bench_graph

            mine = bench_graph(functools.partial(mma, xd[:m])) * 1e3
            theirs = bench_graph(functools.partial(kc.linear, xd[:m], w)) * 1e3
            line += f" {mine:.1f} | {theirs:.1f} |"
        print(line, flush=True)


def main() -> None:
    if "--check" in sys.argv:  # the interpreter on CPU tensors: the structure, on small shapes
        sys.path.insert(0, "tests")
        import interpreter_fixes  # noqa: F401  (the fp32 -> bf16/fp8 casts and masks the GPU has)

        print("| shape | M | outputs differing from the largest call's rows | equal to the CPU reference |")
        for name, kind, n, k in (("fp8", "fp8", 128, 512), ("fp4", "fp4", 64, 1024)):
            compare(name, kind, n, k, (1, 5, 40), "cpu", False)
        return
    from dsflash.bench.kernels import LINEARS

    print("| shape | M | outputs differing from the 8,192-row call's rows | 6.cuda2 equal to the CPU reference "
          "(first 512 rows) | 6.cuda1 equal to it | 6.cuda2 us | 6.cuda1 us |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, kind, n, k in LINEARS:
        if kind in ("fp8", "fp4"):
            compare(name, kind, n, k, (1, 5, 8, 16, 512, 8192), "cuda", True)


if __name__ == "__main__":
    main()
