"""Training the lightning indexer, which the next-token loss cannot reach: its scores only choose indices
(backend.py), so without a loss of its own it keeps its seeded weights and picks entries at random -- and a
fact stated beyond the window is then out of every query's reach.

DeepSeek-V3.2's recipe (its dense warm-up's loss): the indexer's distribution over a query's visible entries,
softmax of its scores, is fitted to the main attention's over the same entries (each head's softmax of q.k,
summed over the heads and normalised) by KL divergence, with the main attention's side, the indexer's inputs
(x, qr) and the keys' (the compressor's latent, model/attention.py) detached: only the indexer learns from it
(its query projection, heads' weights, key projection and key norm). The target covers every visible entry,
not only the picked ones, so the indexer learns where the attention would look if it could see everything.
Query rows are sampled (`rows`): a [rows, heads, entries] score tensor a layer, small next to the forward.

The warm-up (`attention_picks`): while the indexer still picks at random, the main attention never sees the
entry a far-back fact sits in, so it cannot learn to look it up, and the indexer's KL then fits an attention
that does not look there. For the first part of training the index layers pick what the main attention itself
weighs most over every visible entry -- V3.2's dense warm-up in sparse form: the attention trains on its own
best candidates, the indexer on the same distribution -- then the indexer's picks take over.
"""

from __future__ import annotations

import torch

from dsflash.kernels import cpu
from dsflash.model.attention import Attention, visible_entries
from dsflash.model.common import Chunk
from dsflash.model.transformer import Transformer
from dsflash.train.backend import TrainState

PICK_ROWS = 1024  # query rows scored at a time by attention_picks: a [rows, heads, entries] fp32 tensor


def indexer_kl(model: Transformer, state: TrainState, trace: dict, rows: torch.Tensor) -> torch.Tensor:
    """Mean over the index layers of the forward behind `trace` (its "indexer_inputs") and the query `rows`
    (positions of that forward, each past its first compressed group) of KL(main attention || indexer)."""
    total = torch.zeros((), device=rows.device)
    inputs = trace["indexer_inputs"]
    for layer, (positions, x, qr) in inputs.items():
        attn = model.blocks[layer].attn
        pick = torch.searchsorted(positions, rows)
        pos, x, qr = positions[pick], x[pick].detach(), qr[pick].detach()
        entries = state.compressed[attn.kv_source].rows
        keys = state.index_keys[attn.kv_source].rows
        visible = visible_entries(pos, attn.ratio)
        hidden = torch.arange(entries.size(0), device=rows.device) >= visible
        with torch.no_grad():
            target = attention_target(attn, qr, pos, entries, hidden)
            entropy = -(target * target.clamp_min(1e-30).log()).sum(-1)
        q_i, weights = attn.indexer.queries(x, qr, pos, attn.rope)
        # the scores the forward picks by (the reference op, which the training kernels run without autograd)
        scores = cpu.index_scores(q_i, keys, weights, visible, None, 1)
        log_p = scores.float().log_softmax(-1).masked_fill(hidden, 0.0)
        total = total + (-(target * log_p).sum(-1) - entropy).mean()
    return total / max(len(inputs), 1)


def query_rows(n: int, count: int, first: int, generator: torch.Generator, device: torch.device | str
               ) -> torch.Tensor:
    """`count` distinct positions of an n-row forward from `first` on, ascending (the indexer's query rows)."""
    picks = torch.randperm(n - first, generator=generator)[:count] + first
    return picks.sort().values.to(device)


def attention_target(attn: Attention, qr: torch.Tensor, positions: torch.Tensor, entries: torch.Tensor,
                     hidden: torch.Tensor) -> torch.Tensor:
    """Where the main attention of `attn` looks among compressed `entries` [T, head_dim] from query rows (their
    q LoRA latents qr, positions): each head's softmax of q.k over the entries not `hidden` [rows, T],
    averaged over the heads, float32 [rows, T]. Call without autograd."""
    a = attn.args
    q = attn.k.linear(qr, attn.wq_b).unflatten(-1, (-1, a.head_dim))
    attn.rope.rotate(q, positions)
    logits = torch.einsum("shd,td->sht", q.float(), entries.detach().float()) * a.head_dim ** -0.5
    return logits.masked_fill(hidden.unsqueeze(1), -torch.inf).softmax(-1).mean(1)


@torch.no_grad()
def attention_picks(attn: Attention, x: torch.Tensor, qr: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """The warm-up's picks (a Selections.picker): each query row's `index_topk` visible entries of the layer's
    KV source with the most of the main attention's weight (attention_target), ascending, -1 padded."""
    a = attn.args
    entries = chunk.source(attn.kv_source)[0].rows
    visible = visible_entries(chunk.positions, attn.ratio)
    k = min(a.index_topk, entries.size(0))
    out = torch.empty((chunk.rows, a.index_topk), dtype=torch.int64, device=qr.device)
    for r in range(0, chunk.rows, PICK_ROWS):
        rows = slice(r, r + PICK_ROWS)
        hidden = torch.arange(entries.size(0), device=qr.device) >= visible[rows]
        weight = attention_target(attn, qr[rows], chunk.positions[rows], entries, hidden)
        # hidden entries, and rows that see none (their softmax is NaN), rank below every visible one
        out[rows] = attn.k.topk_indices(weight.masked_fill(hidden, -1.0), k, visible[rows], a.index_topk)
    return out
