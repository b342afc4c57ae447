"""A block with manifold-constrained hyper-connections (mHC, spec §5).

The residual stream is `hc_mult` parallel copies. Attention and FFN each sit between `hc_pre` (collapse
the copies into one sub-layer input) and `hc_post` (expand its output back out, mixing the residual in
through `comb`); `hc_mixes` derives the three coefficient sets from the stream itself, `comb` made doubly
stochastic by Sinkhorn. V4.1's single-pass mHC uses a site's `pre` to collapse the input of the *next*
site: the attention uses the previous layer's FFN pre, the FFN this layer's attention pre.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from dsflash.config import ModelArgs
from dsflash.kernels import Kernels
from dsflash.kernels.cpu import Weight
from dsflash.model.attention import Attention
from dsflash.model.common import Chunk
from dsflash.model.moe import MoE
from dsflash.model.weights import WeightLoader


class FfnInput(NamedTuple):
    """A block between its attention and its FFN: the FFN's input and what `hc_post` mixes its output with."""

    x: torch.Tensor  # bf16 [rows, D]: the FFN's input
    residual: torch.Tensor  # bf16 [rows, hc, D]: the streams after the attention site
    post: torch.Tensor  # fp32 [rows, hc]
    comb: torch.Tensor  # fp32 [rows, hc, hc]
    pre: torch.Tensor  # fp32 [rows, hc]: the FFN site's pre (the next block's pre_mix)


@dataclass
class HcSite:
    """One site's mHC parameters (`hc_attn_*` or `hc_ffn_*`): fn [(2+hc)*hc, hc*D], base, scale, all fp32."""

    fn: Weight
    base: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def load(cls, w: WeightLoader, prefix: str) -> HcSite:
        return cls(w.plain(prefix + "_fn"), w.tensor(prefix + "_base").float(), w.tensor(prefix + "_scale").float())


class Block:
    def __init__(self, args: ModelArgs, layer: int, w: WeightLoader, prefix: str, attention: Attention):
        self.k: Kernels = w.k
        self.layer = layer
        self.eps = args.norm_eps
        self.hc, self.hc_iters, self.hc_eps = args.hc_mult, args.hc_sinkhorn_iters, args.hc_eps
        self.attn = attention
        self.ffn = MoE(args, layer, w, prefix + "ffn.")
        self.attn_norm = w.tensor(prefix + "attn_norm.weight")
        self.ffn_norm = w.tensor(prefix + "ffn_norm.weight")
        self.hc_attn = HcSite.load(w, prefix + "hc_attn")
        self.hc_ffn = HcSite.load(w, prefix + "hc_ffn")

    def forward(self, h: torch.Tensor, pre_mix: torch.Tensor, chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        """h: bf16 [rows, hc, D] streams; pre_mix: fp32 [rows, hc], the previous block's FFN pre. Returns the
        streams after the block and its FFN pre (the next block's pre_mix)."""
        f = self.attend(h, pre_mix, chunk)
        return self.finish(self.ffn(f.x, chunk), f)

    def attend(self, h: torch.Tensor, pre_mix: torch.Tensor, chunk: Chunk, joined: bool = False) -> FfnInput:
        """The attention site, then the FFN site's mixes and input: the block up to its FFN. A site's mixes
        feed only its `hc_post` (the sub-layer's input is collapsed by the previous site's pre), so they are
        forked (`Kernels.fork`: on CUDA a side stream) beside the sub-layer; the FFN site's are joined in
        `finish`, or here when `joined` (a forward replayed in segments stops here to read the routing on the
        host and returns this FfnInput: model/transformer.py)."""
        residual = h
        attn_mixes = self.k.fork(self.hc_mixes, h, self.hc_attn)
        x = self.k.rms_norm(self.hc_pre(h, pre_mix), self.attn_norm, self.eps)
        y = self.attn(x, chunk)
        self.k.join()
        attn_pre, attn_post, attn_comb = attn_mixes
        h = self.hc_post(y, residual, attn_post, attn_comb)
        ffn_pre, ffn_post, ffn_comb = self.k.fork(self.hc_mixes, h, self.hc_ffn)
        x = self.k.rms_norm(self.hc_pre(h, attn_pre), self.ffn_norm, self.eps)
        if joined:
            self.k.join()
        return FfnInput(x, h, ffn_post, ffn_comb, ffn_pre)

    def finish(self, y: torch.Tensor, f: FfnInput) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output streams from its FFN's output y, and its FFN pre."""
        self.k.join()
        return self.hc_post(y, f.residual, f.post, f.comb), f.pre

    def hc_mixes(self, h: torch.Tensor, site: HcSite) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pre [rows, hc], post [rows, hc], comb [rows, hc, hc]) from one projection of the flattened streams,
        scaled by one RMS statistic per token over all hc*D values (fp32 inside the kernels)."""
        x = h.flatten(1)
        mixes = self.k.rms_scale(self.k.linear(x, site.fn), x, self.eps)
        return self.k.hc_split_sinkhorn(mixes, site.scale, site.base, self.hc, self.hc_iters, self.hc_eps)

    def hc_pre(self, h: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor:
        return hc_pre(self.k, h, pre_mix)

    def hc_post(self, y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
                ) -> torch.Tensor:
        return hc_post(self.k, y, residual, post, comb)


def hc_pre(k: Kernels, h: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor:
    """The copies h [N, hc, D] collapsed into one sub-layer input [N, D]: sum_m pre_mix[m] * h[m], the fp32
    products added stream by stream (the backend's small_sum), in h's dtype. `k.collapse`, where the backend
    has it, is one kernel with these bits."""
    if k.collapse is not None:
        return k.collapse(h, pre_mix)
    return k.small_sum(pre_mix.unsqueeze(-1) * h.float(), 1).to(h.dtype)


def hc_post(k: Kernels, y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
            ) -> torch.Tensor:
    """The sub-layer output y [N, D] expanded back to hc copies, the residual [N, hc, D] mixed in through comb
    [N, hc, hc] (row = source stream): out[m] = post[m] * y + sum_j comb[j, m] * residual[j], in fp32, in y's
    dtype. `k.expand`, where the backend has it, is one kernel with these bits."""
    if k.expand is not None:
        return k.expand(y, residual, post, comb)
    out = post.unsqueeze(-1) * y.unsqueeze(-2) + k.small_sum(comb.unsqueeze(-1) * residual.unsqueeze(-2), 1)
    return out.type_as(y)
