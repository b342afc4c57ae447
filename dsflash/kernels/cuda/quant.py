"""KV / index fake-quantisation (numerics/quant.py) and the packed FP4 state (numerics/packing.py), one
kernel per call instead of ~20 torch ops, bit for bit."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.numerics import BLOCK
from dsflash.numerics.codecs import E2M1_MAX
from dsflash.numerics.packing import check_width, packed_width

from .common import PDL_LAUNCH, grid_entry, quant_tile
from .configs import FAKE_QUANT_ROWS

_E2M1_MAX_INV = tl.constexpr(1.0 / E2M1_MAX)  # rounded to float32 in the product, as quant.py's constant
_FP4_E4M3_SCALE_FLOOR = tl.constexpr(6 * 2.0 ** -9)  # quant.fp4_fake_quant's clamps of a group's amax
_FP4_POW2_SCALE_FLOOR = tl.constexpr(6 * 2.0 ** -126)


@triton.jit
def _fp4_codes(x, E4M3_SCALE: tl.constexpr):
    """Groups [BR, G] (fp32) -> quant.fp4_scaled's scales [BR] and each value's E2M1 magnitude code (0..7)
    and sign (1 where negative, -0 included), the rounding of quant.e2m1_round."""
    amax = tl.max(tl.abs(x), axis=1)
    if E4M3_SCALE:  # an all-zero group keeps a non-zero scale
        s = tl.clamp(tl.math.div_rn(tl.maximum(amax, _FP4_E4M3_SCALE_FLOOR), 6.0), -448.0, 448.0)
        s = s.to(tl.float8e4nv).to(tl.float32)
    else:  # 2^ceil(log2(amax / 6)) from the exponent bits, as quant.pow2_scale
        bits = (tl.maximum(amax, _FP4_POW2_SCALE_FLOOR) * _E2M1_MAX_INV).to(tl.int32, bitcast=True)
        s = ((((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)) << 23).to(tl.float32, bitcast=True)
    v = tl.clamp(tl.math.div_rn(x, s[:, None]), -6.0, 6.0)
    # the code counts the midpoints below |v|, and the ties that round up
    mag = tl.abs(v)
    code = ((mag > 0.25).to(tl.int32) + (mag > 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
            + (mag > 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag > 3.5).to(tl.int32)
            + (mag > 5.0).to(tl.int32) + (mag == 0.75).to(tl.int32) + (mag == 1.75).to(tl.int32)
            + (mag == 3.5).to(tl.int32))
    return s, code, (v.to(tl.int32, bitcast=True) < 0).to(tl.int32)


@triton.jit
def _e2m1_value(code, negative):
    """Magnitude codes (0..7) and signs -> the E2M1 values (fp32). The sign is a factor: Triton's unary
    minus is 0 - x, which turns a -0 result into +0."""
    value = tl.where(code <= 4, code.to(tl.float32) * 0.5, tl.where(code == 5, 3.0, tl.where(code == 6, 4.0, 6.0)))
    return tl.where(negative != 0, -1.0, 1.0) * value


@triton.jit
def _fake_quant_kernel(x_ptr, o_ptr, R, FP4: tl.constexpr, E4M3_SCALE: tl.constexpr, G: tl.constexpr,
                       BR: tl.constexpr):
    """Rows of G values are quantisation groups: quantise and dequantise each, as quant.fp8_fake_quant
    (FP4 false, G = 32) or quant.fp4_fake_quant (E2M1 values, an E4M3 or a power-of-two scale)."""
    grid_entry()
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    offs = rows[:, None] * G + tl.arange(0, G)[None, :]
    mask = (rows < R)[:, None]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if FP4:
        s, code, negative = _fp4_codes(x, E4M3_SCALE)
        out = _e2m1_value(code, negative) * s[:, None]
    else:
        q, _e, s = quant_tile(x)
        out = q.to(tl.float32) * s[:, None]
    tl.store(o_ptr + offs, out.to(tl.bfloat16), mask=mask)


def _fake_quant(x: torch.Tensor, group: int, fp4: bool, e4m3_scale: bool) -> torch.Tensor:
    assert x.dtype == torch.bfloat16 and x.size(-1) % group == 0
    x = x.contiguous()
    out = torch.empty_like(x)
    rows = x.numel() // group
    if rows:
        _fake_quant_kernel[(triton.cdiv(rows, FAKE_QUANT_ROWS),)](x, out, rows, FP4=fp4, E4M3_SCALE=e4m3_scale,
                                                                  G=group, BR=FAKE_QUANT_ROWS, num_warps=4,
                                                                  enable_fp_fusion=False, launch_pdl=PDL_LAUNCH)
    return out


# The packed FP4 rows of the state (numerics/packing.py): a row of GPE groups of G values is GPE * G / 2 code
# bytes (element 2k in the low nibble), then GPE scale bytes. The scale bytes are made and read with integer
# arithmetic (E4M3 / E8M0 bit layouts), the same on the GPU and in Triton's interpreter.
@triton.jit
def _fp4_quant_packed_kernel(x_ptr, o_ptr, R, GPE, W, E4M3_SCALE: tl.constexpr, G: tl.constexpr,
                             BR: tl.constexpr):
    """Quantisation groups (rows of G values, GPE per state row) -> their code bytes and scale byte."""
    grid_entry()
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rmask = rows < R
    x = tl.load(x_ptr + rows[:, None] * G + tl.arange(0, G)[None, :], mask=rmask[:, None], other=0.0)
    s, code, negative = _fp4_codes(x.to(tl.float32), E4M3_SCALE)
    lo, hi = tl.split(tl.reshape(code | (negative << 3), [BR, G // 2, 2]))
    base = (rows // GPE) * W
    group = rows % GPE
    tl.store(o_ptr + (base + group * (G // 2))[:, None] + tl.arange(0, G // 2)[None, :],
             (lo | (hi << 4)).to(tl.uint8), mask=rmask[:, None])
    bits = s.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    if E4M3_SCALE:  # s is an E4M3 value in [2^-9, 448]: subnormal below 2^-6
        scale = tl.where(exponent >= 121, ((exponent - 120) << 3) | ((bits >> 20) & 7), (s * 512.0).to(tl.int32))
    else:  # a normal power of two: its biased exponent is the E8M0 code
        scale = exponent
    tl.store(o_ptr + base + GPE * (G // 2) + group, scale.to(tl.uint8), mask=rmask)


@triton.jit
def _fp4_dequant_packed_kernel(p_ptr, pick_ptr, o_ptr, R, GPE, W, E4M3_SCALE: tl.constexpr, G: tl.constexpr,
                               BR: tl.constexpr, PICKED: tl.constexpr):
    """Packed groups -> bf16 values: code x scale (exact in fp32 and in bf16), as packing.dequant_packed; with
    PICKED, output row i decodes packed row pick[i] (row 0 for a -1)."""
    grid_entry()
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rmask = rows < R
    if PICKED:
        base = tl.maximum(tl.load(pick_ptr + rows // GPE, mask=rmask, other=0), 0) * W
    else:
        base = (rows // GPE) * W
    group = rows % GPE
    b = tl.load(p_ptr + (base + group * (G // 2))[:, None] + tl.arange(0, G // 2)[None, :], mask=rmask[:, None],
                other=0).to(tl.int32)
    c = tl.load(p_ptr + base + GPE * (G // 2) + group, mask=rmask, other=0).to(tl.int32)
    if E4M3_SCALE:
        e, m = (c >> 3) & 15, c & 7
        s = tl.where(e == 0, m.to(tl.float32) * 0.001953125,  # subnormal: m * 2^-9
                     (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True))
        s = tl.where((e == 15) & (m == 7), float("nan"), s)
        s = tl.where((c & 0x80) != 0, -1.0, 1.0) * s
    else:  # 2^(c - 127); code 0 is the subnormal 2^-127, 255 NaN
        s = tl.where(c == 0, 5.877471754111438e-39, (c << 23).to(tl.float32, bitcast=True))
        s = tl.where(c == 255, float("nan"), s)
    lo = _e2m1_value(b & 7, b & 8) * s[:, None]
    hi = _e2m1_value((b >> 4) & 7, b & 128) * s[:, None]
    out = tl.reshape(tl.join(lo, hi), [BR, G])
    tl.store(o_ptr + rows[:, None] * G + tl.arange(0, G)[None, :], out.to(tl.bfloat16), mask=rmask[:, None])


def fp4_quant_packed(x: torch.Tensor, block: int, e4m3_scale: bool) -> torch.Tensor:
    """packing.quant_packed in one kernel (bf16 [n, d] -> uint8 [n, d/2 + d/block]), byte for byte."""
    assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.size(1) % block == 0
    x = x.contiguous()
    n, d = x.shape
    gpe = d // block
    out = torch.empty((n, packed_width(d, block)), dtype=torch.uint8, device=x.device)
    if n:
        _fp4_quant_packed_kernel[(triton.cdiv(n * gpe, FAKE_QUANT_ROWS),)](
            x, out, n * gpe, gpe, out.size(1), E4M3_SCALE=e4m3_scale, G=block, BR=FAKE_QUANT_ROWS, num_warps=4,
            enable_fp_fusion=False, launch_pdl=PDL_LAUNCH)
    return out


def fp4_dequant_packed(packed: torch.Tensor, d: int, block: int, e4m3_scale: bool) -> torch.Tensor:
    """packing.dequant_packed in one kernel (uint8 [n, d/2 + d/block] -> bf16 [n, d]), bit for bit."""
    return _dequant(packed, None, d, block, e4m3_scale)


def fp4_dequant_picked(packed: torch.Tensor, picks: torch.Tensor, d: int, block: int, e4m3_scale: bool
                       ) -> torch.Tensor:
    """model/attention.picked_entries in one kernel: the packed rows `picks` names (int64, any shape; -1 reads
    row 0), decoded, a row a pick -- the gather inside the decode's loads."""
    return _dequant(packed, picks.flatten().contiguous(), d, block, e4m3_scale)


def _dequant(packed: torch.Tensor, picks: torch.Tensor | None, d: int, block: int, e4m3_scale: bool) -> torch.Tensor:
    check_width(packed, d, block)
    packed = packed.contiguous()
    n, gpe = (packed.size(0) if picks is None else picks.numel()), d // block
    out = torch.empty((n, d), dtype=torch.bfloat16, device=packed.device)
    if n:
        _fp4_dequant_packed_kernel[(triton.cdiv(n * gpe, FAKE_QUANT_ROWS),)](
            packed, packed if picks is None else picks, out, n * gpe, gpe, packed.size(1), E4M3_SCALE=e4m3_scale,
            G=block, BR=FAKE_QUANT_ROWS, PICKED=picks is not None, num_warps=4, enable_fp_fusion=False,
            launch_pdl=PDL_LAUNCH)
    return out


def fp8_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """quant.fp8_fake_quant in one kernel (bf16 [..., K], K a multiple of 32), bit for bit."""
    return _fake_quant(x, BLOCK, False, False)


def fp4_fake_quant(x: torch.Tensor, block: int, e4m3_scale: bool) -> torch.Tensor:
    """quant.fp4_fake_quant in one kernel, bit for bit."""
    return _fake_quant(x, block, True, e4m3_scale)
