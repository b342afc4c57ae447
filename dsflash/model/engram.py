"""Engram (spec §8): hashed n-gram memory gated into the four residual streams before a block.

The static layout (compressed token map, primes, multipliers) is derived once per model; the hash of
a position depends on its own and the three previous compressed ids, kept in the sequence state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dsflash.config import ModelArgs, engram_primes
from dsflash.kernels import Kernels
from dsflash.model.common import Chunk
from dsflash.model.engram_tables import Gathered, open_table
from dsflash.model.weights import WeightLoader

DEAD = -1  # compressed id of an image position: no n-gram reaches across it


def hash_multipliers(layer_ids: tuple[int, ...], max_ngram: int, compressed_vocab: int) -> torch.Tensor:
    """Odd int64 multipliers per (engram layer, look-back), from numpy's seeded generator as DeepSeek
    derives them, bounded so that id x multiplier cannot overflow int64."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    rows = [np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram,), dtype=np.int64) * 2 + 1
            for layer in layer_ids]
    return torch.tensor(np.stack(rows))


@dataclass
class EngramLayout:
    token_map: torch.Tensor  # int64 [vocab] -> compressed id
    pad: int  # compressed id of the pad token
    primes: torch.Tensor  # int64 [n_engram_layers, max_ngram-1, heads]
    offsets: torch.Tensor  # int64 [n_engram_layers, (max_ngram-1)*heads]
    multipliers: torch.Tensor  # int64 [n_engram_layers, max_ngram]

    @classmethod
    def build(cls, args: ModelArgs, token_map: list[int], device: torch.device) -> EngramLayout:
        primes = torch.tensor(engram_primes(args))
        flat = primes.flatten(1)
        offsets = torch.cumsum(flat, dim=1) - flat
        n_classes = max(token_map) + 1
        multipliers = hash_multipliers(tuple(args.engram_layer_ids), args.engram_max_ngram_size, n_classes)
        return cls(torch.tensor(token_map, device=device), token_map[args.engram_pad_id], primes.to(device),
                   offsets.to(device), multipliers.to(device))

    def hash_ids(self, chunk: Chunk, ids: torch.Tensor, max_ngram: int, commit: bool = True) -> torch.Tensor:
        """Row ids [rows, n_engram_layers, (max_ngram-1)*heads] of the chunk's positions; commits the
        real rows' compressed ids to the sequence's history (`commit=False`: the ids of a chunk to come,
        after the history's end, for fetching its rows ahead)."""
        state = chunk.state
        compressed = self.token_map[ids]
        if chunk.image_mask is not None:
            compressed = torch.where(chunk.image_mask, DEAD, compressed)
        # the last `back` committed ids, addressed from the device positions (a CUDA graph serves any p0 with
        # the same `back`)
        back = min(chunk.p0, max_ngram)
        positions = chunk.positions
        base = positions[:1] - back
        seq = torch.cat([state.engram_ids.buffer[base + torch.arange(back, device=ids.device)], compressed])
        # [rows, max_ngram]: each row's id `shift` back, the pad from the first shift that reaches before the
        # sequence or across an image on (all shifts at once: a dozen small kernels a step on a GPU, not forty)
        shifts = torch.arange(max_ngram, device=ids.device)
        back_pos = positions.unsqueeze(1) - shifts
        source = seq[(back_pos - base).clamp_min(0)]
        blocked = torch.cumsum(((back_pos < 0) | (source == DEAD)).to(torch.int32), dim=1) > 0
        tokens = torch.where(blocked, self.pad, source)
        products = tokens.unsqueeze(1) * self.multipliers  # [rows, layers, max_ngram]
        rolling = [products[..., 0]]
        for i in range(1, max_ngram):  # the n-gram hashes for n = 2 .. max_ngram: xors of the products so far
            rolling.append(torch.bitwise_xor(rolling[-1], products[..., i]))
        hashes = torch.stack(rolling[1:], dim=-1).unsqueeze(-1) % self.primes  # [rows, layers, max_ngram-1, heads]
        if commit:
            state.engram_ids.put(positions[:1], compressed[: chunk.n], chunk.p0 + chunk.n)
        return hashes.flatten(-2) + self.offsets


class Engram:
    def __init__(self, args: ModelArgs, w: WeightLoader, prefix: str, tier: str = "gpu", cache_bytes: int = 0):
        """`tier`/`cache_bytes`: where the table lives and the disk tier's hot-row cache (model/engram_tables.py)."""
        self.k = w.k
        self.dim, self.hc, self.eps = args.dim, args.hc_mult, args.norm_eps
        self.table = open_table(tier, w.ckpt, w.k, prefix, cache_bytes)  # FP8 rows, dequantised on lookup
        self.wkv = w.linear(prefix + "wkv")
        # only ever used as a product
        self.qk_weight = w.tensor(prefix + "q_weight").float() * w.tensor(prefix + "k_weight").float()

    def __call__(self, h: torch.Tensor, gathered: Gathered, image_mask: torch.Tensor | None) -> torch.Tensor:
        """h [N, hc, D] with the Engram of the rows its lookup (`self.table.request(hash_ids)`) gathered."""
        rows = self.k.engram_rows(*gathered)
        kv = self.k.linear(rows.flatten(-2), self.wkv)
        key, value = kv.split([self.hc * self.dim, self.dim], dim=-1)
        return engram_gate(self.k, h, key.unflatten(-1, (self.hc, self.dim)), value, self.qk_weight, self.eps,
                           image_mask)


def engram_gate(k: Kernels, h: torch.Tensor, key: torch.Tensor, value: torch.Tensor, qk_weight: torch.Tensor,
                eps: float, image_mask: torch.Tensor | None) -> torch.Tensor:
    """Engram's gated add to the streams: per (token, stream) the dot of the stream h [N, hc, D] with its key
    [N, hc, D] (weighted by qk_weight [hc, D]), each RMS-normalised over the model width (not jointly over the
    streams), a signed square root through a sigmoid, times the value [N, D] added to the stream; image
    positions get no Engram. fp32 (the backend's mean square and row sums), in h's dtype. `k.engram_gate`,
    where the backend has it, is one kernel with these bits."""
    if k.engram_gate is not None:
        return k.engram_gate(h, key, value, qk_weight, eps, image_mask)
    hf, kf, d = h.float(), key.float(), h.size(-1)
    rstd = torch.rsqrt(k.mean_square(hf)[..., 0] + eps) * torch.rsqrt(k.mean_square(kf)[..., 0] + eps)
    dot = k.row_sum(hf * qk_weight * kf) * rstd * d ** -0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    if image_mask is not None:
        gate = gate.masked_fill(image_mask.unsqueeze(-1), 0)
    return (hf + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(h.dtype)
