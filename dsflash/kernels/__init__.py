"""Kernel backends behind one interface (`Kernels`): the GEMMs (`linear`, `grouped_linear`, `expert_linear`),
`sparse_attn`, `hc_split_sinkhorn`, the indexer's scores, top-k and candidate blocks, the MoE router, the
fixed-order sums, the elementwise ops a layer runs on every row (RMSNorm, the mHC mix scale, collapse and
expansion, SwiGLU, the MoE sum, RoPE, the compressor's pooling, Engram's row gather and gate, the KV
fake-quantisation), the packed FP4 state's quantise-and-pack and read-back, and `weight` (a checkpoint
weight in the form the backend's GEMM takes). The backend is chosen once, when a model is built for a
device: CPU tensors take the reference backend (kernels/cpu.py, the oracle); CUDA tensors take the Triton
backend (the kernels/cuda/ package), or the reference ops run on the GPU with `reference=True`
(what `dsflash bench` compares against)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dsflash.kernels import cpu
from dsflash.numerics import BLOCK, exact_div
from dsflash.numerics.codecs import decode_e2m1, unpack_fp4
from dsflash.numerics.packing import dequant_packed, quant_packed
from dsflash.numerics.quant import fp4_fake_quant, fp8_fake_quant


@dataclass(frozen=True)
class Kernels:
    name: str
    device: torch.device
    # rows of a forward are padded to a multiple of this: the reference backend's CPU BLAS and vector
    # loops are only batch-invariant on whole tiles; the CUDA kernels are invariant at any row count
    row_tile: int
    linear: Any
    sparse_attn: Any
    hc_split_sinkhorn: Any
    grouped_linear: Any
    expert_bank: Any  # list of one projection's routed-expert Weights -> the bank expert_linear takes
    expert_linear: Any  # (x, bank, expert per slot, slots per row) -> bf16 [slots, out]
    # MoE layers of at most this many rows run every (row, slot) pair through expert_linear (no host read
    # of the routing); larger chunks loop over the experts they use (the CPU's; CUDA's expert_linear takes all)
    slot_moe_rows: int
    index_scores: Any  # (q, keys, weights, visible, keep_blocks or None, block) -> the indexer's bf16 scores
    topk_indices: Any  # (scores, k, visible, width) -> the k best entries per row, ascending, -1 padded
    candidate_blocks: Any  # (scores, visible, topk_blocks, block) -> the kept candidate blocks, bool
    moe_route: Any  # (gate logits, bias, k, score_func, temp, norm, scale, ids, ascending) -> (weights, ids)
    mean_square: Any  # mean(x^2) over the last dim, keepdim
    row_sum: Any  # sum over the last dim
    small_sum: Any  # sum over a short dim
    stream_mean: Any  # mean over dim 1 (the mHC streams)
    rms_norm: Any  # (x, weight, eps) -> RMSNorm of x in x's dtype
    rms_scale: Any  # (values, x, eps) -> values * rsqrt(mean(x^2) + eps), fp32 (the mHC mixes)
    fp8_fake_quant: Any  # quant.fp8_fake_quant: window KV
    fp4_fake_quant: Any  # quant.fp4_fake_quant: index queries
    fp4_quant_packed: Any  # packing.quant_packed: the compressed KV and index keys as the state holds them
    fp4_dequant_packed: Any  # packing.dequant_packed: their values, read back (fp4_fake_quant's bits)
    collapse: Any  # mHC (h [N, hc, D], pre [N, hc]) -> [N, D]: the streams' weighted sum
    expand: Any  # mHC (y [N, D], residual [N, hc, D], post [N, hc], comb [N, hc, hc]) -> [N, hc, D]
    moe_sum: Any  # (routed experts' rows [N, k, D], shared expert's [N, D]) -> the MoE output [N, D]
    swiglu: Any  # (gate, up [..., D], limit, weights [..., 1] or None) -> an expert's hidden rows
    softmax_pool: Any  # (kv, score [G, ratio, D] fp32) -> the compressor's pooled groups, bf16 [G, D]
    engram_rows: Any  # (FP8 table, its scales, ids) -> Engram's hashed rows, bf16
    engram_gate: Any  # (h [N, hc, D], key [N, hc, D], value [N, D], qk_weight, eps, image mask) -> h + gated value
    rope_rotate: Any  # (x, factor table, positions, dim, inverse) -> x, its last dim channels rotated in place
    weight: Any  # (kind, stored tensor, stored scale or None) -> the backend's weight on `device`


def _reference_weight(device: torch.device):
    def weight(kind: str, stored: torch.Tensor, scale: torch.Tensor | None) -> cpu.Weight:
        """Exact float32 code values and per-(row, BLOCK-input block) float32 scales."""
        stored = stored.cpu()  # the codecs' tables live on the CPU; the result moves to `device`
        if kind == "fp8":
            rows = scale.float().cpu().repeat_interleave(BLOCK, dim=0)[: stored.size(0)]
            return cpu.Weight("fp8", stored.float().to(device), rows.contiguous().to(device))
        if kind == "fp4":
            return cpu.Weight("fp4", decode_e2m1(unpack_fp4(stored)).to(device), scale.float().cpu().to(device))
        return cpu.Weight(kind, stored.to(device=device, dtype=torch.float32 if kind == "fp32" else torch.bfloat16))

    return weight


def load_kernels(device: str | torch.device = "cpu", reference: bool = False) -> Kernels:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # as tensors name it, so device keys match
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu" or reference:
        return Kernels("reference", device, cpu.ROW_TILE, cpu.linear, cpu.sparse_attn, cpu.hc_split_sinkhorn,
                       cpu.grouped_linear, cpu.expert_bank, cpu.expert_linear, cpu.ROW_TILE, cpu.index_scores,
                       cpu.topk_indices, cpu.candidate_blocks, cpu.moe_route,
                       cpu.mean_square, cpu.row_sum, cpu.small_sum, cpu.stream_mean, cpu.rms_norm, cpu.rms_scale,
                       fp8_fake_quant, fp4_fake_quant, quant_packed, dequant_packed, cpu.collapse, cpu.expand,
                       cpu.moe_sum, cpu.swiglu, cpu.softmax_pool, cpu.engram_rows, cpu.engram_gate,
                       cpu.rope_rotate, _reference_weight(device))
    from dsflash.kernels import cuda

    def cuda_weight(kind: str, stored: torch.Tensor, scale: torch.Tensor | None) -> cpu.Weight:
        if kind in ("fp8", "fp4"):
            return cuda.weight_from_codes(kind, stored, scale, device)
        if kind == "fp32" and stored.dtype == torch.bfloat16:  # widened by the kernel (CudaWeight)
            return cuda.CudaWeight(kind, stored.to(device).contiguous())
        dtype = torch.float32 if kind == "fp32" else torch.bfloat16
        return cuda.to_cuda_weight(cpu.Weight(kind, stored.to(dtype)), device)

    def stream_mean(h: torch.Tensor) -> torch.Tensor:
        return exact_div(cuda.small_sum(h.float(), 1), h.size(1)).to(h.dtype)

    def mean_square(x: torch.Tensor) -> torch.Tensor:
        return exact_div(cuda.row_sum(x, square=True), x.size(-1)).unsqueeze(-1)

    return Kernels("cuda", device, 1, cuda.linear, cuda.sparse_attn, cuda.hc_split_sinkhorn, cuda.grouped_linear,
                   cuda.expert_bank, cuda.expert_linear, cuda.SLOT_MOE_ROWS, cuda.index_scores,
                   cuda.topk_indices, cuda.candidate_blocks, cuda.moe_route, mean_square, cuda.row_sum,
                   cuda.small_sum, stream_mean, cuda.rms_norm, cuda.rms_scale, cuda.fp8_fake_quant,
                   cuda.fp4_fake_quant, cuda.fp4_quant_packed, cuda.fp4_dequant_packed, cuda.collapse, cuda.expand,
                   cuda.moe_sum, cuda.swiglu, cuda.softmax_pool, cuda.engram_rows, cuda.engram_gate,
                   cuda.rope_rotate, cuda_weight)
