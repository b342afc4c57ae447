"""The ops a layer runs on every row, each one launch with the rounding points of the torch composition it
replaces (IEEE divisions, fp fusion off where products must round): the fixed-order row sums and what is
built on them (mean square, RMSNorm, the mHC mix scale, the stream mean), the MoE sum, SwiGLU, the
compressor's pooling, Engram's row gather and gate, RoPE."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dsflash.numerics import exact_div

from .common import FP_FUSION, PDL_LAUNCH, TL_BLOCK, grid_entry, sigmoid
from .configs import ENGRAM_ROWS_BLOCK, MHC_BLOCK, RMS_BLOCK, ROPE_ROWS, ROW_SUM_BLOCK


# ---------------------------------------------------------------------------------------------
# row reductions with a fixed order (torch's CUDA reductions pick their split by tensor shape, so a
# row's sum could depend on how many rows share the call)
# ---------------------------------------------------------------------------------------------
@triton.jit
def _row_total(x_row, D, SQUARE: tl.constexpr, BLOCK: tl.constexpr):
    """The fp32 sum (of squares: FMAs) of a row's D values in BLOCK lanes, then one tl.sum of the lanes: the
    same bits in every kernel that calls it under 4 warps."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, D, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(x_row + offs, mask=offs < D, other=0.0).to(tl.float32)
        acc = tl.fma(v, v, acc) if SQUARE else acc + v
    return tl.sum(acc, axis=0)


@triton.jit
def _row_sum_kernel(x_ptr, y_ptr, D, stride, SQUARE: tl.constexpr, BLOCK: tl.constexpr):
    grid_entry()
    row = tl.program_id(0).to(tl.int64)
    tl.store(y_ptr + row, _row_total(x_ptr + row * stride, D, SQUARE, BLOCK))


def row_sum(x: torch.Tensor, square: bool = False) -> torch.Tensor:
    """fp32 sum (of squares) over the last dim, one program per row, fixed order: [..., D] -> [...]."""
    shape = x.shape[:-1]
    x2 = x.reshape(-1, x.size(-1)).contiguous()
    y = torch.empty(x2.size(0), dtype=torch.float32, device=x.device)
    if x2.size(0):
        _row_sum_kernel[(x2.size(0),)](x2, y, x2.size(1), x2.stride(0), SQUARE=square, BLOCK=ROW_SUM_BLOCK,
                                       enable_fp_fusion=FP_FUSION, launch_pdl=PDL_LAUNCH)
    return y.view(shape)


@triton.jit
def _rms_scale_kernel(v_ptr, x_ptr, w_ptr, o_ptr, D, C, eps, stride_vn, stride_xn, stride_on, HAS_WEIGHT: tl.constexpr,
                      BLOCK: tl.constexpr, SUM_BLOCK: tl.constexpr):
    """out = [w *] (v * rsqrt(ss / D + eps)) in fp32, rounded once to o's dtype: torch's ops in one launch.
    ss: the sum of squares of x's row (D values), _row_total as row_sum computes it (its SUM_BLOCK lanes, the
    same 4 warps), so each of the row's programs has row_sum's bits without a launch of its own; v, w, out: C
    columns."""
    grid_entry()
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < C
    ss = _row_total(x_ptr + n * stride_xn, D, True, SUM_BLOCK)
    r = tl.rsqrt(tl.math.div_rn(ss, D.to(tl.float32)) + eps)
    y = tl.load(v_ptr + n * stride_vn + offs, mask=mask).to(tl.float32) * r
    if HAS_WEIGHT:
        y = tl.load(w_ptr + offs, mask=mask).to(tl.float32) * y
    tl.store(o_ptr + n * stride_on + offs, y.to(o_ptr.dtype.element_ty), mask=mask)


