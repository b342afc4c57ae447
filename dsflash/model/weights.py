"""Turn stored checkpoint tensors into the forms the kernels use (spec §3 "Linear layers by storage dtype").

FP8 and FP4 weights become exact float32 code values plus per-(row, 32-input block) float32 scales;
tensors DeepSeek's reference holds in fp32 although the checkpoint stores bf16 (ratio-2 compressor,
output head, Markov head, confidence head) are widened here, once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from dsflash.checkpoint.reader import Checkpoint
from dsflash.kernels import Kernels
from dsflash.kernels.cpu import Weight
from dsflash.numerics import BLOCK

if TYPE_CHECKING:
    from dsflash.model.expert_cache import ExpertStore
    from dsflash.model.rope import Rope


class Shards(Protocol):
    """Rank 0's side of a parallel layout as a layer range's loader sees it (model/parallel.py's Stage)."""

    def linear_weight(self, w: WeightLoader, name: str, widen: bool) -> Weight | None:
        """The column-parallel weight `name` (this rank's shard, run over the group), or None: not sharded."""

    def attention(self, w: WeightLoader, prefix: str, rope: Rope) -> Callable[..., torch.Tensor] | None:
        """The attention layer at `prefix`'s heads over the group, or None where attention is not split."""

    def experts(self, w: WeightLoader, name: str, layer: int) -> Callable[..., torch.Tensor] | None:
        """The MoE layer at `name`'s routed experts over the group, or None without expert parallelism."""


class WeightLoader:
    """Reads one checkpoint and hands out tensors by official name, on the device and in the form of
    the kernel backend the model is built for (`k`). `experts`: where the MoE layers' routed experts live
    when they are not resident (model/expert_cache.py), None for resident banks. `parallel`: rank 0's side of an
    expert or tensor parallel layout (model/parallel.py), which holds only this rank's shards."""

    def __init__(self, ckpt: Checkpoint, k: Kernels, experts: ExpertStore | None = None,
                 parallel: Shards | None = None):
        self.ckpt, self.k, self.experts, self.parallel = ckpt, k, experts, parallel

    def has(self, name: str) -> bool:
        return self.ckpt.has(name)

    def raw(self, name: str) -> torch.Tensor:
        return self.ckpt.get(name)

    def linear(self, prefix: str, widen: bool = False, rows: slice | None = None) -> Weight:
        """`prefix.weight` (+ `prefix.scale`) as a Weight; `widen` promotes a bf16 weight to fp32. `rows`: only
        those output rows (a tensor-parallel shard; FP8's 32x32 scale tiles need it to start on a tile)."""
        if self.parallel is not None and rows is None:
            sharded = self.parallel.linear_weight(self, prefix, widen)
            if sharded is not None:
                return sharded
        w = self.ckpt.get(prefix + ".weight")
        if rows is not None:
            w = w[rows]
        if w.dtype == torch.float8_e4m3fn:
            scale = self.ckpt.get(prefix + ".scale")
            if rows is not None:
                assert rows.start % BLOCK == 0, f"{prefix}: an FP8 shard starts on a scale tile, not row {rows.start}"
                scale = scale[rows.start // BLOCK: -(-rows.stop // BLOCK)]
            return self.k.weight("fp8", w, scale)
        if w.dtype in (torch.int8, torch.uint8):
            scale = self.ckpt.get(prefix + ".scale")
            return self.k.weight("fp4", w, scale if rows is None else scale[rows])
        if widen or w.dtype == torch.float32:
            return self.k.weight("fp32", w, None)
        return self.k.weight("bf16", w, None)

    def plain(self, name: str) -> Weight:
        """A bare fp32/bf16 matrix (e.g. an mHC projection) as a Weight, widened to fp32."""
        return self.k.weight("fp32", self.ckpt.get(name), None)

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = self.ckpt.get(name).to(self.k.device)
        return t if dtype is None else t.to(dtype)
