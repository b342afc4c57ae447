"""mHC: the split + Sinkhorn of the mixes (fp32, one row's 24 mixes through the whole split and 20
normalisations in one pass; a one-warp program takes a fixed tile of HC_ROWS rows that never interact),
and the streams' collapse and expansion."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .common import FP_FUSION, PDL_LAUNCH, grid_entry, sigmoid
from .configs import HC_ROWS, MHC_BLOCK


# ---------------------------------------------------------------------------------------------
# split + Sinkhorn
# ---------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["N"])
def _hc_kernel(mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, states_ptr, N, iters, eps,
               HC: tl.constexpr, ROWS: tl.constexpr, SAVE: tl.constexpr):
    # SAVE (training): every column normalisation's result to states [iters, N, HC * HC] for the backward
    grid_entry()
    pid = tl.program_id(0)
    NM: tl.constexpr = 2 * HC + HC * HC
    r = pid * ROWS + tl.arange(0, ROWS)
    rmask = r < N
    j = tl.arange(0, HC)
    row = mix_ptr + r.to(tl.int64) * NM
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    m_pre = tl.load(row[:, None] + j[None, :], mask=rmask[:, None], other=0.0)
    m_post = tl.load(row[:, None] + HC + j[None, :], mask=rmask[:, None], other=0.0)
    cidx = j[:, None] * HC + j[None, :]
    m_comb = tl.load(row[:, None, None] + 2 * HC + cidx[None, :, :], mask=rmask[:, None, None], other=0.0)
    pre = sigmoid(m_pre * s0 + tl.load(base_ptr + j)[None, :]) + eps
    post = 2.0 * sigmoid(m_post * s1 + tl.load(base_ptr + HC + j)[None, :])
    c = m_comb * s2 + tl.load(base_ptr + 2 * HC + cidx)[None, :, :]
    c = libdevice.exp(c - tl.max(c, axis=2)[:, :, None])
    c = tl.math.div_rn(c, tl.sum(c, axis=2)[:, :, None]) + eps
    c = tl.math.div_rn(c, tl.sum(c, axis=1)[:, None, :] + eps)
    out_r = r.to(tl.int64)
    cell = out_r[:, None, None] * (HC * HC) + cidx[None, :, :]
    if SAVE:
        tl.store(states_ptr + cell, c, mask=rmask[:, None, None])
    for t in range(1, iters):
        c = tl.math.div_rn(c, tl.sum(c, axis=2)[:, :, None] + eps)
        c = tl.math.div_rn(c, tl.sum(c, axis=1)[:, None, :] + eps)
        if SAVE:
            tl.store(states_ptr + t * N.to(tl.int64) * (HC * HC) + cell, c, mask=rmask[:, None, None])
    tl.store(pre_ptr + out_r[:, None] * HC + j[None, :], pre, mask=rmask[:, None])
    tl.store(post_ptr + out_r[:, None] * HC + j[None, :], post, mask=rmask[:, None])
    tl.store(comb_ptr + cell, c, mask=rmask[:, None, None])


def hc_split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
                      eps: float, states: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC coefficients from the (2+hc)*hc mixes (fp32): pre [.., hc], post [.., hc] and the
    Sinkhorn-normalised comb [.., hc, hc] (see cpu.hc_split_sinkhorn). With `states` (fp32 [iters, rows,
    hc * hc], training) each column normalisation's result is kept there for `hc_split_sinkhorn_backward`."""
    assert hc & (hc - 1) == 0 and mixes.size(-1) == (2 + hc) * hc and iters >= 1
    lead = mixes.shape[:-1]
    m = mixes.reshape(-1, mixes.size(-1)).float().contiguous()
    n = m.size(0)
    dev = mixes.device
    pre = torch.empty((n, hc), dtype=torch.float32, device=dev)
    post = torch.empty((n, hc), dtype=torch.float32, device=dev)
    comb = torch.empty((n, hc, hc), dtype=torch.float32, device=dev)
    if states is not None:
        assert states.shape == (iters, n, hc * hc) and states.dtype == torch.float32 and states.is_contiguous()
    if n:
        _hc_kernel[(triton.cdiv(n, HC_ROWS),)](m, scale.float().contiguous(), base.float().contiguous(),
                                               pre, post, comb, comb if states is None else states, n, iters,
                                               float(eps), HC=hc, ROWS=HC_ROWS, SAVE=states is not None,
                                               num_warps=1, enable_fp_fusion=FP_FUSION, launch_pdl=PDL_LAUNCH)
    return pre.view(*lead, hc), post.view(*lead, hc), comb.view(*lead, hc, hc)


