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

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dsflash.kernels import cpu
from dsflash.kernels.api import Kernels
from dsflash.kernels.cpu import Weight
from dsflash.numerics.packing import dequant_packed, quant_packed
from dsflash.numerics.quant import fp4_fake_quant, fp8_fake_quant

if TYPE_CHECKING:
    from dsflash.kernels.cuda import ExpertBank

__all__ = ["Kernels", "load_kernels"]


def _reference(device: torch.device) -> Kernels[list[Weight]]:
    def weight(kind: str, stored: Tensor, scale: Tensor | None) -> Weight:
        """FP8/FP4 weights in their stored formats (cpu.StoredWeight, decoded by each GEMM); bf16 and fp32
        ones in that dtype (a bf16-stored weight the reference holds in fp32 widened here, once)."""
        if kind in ("fp8", "fp4"):
            return cpu.StoredWeight(kind, stored.to(device), scale.to(device))
        return Weight(kind, stored.to(device=device, dtype=torch.float32 if kind == "fp32" else torch.bfloat16))

    return Kernels(
        name="reference", device=device, row_tile=cpu.ROW_TILE, linear=cpu.linear, sparse_attn=cpu.sparse_attn,
        hc_split_sinkhorn=cpu.hc_split_sinkhorn, grouped_linear=cpu.grouped_linear, expert_bank=cpu.expert_bank,
        expert_slots=cpu.expert_slots, expert_put=cpu.expert_put, expert_linear=cpu.expert_linear,
        slot_moe_rows=cpu.ROW_TILE, index_scores=cpu.index_scores,
        topk_indices=cpu.topk_indices, candidate_blocks=cpu.candidate_blocks, moe_route=None,
        mean_square=cpu.mean_square, row_sum=cpu.row_sum, small_sum=cpu.small_sum, stream_mean=cpu.stream_mean,
        rms_norm=cpu.rms_norm, rms_scale=cpu.rms_scale, fp8_fake_quant=fp8_fake_quant, fp4_fake_quant=fp4_fake_quant,
        fp4_quant_packed=quant_packed, fp4_dequant_packed=dequant_packed, fp4_dequant_picked=None,
        window_source=None, window_rows=None, attention_indices=None, collapse=None, expand=None,
        moe_sum=cpu.moe_sum, swiglu=cpu.swiglu, softmax_pool=None, engram_rows=cpu.engram_rows,
        engram_gate=None, rope_rotate=cpu.rope_rotate, weight=weight)


def load_kernels(device: str | torch.device = "cpu", reference: bool = False
                 ) -> Kernels[list[Weight]] | Kernels[ExpertBank]:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # as tensors name it, so device keys match
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu" or reference:
        return _reference(device)
    from dsflash.kernels import cuda

    return cuda.kernels(device)
