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
"""

from __future__ import annotations

import torch

from dsflash.kernels import cpu
from dsflash.model.transformer import Transformer
from dsflash.train.backend import TrainState


def indexer_kl(model: Transformer, state: TrainState, trace: dict, rows: torch.Tensor) -> torch.Tensor:
    """Mean over the index layers of the forward behind `trace` (its "indexer_inputs") and the query `rows`
    (positions of that forward, each past its first compressed group) of KL(main attention || indexer)."""
    a, k = model.args, model.k
    total = torch.zeros((), device=rows.device)
    inputs = trace["indexer_inputs"]
    for layer, (positions, x, qr) in inputs.items():
        attn = model.blocks[layer].attn
        pick = torch.searchsorted(positions, rows)
        pos, x, qr = positions[pick], x[pick].detach(), qr[pick].detach()
        entries = state.compressed[attn.kv_source].rows
        keys = state.index_keys[attn.kv_source].rows
        visible = ((pos + 1) // attn.ratio).unsqueeze(-1)
        hidden = torch.arange(entries.size(0), device=rows.device) >= visible
        with torch.no_grad():
            q = k.linear(qr, attn.wq_b).unflatten(-1, (-1, a.head_dim))
            attn.rope.rotate(q, pos)
            logits = torch.einsum("shd,td->sht", q.float(), entries.detach().float()) * a.head_dim ** -0.5
            target = logits.masked_fill(hidden.unsqueeze(1), -torch.inf).softmax(-1).mean(1)
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