@triton.jit(do_not_specialize=["N"])
def _hc_backward_kernel(mix_ptr, scale_ptr, base_ptr, states_ptr, gpre_ptr, gpost_ptr, gcomb_ptr, dz_ptr, N, iters,
                        eps, HC: tl.constexpr, ROWS: tl.constexpr):
    # The split's gradient with respect to its pre-activations z = mixes * scale + base, [N, 24]: back through
    # the normalisations from the saved states (u = v / (sum v + eps): dv = (du - sum(du * u)) / (sum v + eps)),
    # the softmax, and the two sigmoids. A gradient, so plain divisions.
    grid_entry()
    pid = tl.program_id(0)
    NM: tl.constexpr = 2 * HC + HC * HC
    r = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    rmask = r < N
    j = tl.arange(0, HC)
    cidx = j[:, None] * HC + j[None, :]
    cell = r[:, None, None] * (HC * HC) + cidx[None, :, :]
    m3 = rmask[:, None, None]
    plane = N.to(tl.int64) * (HC * HC)
    g = tl.load(gcomb_ptr + cell, mask=m3, other=0.0)
    for i in range(1, iters):
        t = iters - i
        y = tl.load(states_ptr + t * plane + cell, mask=m3, other=0.0)
        prev = tl.load(states_ptr + (t - 1) * plane + cell, mask=m3, other=0.0)
        rows = tl.sum(prev, axis=2) + eps
        x = tl.math.div_rn(prev, rows[:, :, None])  # the forward's row normalisation, recomputed
        gx = (g - tl.sum(g * y, axis=1)[:, None, :]) / (tl.sum(x, axis=1) + eps)[:, None, :]
        g = (gx - tl.sum(gx * x, axis=2)[:, :, None]) / rows[:, :, None]
    row = mix_ptr + r * NM
    m_comb = tl.load(row[:, None, None] + 2 * HC + cidx[None, :, :], mask=m3, other=0.0)
    c = m_comb * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * HC + cidx)[None, :, :]
    e = libdevice.exp(c - tl.max(c, axis=2)[:, :, None])
    p = tl.math.div_rn(e, tl.sum(e, axis=2)[:, :, None])
    y = tl.load(states_ptr + cell, mask=m3, other=0.0)
    gx = (g - tl.sum(g * y, axis=1)[:, None, :]) / (tl.sum(p + eps, axis=1) + eps)[:, None, :]
    gc = p * (gx - tl.sum(gx * p, axis=2)[:, :, None])
    m2 = rmask[:, None]
    m_pre = tl.load(row[:, None] + j[None, :], mask=m2, other=0.0)
    m_post = tl.load(row[:, None] + HC + j[None, :], mask=m2, other=0.0)
    s_pre = sigmoid(m_pre * tl.load(scale_ptr) + tl.load(base_ptr + j)[None, :])
    s_post = sigmoid(m_post * tl.load(scale_ptr + 1) + tl.load(base_ptr + HC + j)[None, :])
    g_pre = tl.load(gpre_ptr + r[:, None] * HC + j[None, :], mask=m2, other=0.0) * s_pre * (1.0 - s_pre)
    g_post = tl.load(gpost_ptr + r[:, None] * HC + j[None, :], mask=m2, other=0.0) * 2.0 * s_post * (1.0 - s_post)
    out = dz_ptr + r * NM
    tl.store(out[:, None] + j[None, :], g_pre, mask=m2)
    tl.store(out[:, None] + HC + j[None, :], g_post, mask=m2)
    tl.store(out[:, None, None] + 2 * HC + cidx[None, :, :], gc, mask=m3)


def hc_split_sinkhorn_backward(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, states: torch.Tensor,
                               g_pre: torch.Tensor, g_post: torch.Tensor, g_comb: torch.Tensor, hc: int,
                               iters: int, eps: float) -> torch.Tensor:
    """The gradient of hc_split_sinkhorn's outputs with respect to its pre-activations (mixes * scale + base,
    fp32 [rows, (2 + hc) * hc]) from the gradients of pre, post and comb and the states its forward kept;
    the mixes', scale's and base's follow from it by a product and sums over the rows (the caller's)."""
    m = mixes.reshape(-1, mixes.size(-1)).float().contiguous()
    n = m.size(0)
    dz = torch.empty_like(m)
    if n:
        _hc_backward_kernel[(triton.cdiv(n, HC_ROWS),)](
            m, scale.float().contiguous(), base.float().contiguous(), states,
            g_pre.reshape(n, hc).float().contiguous(), g_post.reshape(n, hc).float().contiguous(),
            g_comb.reshape(n, hc * hc).float().contiguous(), dz, n, iters, float(eps), HC=hc, ROWS=HC_ROWS,
            num_warps=1, enable_fp_fusion=FP_FUSION, launch_pdl=PDL_LAUNCH)
    return dz


