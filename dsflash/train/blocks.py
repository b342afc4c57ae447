"""DSpark training over many draft blocks at once. Decoding drafts one block after the target row at
position q-1: rows [anchor, noise x (B-1)] at positions q..q+B-1 attending to each other and to the stage's
context KV of the `window_size` target positions before q (model/dspark.py). Training lays the blocks of many
anchors side by side in one chunk; each row attends to its own block and its anchor's window of context."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsflash.model.common import Chunk
from dsflash.model.dspark import DSparkAttention


@dataclass
class BlockChunk(Chunk):
    """A chunk of side-by-side draft blocks: `block` rows per anchor (anchors: int64 [M] target positions),
    and per stage the context KV of every target position ([T, head_dim], DSparkAttention.context_kv)."""

    contexts: list[torch.Tensor] = field(default_factory=list)
    anchors: torch.Tensor | None = None
    block: int = 1


class BlockAttention(DSparkAttention):
    """DSparkAttention's core over a BlockChunk: the indices of decoding's, per anchor."""

    def core(self, x: torch.Tensor, qr: torch.Tensor, kv: torch.Tensor, chunk: BlockChunk
             ) -> tuple[torch.Tensor, torch.Tensor]:
        win, b, anchors = self.args.window_size, chunk.block, chunk.anchors
        context = chunk.contexts[self.stage]
        before = anchors.unsqueeze(1) - win + torch.arange(win, device=x.device)
        own = context.size(0) + torch.arange(anchors.numel() * b, device=x.device).view(-1, b)
        idx = torch.cat([torch.where(before >= 0, before, -1), own], dim=1).repeat_interleave(b, dim=0)
        source = torch.cat([context, kv[: chunk.n]])
        return source, idx


def block_rows(x: torch.Tensor, greedy: torch.Tensor, anchors: torch.Tensor, b: int, noise: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, positions, labels, previous tokens) of the blocks, [M * b] each: block rows [x[q], noise...] at
    q..q+b-1; row i's label is the target's greedy token after position q+i (greedy[q+i]), and the token the
    Markov head reads is the one before it (the anchor, then the previous label)."""
    offsets = torch.arange(b, device=x.device)
    ids = torch.full((anchors.numel(), b), noise, dtype=torch.int64, device=x.device)
    ids[:, 0] = x[anchors]
    at = anchors.unsqueeze(1) + offsets
    previous = torch.cat([x[anchors].unsqueeze(1), greedy[at[:, :-1]]], dim=1)
    return ids.flatten(), at.flatten(), greedy[at].flatten(), previous.flatten()
