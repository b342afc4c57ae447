"""A block with manifold-constrained hyper-connections (mHC, spec §5).

The residual stream is `hc_mult` copies. Each sub-layer (attention, FFN) computes from its input the
coefficients pre/post/comb; V4.1's single-pass mHC uses a site's `pre` to collapse the input of the
*next* site (attention uses the previous layer's FFN pre, the FFN uses this layer's attention pre).
"""

from __future__ import annotations

import torch

from dsflash.config import ModelArgs
from dsflash.model.attention import Attention
from dsflash.model.common import Chunk
from dsflash.model.moe import MoE
from dsflash.model.weights import WeightLoader


class MixSite:
    """One site's mHC parameters: fn [(2+hc)*hc, hc*D], base, scale (all fp32)."""

    def __init__(self, args: ModelArgs, w: WeightLoader, prefix: str):
        self.k = w.k
        self.fn = w.plain(prefix + "_fn")
        self.base = w.tensor(prefix + "_base").float()
        self.scale = w.tensor(prefix + "_scale").float()
        self.hc, self.iters, self.hc_eps, self.eps = args.hc_mult, args.hc_sinkhorn_iters, args.hc_eps, args.norm_eps

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = h.flatten(1)  # the projection and the statistics widen to fp32 inside the kernels
        # one RMS statistic per token over all hc*D values
        mixes = self.k.rms_scale(self.k.linear(x, self.fn), x, self.eps)
        return self.k.hc_split_sinkhorn(mixes, self.scale, self.base, self.hc, self.iters, self.hc_eps)


class Block:
    def __init__(self, args: ModelArgs, layer: int, w: WeightLoader, prefix: str, attention: Attention):
        self.k = w.k
        self.layer = layer
        self.eps = args.norm_eps
        self.attn = attention
        self.ffn = MoE(args, layer, w, prefix + "ffn.")
        self.attn_norm = w.tensor(prefix + "attn_norm.weight")
        self.ffn_norm = w.tensor(prefix + "ffn_norm.weight")
        self.attn_site = MixSite(args, w, prefix + "hc_attn")
        self.ffn_site = MixSite(args, w, prefix + "hc_ffn")

    def __call__(self, h: torch.Tensor, pre: torch.Tensor, chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        """(streams, FFN pre) after this DSpark block (its attention's `core` between the two halves). The
        backbone's forward runs a block's stages itself (Transformer._layers): `attn_in`, the attention's
        select and attend, `out_ffn`."""
        x, qr, q, kv, attn_pre, attn_post, attn_comb = self.attn_in(h, pre, chunk.positions)
        o = self.attn.core(x, qr, q, kv, chunk)
        return self.out_ffn(o, h, attn_pre, attn_post, attn_comb, chunk.positions, chunk=chunk)

    def attn_in(self, h: torch.Tensor, pre: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        attn_pre, attn_post, attn_comb = self.attn_site(h)
        x = self.k.rms_norm(self.k.collapse(h, pre), self.attn_norm, self.eps)
        return (x, *self.attn.projections(x, positions), attn_pre, attn_post, attn_comb)

    def out_ffn(self, o: torch.Tensor, h: torch.Tensor, attn_pre: torch.Tensor, attn_post: torch.Tensor,
                attn_comb: torch.Tensor, positions: torch.Tensor, *, chunk: Chunk) -> tuple[torch.Tensor, ...]:
        h = self.k.expand(self.attn.output(o, positions), h, attn_post, attn_comb)
        ffn_pre, ffn_post, ffn_comb = self.ffn_site(h)
        z = self.ffn(self.k.rms_norm(self.k.collapse(h, attn_pre), self.ffn_norm, self.eps), chunk)
        return self.k.expand(z, h, ffn_post, ffn_comb), ffn_pre
