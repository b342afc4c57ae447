"""CUDA backend (Triton): the CPU reference's kernels with the same signatures and numerics, one module per op
family; `kernels(device)` builds the backend's `Kernels`.

- gemm: activation quantisation, the block-scaled FP8/FP4 and the plain bf16/fp32 GEMMs, `linear`,
  `grouped_linear`; weights: the kernels' weight layout (`CudaWeight`) and FP4 -> E4M3 widening;
  experts: the routed experts' bank and `expert_linear`
- attention: `sparse_attn`, `window_source`, `window_rows`, `attention_indices` (and the training backward's
  fixed-point row sums); indexer: `index_scores`, `topk_indices`, `candidate_blocks`; router: `moe_route`
- side: `fork` / `join`, work on a side stream beside the critical path
- mhc: `hc_split_sinkhorn` (and its backward, for training), `collapse`, `expand`; quant: the KV / index fake
  quantisation and the packed FP4 state (numerics/packing.py's bytes)
- elementwise: the fixed-order row sums and RMS ops, the MoE sum, SwiGLU, the compressor's pooling,
  Engram's rows and gate, RoPE: each one launch with the rounding points of the torch composition it
  replaces (IEEE divisions, fp fusion off where products must round)
- configs: every tile configuration and row threshold (and why a row's bits never depend on M);
  common: what several families' kernels share.

The modules import each other relatively and one way (configs, common <- weights <- gemm <- experts;
elementwise <- router), so a copy of this package loads as a variant beside it
(bench/experiments/decode_gemm.py).
"""

from __future__ import annotations

import torch

from dsflash.kernels.api import Kernels, nothing_forked, run_here
from dsflash.kernels.cpu import Weight

from .attention import add_rows_fixed_point, attention_indices, sparse_attn, window_rows, window_source
from .configs import SLOT_MOE_ROWS
from .elementwise import (
    engram_gate,
    engram_rows,
    mean_square,
    moe_sum,
    rms_norm,
    rms_scale,
    rope_rotate,
    row_sum,
    small_sum,
    softmax_pool,
    stream_mean,
    swiglu,
)
from .experts import ExpertBank, expert_bank, expert_linear, expert_put, expert_slots
from .gemm import act_scales, grouped_linear, linear, quant_act
from .indexer import candidate_blocks, index_scores, topk_indices
from .mhc import collapse, expand, hc_split_sinkhorn, hc_split_sinkhorn_backward
from .quant import fp4_dequant_packed, fp4_dequant_picked, fp4_fake_quant, fp4_quant_packed, fp8_fake_quant
from .router import moe_route
from .side import SIDE_STREAMS, fork, join
from .weights import CudaWeight, fp4_words, to_cuda_weight, weight_from_codes

__all__ = ["kernels", "CudaWeight", "ExpertBank", "to_cuda_weight", "fp4_words", "quant_act",
           "act_scales", "linear", "grouped_linear", "expert_bank", "expert_slots",
           "expert_put", "expert_linear", "sparse_attn", "add_rows_fixed_point", "hc_split_sinkhorn",
           "hc_split_sinkhorn_backward", "index_scores", "topk_indices", "candidate_blocks", "moe_route", "mean_square",
           "row_sum", "small_sum", "stream_mean", "rms_norm", "rms_scale", "fp8_fake_quant", "fp4_fake_quant",
           "fp4_quant_packed", "fp4_dequant_packed", "fp4_dequant_picked", "window_source", "window_rows",
           "attention_indices", "collapse", "expand", "moe_sum", "swiglu", "softmax_pool", "engram_rows",
           "engram_gate", "rope_rotate"]


def kernels(device: torch.device) -> Kernels[ExpertBank]:
    """The CUDA backend on `device` (a CUDA device with its index)."""

    def weight(kind: str, stored: torch.Tensor, scale: torch.Tensor | None) -> Weight:
        if kind in ("fp8", "fp4"):
            return weight_from_codes(kind, stored, scale, device)
        if kind == "fp32" and stored.dtype == torch.bfloat16:  # widened by the kernel (CudaWeight)
            return CudaWeight(kind, stored.to(device).contiguous())
        dtype = torch.float32 if kind == "fp32" else torch.bfloat16
        return to_cuda_weight(Weight(kind, stored.to(dtype)), device)

    side = SIDE_STREAMS and device.type == "cuda"  # (the interpreter's runs on a CPU have no streams)
    return Kernels(
        name="cuda", device=device, row_tile=1, linear=linear, sparse_attn=sparse_attn,
        hc_split_sinkhorn=hc_split_sinkhorn, grouped_linear=grouped_linear, expert_bank=expert_bank,
        expert_slots=expert_slots, expert_put=expert_put, expert_linear=expert_linear,
        slot_moe_rows=SLOT_MOE_ROWS, index_scores=index_scores,
        topk_indices=topk_indices, candidate_blocks=candidate_blocks, moe_route=moe_route, mean_square=mean_square,
        row_sum=row_sum, small_sum=small_sum, stream_mean=stream_mean, rms_norm=rms_norm, rms_scale=rms_scale,
        fp8_fake_quant=fp8_fake_quant, fp4_fake_quant=fp4_fake_quant, fp4_quant_packed=fp4_quant_packed,
        fp4_dequant_packed=fp4_dequant_packed, fp4_dequant_picked=fp4_dequant_picked,
        window_source=window_source, window_rows=window_rows, attention_indices=attention_indices,
        collapse=collapse, expand=expand, moe_sum=moe_sum, swiglu=swiglu, softmax_pool=softmax_pool,
        engram_rows=engram_rows, engram_gate=engram_gate, rope_rotate=rope_rotate,
        weight=weight, fork=fork if side else run_here, join=join if side else nothing_forked)
