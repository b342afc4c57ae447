"""The MoE router in one kernel per call (a shared bias and an elementwise score function), the torch
composition otherwise."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .common import FP_FUSION, PDL_LAUNCH, grid_entry, sigmoid


@triton.jit
def _moe_route_kernel(logit_ptr, bias_ptr, w_ptr, id_ptr, E, stride_l, temp, scale, K: tl.constexpr,
                      KP: tl.constexpr, FUNC: tl.constexpr, NORM: tl.constexpr, ASC: tl.constexpr,
                      BLOCK_E: tl.constexpr):
    """One row of the router (model/moe.py Gate.route) with torch's CUDA functions: logits / temp (IEEE division),
    FUNC 1 sigmoid 1 / (1 + expf(-x)), 2 sqrtf(x > 20 ? x : log1pf(expf(x))); K rounds of the best of
    scores + bias (the lowest id among equal ones, -0 = +0), its unbiased score kept; the weights' sum from
    the first pick on (CUDA's small_sum), + 1e-20, IEEE divisions, times scale; ASC: stored by ascending id
    (each pick at its rank among the row's distinct picks)."""
    grid_entry()
    n = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    valid = e < E
    s = tl.math.div_rn(tl.load(logit_ptr + n * stride_l + e, mask=valid, other=0.0), temp)
    if FUNC == 1:
        s = sigmoid(s)
    else:
        s = tl.sqrt_rn(tl.where(s > 20.0, s, libdevice.log1p(libdevice.exp(s))))
    key = tl.where(valid, s + tl.load(bias_ptr + e, mask=valid, other=0.0), float("-inf"))
    kk = tl.arange(0, KP)
    ids = tl.zeros([KP], dtype=tl.int64)
    weights = tl.zeros([KP], dtype=tl.float32)
    total = 0.0
    for j in tl.static_range(K):
        best = tl.max(key, axis=0)
        pick = tl.min(tl.where(key == best, e, BLOCK_E), axis=0)
        w = tl.max(tl.where(e == pick, s, float("-inf")), axis=0)
        key = tl.where(e == pick, float("-inf"), key)
        ids = tl.where(kk == j, pick.to(tl.int64), ids)
        weights = tl.where(kk == j, w, weights)
        if j == 0:
            total = w
        else:
            total = total + w
    if NORM:
        weights = tl.math.div_rn(weights, total + 1e-20)
    weights = weights * scale
    slot = kk
    if ASC:
        live = kk < K
        below = (ids[None, :] < ids[:, None]) & live[None, :]
        slot = tl.sum(below.to(tl.int32), axis=1)
    tl.store(w_ptr + n * K + slot, weights, mask=kk < K)
    tl.store(id_ptr + n * K + slot, ids, mask=kk < K)


ROUTE_FUNCS = {"sigmoid": 1, "sqrtsoftplus": 2}  # the score functions the route kernel computes


def moe_route(logits: torch.Tensor, bias: torch.Tensor, k: int, score_func: str, temp: float, norm: bool,
              scale: float, ids: torch.Tensor | None = None, ascending: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The router (model/moe.py `Gate.route`) with the bits of its torch composition on CUDA: one kernel for a
    shared bias and an elementwise score function (~15 launches a layer as composed, the sort to ascending ids
    included); None for softmax, a per-row bias (image rows) or given ids, which the model composes."""
    if ids is not None or bias.dim() != 1 or score_func not in ROUTE_FUNCS:
        return None
    n, e = logits.shape
    logits = logits.float().contiguous()
    weights = torch.empty((n, k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((n, k), dtype=torch.int64, device=logits.device)
    if n:
        block_e = max(16, triton.next_power_of_2(e))
        _moe_route_kernel[(n,)](logits, bias.float().contiguous(), weights, ids, e, logits.stride(0), float(temp),
                                float(scale), K=k, KP=max(2, triton.next_power_of_2(k)), FUNC=ROUTE_FUNCS[score_func],
                                NORM=norm and k > 1, ASC=ascending, BLOCK_E=block_e,
                                num_warps=4 if block_e <= 1024 else 8, enable_fp_fusion=FP_FUSION,
                                launch_pdl=PDL_LAUNCH)
    return weights, ids
