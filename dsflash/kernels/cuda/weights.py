"""The CUDA kernels' weight layouts: CudaWeight (FP8 codes with E8M0 scale words; FP4 codes in the word
layout the GEMM decodes with shifts and masks), made from checkpoint codes or from a reference Weight, and
an FP4 weight widened to E4M3 (the prefill's expert tiles), a weight dequantised to bf16 (the prefill's GEMMs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsflash.kernels.cpu import Weight
from dsflash.numerics import BLOCK
from dsflash.numerics.codecs import decode_e2m1, encode_e2m1, pack_fp4
from dsflash.numerics.quant import K_RANGE_GROUP

from .common import FP_FUSION, PDL_LAUNCH, TL_BLOCK, block_scales, grid_entry, times_blocks
from .configs import DEQUANT_ROWS, FP4_WIDEN_WORDS


@dataclass
class CudaWeight(Weight):
    """A Weight laid out for the CUDA kernels.

    fp8: `values` float8_e4m3fn [out, in]. fp4: `values` uint8 [out, in/2] in the word layout of
    `fp4_words` (each 8 elements one int32 word the kernel decodes with shifts and masks). bf16/fp32:
    `values` in that dtype [out, in]; an fp32 weight stored as bf16 in the checkpoint
    (the head, the router: widened by the model) keeps bf16 values, widened exactly tile by tile in the
    kernel -- half the bytes, the same values (another k order inside the MMA: FIDELITY.md).
    `scale` (fp8/fp4), when every scale is a normal power of two (always, for checkpoint weights):
    int32 words [ceil(in/128), ceil(out/scale_rows)], byte j of word c holding the E8M0 exponent
    (2^(byte-127)) of K block 4c+j, padded with 127; otherwise float32 [4*ceil(in/128),
    ceil(out/scale_rows)] padded with 1.0 (a slower path). `scale_rows` weight rows share one scale
    (32 for FP8's 32x32 tiles when the scales allow it, else 1).
    """

    scale_rows: int = 1

    @property
    def in_features(self) -> int:
        return self.values.size(1) * (2 if self.kind == "fp4" else 1)

    @property
    def scale_e8m0(self) -> bool:
        return self.scale is not None and self.scale.dtype == torch.int32


# An FP4 weight's 8 elements per int32 word: element 2i + h's magnitude (3 bits) at bits 16h + 9 - 3i and
# its sign at bit 16h + 15 - i. Shifting a word left by 3i and by i and masking gives elements 2i and 2i + 1
# as the two f16 halves of one register, each the f16 pattern (sign, magnitude << 9) of its value / 2^14
# (E2M1's subnormal 0.5 included: the E2M1 and f16 grids agree below and above 1 up to that factor).
_FP4_MAG_SHIFT = [16 * (e % 2) + 9 - 3 * (e // 2) for e in range(8)]
_FP4_SIGN_SHIFT = [16 * (e % 2) + 15 - e // 2 for e in range(8)]


def fp4_words(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint FP4 bytes [..., K/2] (element 2k in the low nibble) -> the kernels' word layout (uint8,
    same shape; K a multiple of 8)."""
    b = packed.to(torch.int64)
    codes = torch.stack([b & 15, b >> 4], -1).flatten(-2).unflatten(-1, (-1, 8))
    mag = torch.tensor(_FP4_MAG_SHIFT, device=packed.device)
    sign = torch.tensor(_FP4_SIGN_SHIFT, device=packed.device)
    words = (((codes & 7) << mag) | ((codes >> 3) << sign)).sum(-1)  # disjoint bits: the sum is the OR
    return words.to(torch.int32).contiguous().view(torch.uint8).view(packed.shape)


def _pack_scales(scale: torch.Tensor, kind: str) -> torch.Tensor:
    """float32 [rows, KB] -> K-block-major int32 words [ceil(KB/4), rows] of E8M0 bytes when every scale
    is exactly 2^(b-127) with b in 1..254 (fp4: 1..128, scales up to 2, which gemm.py's FP4 decode multiplies
    in as one bf16 2^(b-1); a checkpoint's are ~2^-8), else float32 [4*ceil(KB/4), rows] padded with 1.0."""
    rows, kb = scale.shape
    pad = -kb % K_RANGE_GROUP
    bits = scale.contiguous().view(torch.int32)
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    top = 128 if kind == "fp4" else 254
    if bool(((mantissa == 0) & (exponent >= 1) & (exponent <= top) & (bits >= 0)).all()):
        e = torch.nn.functional.pad(exponent.to(torch.uint8), (0, pad), value=127)
        return e.t().contiguous().view(-1, K_RANGE_GROUP, rows).permute(0, 2, 1).contiguous().view(torch.int32)[..., 0]
    return torch.nn.functional.pad(scale, (0, pad), value=1.0).t().contiguous()


def weight_from_codes(kind: str, codes: torch.Tensor, scale: torch.Tensor, device: torch.device) -> CudaWeight:
    """A checkpoint weight straight from its stored codes, with no float detour: fp8 E4M3 [out, in] with
    E8M0 tile scales [ceil(out/32), in/32], or fp4 bytes [out, in/2] with E8M0 scales [out, in/32]."""
    packed = _pack_scales(scale.to(device).float(), kind)
    if kind == "fp8":
        return CudaWeight("fp8", codes.to(device).contiguous(), packed, BLOCK)
    return CudaWeight("fp4", fp4_words(codes.to(device).view(torch.uint8)), packed, 1)


def to_cuda_weight(w: Weight, device: torch.device | str | None = None) -> CudaWeight:
    """Convert a CPU-reference Weight (float32 code values + per-(row, K-block) float32 scales) to the
    CUDA layout. Lossless: E4M3/E2M1 code values and power-of-two scales are stored exactly."""
    device = torch.device(device if device is not None else "cuda")
    if isinstance(w, CudaWeight):
        if w.values.device == device:
            return w
        return CudaWeight(w.kind, w.values.to(device), None if w.scale is None else w.scale.to(device), w.scale_rows)
    if w.kind in ("bf16", "fp32"):
        dtype = torch.bfloat16 if w.kind == "bf16" else torch.float32
        return CudaWeight(w.kind, w.values.to(device=device, dtype=dtype).contiguous())
    if w.kind not in ("fp8", "fp4"):
        raise ValueError(f"unknown weight kind {w.kind!r}")
    n, k = w.values.shape
    if k % BLOCK:
        raise ValueError(f"{w.kind} weight needs in_features divisible by {BLOCK}, got {k}")
    vals = w.values.float().cpu()
    scale = w.scale.float().cpu()
    assert scale.shape == (n, k // BLOCK), (scale.shape, (n, k // BLOCK))
    rows = 1
    if w.kind == "fp8":
        codes = vals.to(torch.float8_e4m3fn)
        if not torch.equal(codes.float(), vals):
            raise ValueError("fp8 weight values are not all E4M3 values")
        # one scale per BLOCK x BLOCK tile: keep one row of scales per BLOCK weight rows when the rows agree
        groups = torch.nn.functional.pad(scale, (0, 0, 0, -n % BLOCK), value=float("nan")).view(-1, BLOCK, k // BLOCK)
        if bool(((groups == groups[:, :1]) | torch.isnan(groups)).all()):
            scale, rows = scale[::BLOCK].contiguous(), BLOCK
        values = codes.to(device)
    else:
        codes = encode_e2m1(vals)
        if not torch.equal(decode_e2m1(codes), vals):
            raise ValueError("fp4 weight values are not all E2M1 values")
        values = fp4_words(pack_fp4(codes).to(device))
    return CudaWeight(w.kind, values, _pack_scales(scale, w.kind).to(device), rows)


@triton.jit
def _e2m1_bits(c, MANTISSA: tl.constexpr, HALF: tl.constexpr, SIGN: tl.constexpr):
    """4-bit E2M1 codes (int32) -> the bit patterns (int32) of the same values in a float format whose
    mantissa starts at bit MANTISSA - 1, whose 0.5 is HALF and whose sign is bit SIGN: magnitude m >= 2 is
    2^(e-1)(1+f/2) -> (m << MANTISSA) + HALF; m = 1 (0.5) -> HALF; m = 0 -> 0. E4M3: (2, 0x30, 7)."""
    mag = c & 7
    b = tl.where(mag >= 2, (mag << MANTISSA) + HALF, tl.where(mag == 1, HALF, 0))
    return b | ((c & 8) << (SIGN - 3))


@triton.jit
def _fp4_to_fp8_kernel(w_ptr, o_ptr, total_words, BLOCK: tl.constexpr):
    """FP4 words (fp4_words) -> E4M3 bytes in K order, eight per word."""
    grid_entry()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total_words
    w = tl.load(w_ptr + offs, mask=mask, other=0)
    e = tl.arange(0, 8)
    mag = (w[:, None] >> (16 * (e % 2) + 9 - 3 * (e // 2))[None, :]) & 7
    sign = (w[:, None] >> (16 * (e % 2) + 15 - e // 2)[None, :]) & 1
    o = _e2m1_bits(mag | (sign << 3), 2, 0x30, 7).to(tl.uint8)
    tl.store(o_ptr + offs[:, None] * 8 + e[None, :], o, mask=mask[:, None])


def fp4_to_fp8(values: torch.Tensor) -> torch.Tensor:
    """FP4 weight words uint8 [N, K/2] (fp4_words) -> float8_e4m3fn [N, K] (exact: every E2M1 value is an
    E4M3 value)."""
    n, kh = values.shape
    out = torch.empty((n, 2 * kh), dtype=torch.uint8, device=values.device)
    words = values.contiguous().view(torch.int32)
    _fp4_to_fp8_kernel[(triton.cdiv(words.numel(), FP4_WIDEN_WORDS),)](words, out, words.numel(),
                                                                       BLOCK=FP4_WIDEN_WORDS, num_warps=4,
                                                                       enable_fp_fusion=FP_FUSION,
                                                                       launch_pdl=PDL_LAUNCH)
    return out.view(torch.float8_e4m3fn)


@triton.jit
def _dequant_kernel(w_ptr, ws_ptr, o_ptr, N, K, stride_wn, stride_wsk, SCALE_ROWS: tl.constexpr,
                    SCALE_E8M0: tl.constexpr, ROWS: tl.constexpr):
    """E4M3 codes [N, K] times their scales (CudaWeight's layout) -> bf16 [N, K]; one program a K chunk
    (4 blocks: one scale word) of ROWS rows."""
    grid_entry()
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1)
    cols = c * 4 * TL_BLOCK + tl.arange(0, 4 * TL_BLOCK)
    rmask = rows < N
    mask = rmask[:, None] & (cols < K)[None, :]
    codes = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :], mask=mask, other=0.0)
    if SCALE_E8M0:  # the chunk's 4 blocks: the 4 bytes of each row's word
        s = block_scales(tl.load(ws_ptr + c * stride_wsk + rows // SCALE_ROWS, mask=rmask, other=0), 0, 4)
    else:
        kb = c * 4 + tl.arange(0, 4)
        s = tl.load(ws_ptr + kb[None, :] * stride_wsk + (rows // SCALE_ROWS)[:, None], mask=rmask[:, None], other=1.0)
    values = times_blocks(codes.to(tl.float32), s, ROWS, 4)
    tl.store(o_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], values.to(tl.bfloat16), mask=mask)


def dequant_weight(w: CudaWeight) -> torch.Tensor:
    """An fp8/fp4 CudaWeight's values times their scales, bf16 [out, in] (exact for power-of-two scales: E4M3
    and E2M1 codes have at most 3 mantissa bits)."""
    codes = fp4_to_fp8(w.values) if w.kind == "fp4" else w.values
    n, k = codes.shape
    out = torch.empty((n, k), dtype=torch.bfloat16, device=codes.device)
    grid = (triton.cdiv(n, DEQUANT_ROWS), triton.cdiv(k, 4 * BLOCK))
    _dequant_kernel[grid](codes, w.scale, out, n, k, codes.stride(0), w.scale.stride(-2), SCALE_ROWS=w.scale_rows,
                          SCALE_E8M0=w.scale_e8m0, ROWS=DEQUANT_ROWS, num_warps=4, enable_fp_fusion=FP_FUSION,
                          launch_pdl=PDL_LAUNCH)
    return out
