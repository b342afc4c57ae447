"""Turn stored checkpoint tensors into the forms the kernels use (spec §3 "Linear layers by storage dtype").

FP8 and FP4 weights become exact float32 code values plus per-(row, 32-input block) float32 scales;
tensors DeepSeek's reference holds in fp32 although the checkpoint stores bf16 (ratio-2 compressor,
output head, Markov head, confidence head) are widened here, once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dsflash.checkpoint.reader import Checkpoint
from dsflash.kernels import Kernels
from dsflash.kernels.cpu import Weight

if TYPE_CHECKING:
    from dsflash.model.expert_cache import ExpertStore


class WeightLoader:
    """Reads one checkpoint and hands out tensors by official name, on the device and in the form of
    the kernel backend the model is built for (`k`). `experts`: where the MoE layers' routed experts live
    when they are not resident (model/expert_cache.py), None for resident banks."""

    def __init__(self, ckpt: Checkpoint, k: Kernels, experts: ExpertStore | None = None):
        self.ckpt, self.k, self.experts = ckpt, k, experts

    def has(self, name: str) -> bool:
        return self.ckpt.has(name)

    def raw(self, name: str) -> torch.Tensor:
        return self.ckpt.get(name)

    def linear(self, prefix: str, widen: bool = False) -> Weight:
        """`prefix.weight` (+ `prefix.scale`) as a Weight; `widen` promotes a bf16 weight to fp32."""
        w = self.ckpt.get(prefix + ".weight")
        if w.dtype == torch.float8_e4m3fn:
            return self.k.weight("fp8", w, self.ckpt.get(prefix + ".scale"))
        if w.dtype in (torch.int8, torch.uint8):
            return self.k.weight("fp4", w, self.ckpt.get(prefix + ".scale"))
        if widen or w.dtype == torch.float32:
            return self.k.weight("fp32", w, None)
        return self.k.weight("bf16", w, None)

    def plain(self, name: str) -> Weight:
        """A bare fp32/bf16 matrix (e.g. an mHC projection) as a Weight, widened to fp32."""
        return self.k.weight("fp32", self.ckpt.get(name), None)

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = self.ckpt.get(name).to(self.k.device)
        return t if dtype is None else t.to(dtype)