def _rms_scaled(values: torch.Tensor, x: torch.Tensor, eps: float, weight: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
    """[weight *] values * rsqrt(mean(x^2) + eps) row by row, with this backend's fixed-order row sum of x's
    squares, in one launch (x: rows with unit last stride; x, values: bf16 or fp32, widened in the kernels)."""
    rows, c = values.shape
    out = torch.empty((rows, c), dtype=dtype, device=values.device)
    if rows:
        _rms_scale_kernel[(rows, triton.cdiv(c, RMS_BLOCK))](values, x,
                                                            values if weight is None else weight.contiguous(), out,
                                                            x.size(-1), c, float(eps), values.stride(0), x.stride(0),
                                                            out.stride(0), HAS_WEIGHT=weight is not None,
                                                            BLOCK=RMS_BLOCK, SUM_BLOCK=ROW_SUM_BLOCK, num_warps=4,
                                                            enable_fp_fusion=False, launch_pdl=PDL_LAUNCH)
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, D] with unit stride along D, in its own dtype (the kernels widen bf16 exactly on load)."""
    x2 = x.reshape(-1, x.size(-1))
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """cpu.rms_norm with this backend's mean square: one kernel for the fixed-order row sum of squares, the
    division (IEEE, as torch's), rsqrt and the two products. Triton's rsqrt is `rsqrt.approx.ftz`
    (PTX of Triton 3.6 and 3.9), torch's the same instruction without ftz: equal on the normal values a
    mean square plus eps gives."""
    xr = _rows(x)
    return _rms_scaled(xr, xr, eps, weight, x.dtype).view(x.shape)


def rms_scale(values: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """cpu.rms_scale (the mHC mixes times their input's inverse RMS) as rms_norm does it: fp32 [N, C]."""
    return _rms_scaled(values.float().contiguous(), _rows(x), eps, None, torch.float32)


def small_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over a short dim as explicit adds in fp32, first index first, in x's dtype."""
    parts = x.float().unbind(dim)
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc.to(x.dtype)


def mean_square(x: torch.Tensor) -> torch.Tensor:
    """mean(x^2) over the last dim, keepdim, from the fixed-order row sum of squares."""
    return exact_div(row_sum(x, square=True), x.size(-1)).unsqueeze(-1)


def stream_mean(h: torch.Tensor) -> torch.Tensor:
    """Mean over the mHC streams (dim 1), in h's dtype, from small_sum."""
    return exact_div(small_sum(h.float(), 1), h.size(1)).to(h.dtype)


# ---------------------------------------------------------------------------------------------
# the MoE sum, SwiGLU, the compressor's pooling
# ---------------------------------------------------------------------------------------------
@triton.jit
def _moe_sum_kernel(r_ptr, s_ptr, o_ptr, D, stride_rn, stride_rk, stride_sn, stride_on, K: tl.constexpr,
                    BLOCK: tl.constexpr):
    grid_entry()
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(K):
        acc = acc + tl.load(r_ptr + n * stride_rn + k * stride_rk + offs, mask=mask).to(tl.float32)
    acc = acc + tl.load(s_ptr + n * stride_sn + offs, mask=mask).to(tl.float32)
    tl.store(o_ptr + n * stride_on + offs, acc.to(o_ptr.dtype.element_ty), mask=mask)


def moe_sum(routed: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """cpu.moe_sum in one kernel (the same fp32 adds from zero, in slot order, then the shared expert)."""
    n, k, d = routed.shape
    if routed.stride(2) != 1:
        routed = routed.contiguous()
    if shared.stride(1) != 1:
        shared = shared.contiguous()
    out = torch.empty((n, d), dtype=shared.dtype, device=shared.device)
    if n:
        _moe_sum_kernel[(n, triton.cdiv(d, MHC_BLOCK))](routed, shared, out, d, routed.stride(0), routed.stride(1),
                                                        shared.stride(0), out.stride(0), K=k, BLOCK=MHC_BLOCK,
                                                        num_warps=4, enable_fp_fusion=False, launch_pdl=PDL_LAUNCH)
    return out


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, w_ptr, o_ptr, B, D, stride_ga, stride_gb, stride_ua, stride_ub, limit,
                   CLAMP: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    """Row r = a * B + b of out = [w_r *] silu(gate) * up with the clamps: torch's ops in fp32 (silu as its
    CUDA kernel, x / (1 + expf(-x)), IEEE division), rounded once to out's dtype."""
    grid_entry()
    r = tl.program_id(0)
    a = (r // B).to(tl.int64)
    b = (r % B).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    g = tl.load(g_ptr + a * stride_ga + b * stride_gb + offs, mask=mask).to(tl.float32)
    u = tl.load(u_ptr + a * stride_ua + b * stride_ub + offs, mask=mask).to(tl.float32)
    if CLAMP:
        u = tl.clamp(u, -limit, limit)
        g = tl.minimum(g, limit)
    h = tl.math.div_rn(g, 1.0 + libdevice.exp(-g)) * u
    if HAS_WEIGHT:
        h = tl.load(w_ptr + r) * h
    tl.store(o_ptr + r.to(tl.int64) * D + offs, h.to(o_ptr.dtype.element_ty), mask=mask)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, weights: torch.Tensor | None = None) -> torch.Tensor:
    """cpu.swiglu in one kernel (gate, up: [R, D] or [A, B, D] views with unit last stride; weights: one
    fp32 per row), out contiguous in gate's dtype."""
    assert gate.shape == up.shape and gate.stride(-1) == 1 and up.stride(-1) == 1
    g3, u3 = (gate.unsqueeze(1), up.unsqueeze(1)) if gate.dim() == 2 else (gate, up)
    a, b, d = g3.shape
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    w = out if weights is None else weights.float().reshape(a * b).contiguous()
    if a * b:
        _swiglu_kernel[(a * b, triton.cdiv(d, MHC_BLOCK))](g3, u3, w, out, b, d, g3.stride(0), g3.stride(1),
                                                           u3.stride(0), u3.stride(1), float(limit),
                                                           CLAMP=limit > 0, HAS_WEIGHT=weights is not None,
                                                           BLOCK=MHC_BLOCK, num_warps=4, enable_fp_fusion=False,
                                                           launch_pdl=PDL_LAUNCH)
    return out


@triton.jit
def _softmax_pool_kernel(kv_ptr, s_ptr, o_ptr, D, stride_kg, stride_kj, stride_sg, stride_sj,
                         R: tl.constexpr, BLOCK: tl.constexpr):
    """torch's CUDA ops, rounding for rounding: the softmax over the group (max from -inf, the exponentials'
    sum from 0 in row order, each probability exp(s - max) / sum with expf and an IEEE division), then the
    products with kv summed from 0 in row order (the order torch's sum takes for ratio 2)."""
    grid_entry()
    g = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for j in tl.static_range(R):
        m = tl.maximum(m, tl.load(s_ptr + g * stride_sg + j * stride_sj + offs, mask=mask, other=0.0))
    den = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(R):
        den += libdevice.exp(tl.load(s_ptr + g * stride_sg + j * stride_sj + offs, mask=mask, other=0.0) - m)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(R):
        p = tl.math.div_rn(libdevice.exp(tl.load(s_ptr + g * stride_sg + j * stride_sj + offs, mask=mask,
                                                 other=0.0) - m), den)
        acc += tl.load(kv_ptr + g * stride_kg + j * stride_kj + offs, mask=mask, other=0.0) * p
    tl.store(o_ptr + g * D + offs, acc.to(tl.bfloat16), mask=mask)


def softmax_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """model/attention.py softmax_pool in one kernel (kv, score: fp32 [G, ratio, D] views, unit last stride)."""
    assert kv.shape == score.shape and kv.stride(-1) == 1 and score.stride(-1) == 1
    g, r, d = kv.shape
    out = torch.empty((g, d), dtype=torch.bfloat16, device=kv.device)
    if g:
        _softmax_pool_kernel[(g, triton.cdiv(d, MHC_BLOCK))](kv, score, out, d, kv.stride(0), kv.stride(1),
                                                            score.stride(0), score.stride(1), R=r, BLOCK=MHC_BLOCK,
                                                            num_warps=4, enable_fp_fusion=False, launch_pdl=PDL_LAUNCH)
    return out


# ---------------------------------------------------------------------------------------------
# Engram: the hashed rows' gather + dequantisation, and the gated add to the streams
# ---------------------------------------------------------------------------------------------
@triton.jit
def _engram_rows_kernel(t_ptr, s_ptr, id_ptr, o_ptr, DE, BLOCK: tl.constexpr):
    """Row ids[r] of the FP8 table times its E8M0 scales (one per 32), rounded once to bf16."""
    grid_entry()
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < DE
    row = tl.load(id_ptr + r)
    v = tl.load(t_ptr + row * DE + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(s_ptr + row * (DE // TL_BLOCK) + offs // TL_BLOCK, mask=mask, other=127).to(tl.int32)
    # E8M0 byte -> 2^(b - 127) as torch converts it: 0 -> 2^-127 (subnormal), 255 -> NaN
    bits = tl.where(b == 0, 0x00400000, tl.where(b == 255, 0x7FC00000, b << 23))
    tl.store(o_ptr + r * DE + offs, (v * bits.to(tl.float32, bitcast=True)).to(tl.bfloat16), mask=mask)


def engram_rows(table: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """cpu.engram_rows in one kernel (table float8_e4m3fn [rows, De], scale E8M0 [rows, De / 32])."""
    if table.dtype != torch.float8_e4m3fn or scale.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"Engram rows take an E4M3 table and E8M0 scales, got {table.dtype} and {scale.dtype}")
    de = table.size(-1)
    out = torch.empty((*ids.shape, de), dtype=torch.bfloat16, device=table.device)
    flat = ids.reshape(-1).contiguous()
    if flat.numel():
        _engram_rows_kernel[(flat.numel(), triton.cdiv(de, ENGRAM_ROWS_BLOCK))](table.contiguous(),
                                                                   scale.contiguous().view(torch.uint8), flat, out,
                                                                   de, BLOCK=ENGRAM_ROWS_BLOCK, num_warps=4,
                                                                   enable_fp_fusion=False, launch_pdl=PDL_LAUNCH)
    return out


@triton.jit
def _engram_gate_kernel(h_ptr, k_ptr, v_ptr, qk_ptr, m_ptr, o_ptr, HC, D, stride_hn, stride_hs, stride_kn,
                        stride_ks, stride_vn, d, eps, scale, floor, MASK: tl.constexpr, BLOCK: tl.constexpr):
    """One (token, stream): model/engram.py engram_gate with the CUDA backend's row sums (BLOCK-wide lanes, the square
    sums as the FMAs its compiled row_sum uses, the product sum of the separately rounded products), IEEE
    divisions, torch's sigmoid 1 / (1 + expf(-x)); then the stream plus gate * value in bf16."""
    grid_entry()
    n = (tl.program_id(0) // HC).to(tl.int64)
    st = tl.program_id(0) % HC
    h_row = h_ptr + n * stride_hn + st * stride_hs
    k_row = k_ptr + n * stride_kn + st * stride_ks
    acc_h = tl.zeros([BLOCK], dtype=tl.float32)
    acc_k = tl.zeros([BLOCK], dtype=tl.float32)
    acc_d = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, D, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < D
        hv = tl.load(h_row + offs, mask=mask, other=0.0).to(tl.float32)
        kv = tl.load(k_row + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.load(qk_ptr + st * D + offs, mask=mask, other=0.0)
        acc_h = tl.fma(hv, hv, acc_h)
        acc_k = tl.fma(kv, kv, acc_k)
        acc_d += (hv * q) * kv
    rstd = (tl.rsqrt(tl.math.div_rn(tl.sum(acc_h, axis=0), d) + eps)
            * tl.rsqrt(tl.math.div_rn(tl.sum(acc_k, axis=0), d) + eps))
    dot = (tl.sum(acc_d, axis=0) * rstd) * scale
    root = tl.sqrt_rn(tl.maximum(tl.abs(dot), floor))
    signed = tl.where((dot.to(tl.int32, bitcast=True) & -2147483648) != 0, -root, root)  # copysign
    gate = sigmoid(signed)
    if MASK:
        gate = tl.where(tl.load(m_ptr + n) != 0, 0.0, gate)
    for start in range(0, D, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < D
        hv = tl.load(h_row + offs, mask=mask, other=0.0).to(tl.float32)
        vv = tl.load(v_ptr + n * stride_vn + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_ptr + (n * HC + st) * D + offs, (hv + gate * vv).to(o_ptr.dtype.element_ty), mask=mask)


def engram_gate(h: torch.Tensor, key: torch.Tensor, value: torch.Tensor, qk_weight: torch.Tensor, eps: float,
                image_mask: torch.Tensor | None) -> torch.Tensor:
    """model/engram.py engram_gate with this backend's mean square and row sum, one program per (token, stream)
    (h [N, hc, D], key [N, hc, D], value [N, D]: views with unit last stride)."""
    n, hc, d = h.shape
    assert key.shape == h.shape and value.shape == (n, d) and h.stride(-1) == key.stride(-1) == value.stride(-1) == 1
    out = torch.empty((n, hc, d), dtype=h.dtype, device=h.device)
    mask = image_mask.contiguous().view(torch.uint8) if image_mask is not None else out
    if n:
        _engram_gate_kernel[(n * hc,)](h, key, value, qk_weight.float().contiguous(), mask, out, hc, d,
                                       h.stride(0), h.stride(1), key.stride(0), key.stride(1), value.stride(0),
                                       float(d), float(eps), float(d ** -0.5), 1e-6, MASK=image_mask is not None,
                                       BLOCK=ROW_SUM_BLOCK, num_warps=4, enable_fp_fusion=False, launch_pdl=PDL_LAUNCH)
    return out


# ---------------------------------------------------------------------------------------------
# RoPE: one kernel per rotation instead of ~5 torch ops (widen, gather the factors, conjugate, complex
# multiply, narrow back), with the CPU's rounding points: each product rounded, then the add (no FMA
# contraction, which nvcc may apply to torch's CUDA complex multiply: its fmad default is on)
# ---------------------------------------------------------------------------------------------
@triton.jit
def _rope_kernel(x_ptr, t_ptr, pos_ptr, R, H, stride_xn, stride_xh, OFF, INVERSE: tl.constexpr,
                 HALF: tl.constexpr, BR: tl.constexpr):
    grid_entry()
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    mask = (r < R)[:, None]
    n = r // H
    pos = tl.load(pos_ptr + n, mask=r < R, other=0)
    j = tl.arange(0, HALF)[None, :]
    xp = x_ptr + (n * stride_xn + (r % H) * stride_xh + OFF)[:, None] + 2 * j
    tp = t_ptr + (pos * (2 * HALF))[:, None] + 2 * j
    a = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(xp + 1, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(tp, mask=mask, other=0.0)
    d = tl.load(tp + 1, mask=mask, other=0.0)
    if INVERSE:  # the conjugate; a factor, so +0 becomes -0 as conj() makes it (Triton's minus is 0 - x)
        d = d * -1.0
    tl.store(xp, (a * c - b * d).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(xp + 1, (a * d + b * c).to(x_ptr.dtype.element_ty), mask=mask)


def rope_rotate(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, dim: int, inverse: bool
                ) -> torch.Tensor:
    """cpu.rope_rotate in one kernel, bit for bit (x [N, C] or [N, H, C] with unit last stride)."""
    x3 = x.unsqueeze(1) if x.dim() == 2 else x
    n, h, c = x3.shape
    assert x3.stride(2) == 1 and table.dtype == torch.complex64 and dim % 2 == 0
    if n * h:
        _rope_kernel[(triton.cdiv(n * h, ROPE_ROWS),)](x3, torch.view_as_real(table), positions.contiguous(), n * h, h,
                                                  x3.stride(0), x3.stride(1), c - dim, INVERSE=inverse,
                                                  HALF=dim // 2, BR=ROPE_ROWS, num_warps=2, enable_fp_fusion=False,
                                                  launch_pdl=PDL_LAUNCH)
    return x