# ---------------------------------------------------------------------------------------------
# mHC stream collapse and expansion, each one kernel with the rounding of model/mhc.py hc_pre / hc_post as
# composed from this backend's ops (fp32 products, streams added first to last, one rounding at the
# end); launched with fp fusion off, so no multiply-add is contracted into an FMA
# ---------------------------------------------------------------------------------------------
@triton.jit
def _collapse_kernel(h_ptr, pre_ptr, o_ptr, D, stride_hn, stride_hs, stride_pn, stride_on,
                     HC: tl.constexpr, BLOCK: tl.constexpr):
    grid_entry()
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    acc = tl.load(pre_ptr + n * stride_pn) * tl.load(h_ptr + n * stride_hn + offs, mask=mask).to(tl.float32)
    for i in tl.static_range(1, HC):
        h = tl.load(h_ptr + n * stride_hn + i * stride_hs + offs, mask=mask).to(tl.float32)
        acc = acc + tl.load(pre_ptr + n * stride_pn + i) * h
    tl.store(o_ptr + n * stride_on + offs, acc.to(o_ptr.dtype.element_ty), mask=mask)


def collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_i pre[:, i] * h[:, i] in fp32, streams first to last, in h's dtype: [N, hc, D] x [N, hc] -> [N, D]."""
    n, hc, d = h.shape
    if h.stride(2) != 1:
        h = h.contiguous()
    pre = pre.float().contiguous()
    out = torch.empty((n, d), dtype=h.dtype, device=h.device)
    if n:
        _collapse_kernel[(n, triton.cdiv(d, MHC_BLOCK))](h, pre, out, d, h.stride(0), h.stride(1), pre.stride(0),
                                                         out.stride(0), HC=hc, BLOCK=MHC_BLOCK, num_warps=4,
                                                         enable_fp_fusion=False, launch_pdl=PDL_LAUNCH)
    return out


@triton.jit
def _expand_kernel(y_ptr, r_ptr, post_ptr, comb_ptr, o_ptr, D, stride_yn, stride_rn, stride_rs, stride_pn,
                   stride_cn, stride_on, stride_os, HC: tl.constexpr, BLOCK: tl.constexpr):
    # all HC output streams as one [HC, BLOCK] tile, so each residual stream is loaded once
    grid_entry()
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    ks = tl.arange(0, HC)
    y = tl.load(y_ptr + n * stride_yn + offs, mask=mask).to(tl.float32)
    r = tl.load(r_ptr + n * stride_rn + offs, mask=mask).to(tl.float32)
    mixed = tl.load(comb_ptr + n * stride_cn + ks)[:, None] * r[None, :]
    for j in tl.static_range(1, HC):
        r = tl.load(r_ptr + n * stride_rn + j * stride_rs + offs, mask=mask).to(tl.float32)
        mixed = mixed + tl.load(comb_ptr + n * stride_cn + j * HC + ks)[:, None] * r[None, :]
    out = tl.load(post_ptr + n * stride_pn + ks)[:, None] * y[None, :] + mixed
    tl.store(o_ptr + n * stride_on + ks[:, None] * stride_os + offs[None, :], out.to(o_ptr.dtype.element_ty),
             mask=mask[None, :])


def expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out[:, k] = post[:, k] * y + sum_j comb[:, j, k] * residual[:, j] in fp32 (j first to last), in y's
    dtype: y [N, D], residual [N, hc, D], post [N, hc], comb [N, hc, hc] -> [N, hc, D]."""
    n, hc, d = residual.shape
    if y.stride(1) != 1:
        y = y.contiguous()
    if residual.stride(2) != 1:
        residual = residual.contiguous()
    post = post.float().contiguous()
    comb = comb.float().contiguous()
    out = torch.empty((n, hc, d), dtype=y.dtype, device=y.device)
    if n:
        _expand_kernel[(n, triton.cdiv(d, MHC_BLOCK))](y, residual, post, comb, out, d, y.stride(0),
                                                       residual.stride(0), residual.stride(1), post.stride(0),
                                                       comb.stride(0), out.stride(0), out.stride(1), HC=hc,
                                                       BLOCK=MHC_BLOCK, num_warps=4, enable_fp_fusion=False,
                                                       launch_pdl=PDL_LAUNCH)
    return out
