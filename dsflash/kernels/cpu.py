"""CPU reference backend: the model's six kernels as plain torch ops, the oracle every other backend
is tested against.

Numerics follow DeepSeek's kernels (spec §3): block-scaled FP8/FP4 GEMMs accumulate each 32-wide K
block in fp32 and add the scaled partials in K order; sparse attention runs an online softmax over
blocks of 64 indices with bf16 probabilities; the mHC split is fp32 throughout.

Batch invariance: a row's result must not depend on how many rows share the call. CPU BLAS and
torch's vectorised elementwise loops are only invariant for row counts that are multiples of a tile
(scalar tails and small-M GEMM paths round differently), so every GEMM here pads its rows to a
multiple of ROW_TILE, and the model pads whole chunks the same way (see model/transformer.py).

Code path: MKL (torch's CPU BLAS) picks its GEMM kernels by the CPU it finds, so AVX2, AVX-512 and AMX
machines sum the same fp32 GEMM in different orders, and its default mode splits work by the thread count.
MKL_CODE_PATH pins one kernel family on every x86 CPU, thread-count independent (docs/numerics.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dsflash.numerics import BLOCK
from dsflash.numerics.codecs import decode_e4m3, decode_fp4_packed
from dsflash.numerics.quant import fp8_act_codes, k_range_blocks

ROW_TILE = 64
SPARSE_ATTN_BLOCK = 64

# MKL's conditional numerical reproducibility: its AVX2 kernels (those the golden arrays' GEMMs match) and
# STRICT (no thread-count dependent splits). MKL reads MKL_CBWR at its first call, so it is set when this
# backend is imported, before any GEMM; a value already in the environment wins (MKL_CBWR=AUTO: MKL's fastest
# reproducible kernels for this CPU; an empty MKL_CBWR: MKL's default, unpinned).
MKL_CODE_PATH = "AVX2,STRICT"
os.environ.setdefault("MKL_CBWR", MKL_CODE_PATH)


def pad_rows(x: torch.Tensor, multiple: int = ROW_TILE, value: float = 0.0) -> torch.Tensor:
    n = x.size(0)
    extra = -n % multiple
    if not extra:
        return x
    return torch.cat([x, x.new_full((extra, *x.shape[1:]), value)])


@dataclass
class Weight:
    """A linear layer's weight as the kernels use it.

    kind: "fp8" (E4M3 values with one scale per 32x32 tile), "fp4" (E2M1 values, one scale per 32
    inputs), "bf16" or "fp32" (plain matmul in that dtype, no activation quantisation).
    For fp8/fp4, `values` holds the code values as float32 [out, in] and `scale` the per-(row, K-block)
    float32 scale [out, in/32], so the GEMM is one exact product per K block.
    """

    kind: str
    values: torch.Tensor
    scale: torch.Tensor | None = None
    # the output count whose K ranges (quant.k_range_blocks) an FP8/FP4 GEMM sums by: a tensor-parallel shard
    # keeps its whole weight's, so each output is the one-device sum (None: this weight's own count)
    k_range_out = None

    @property
    def out_features(self) -> int:
        return self.values.size(0)

    @property
    def in_features(self) -> int:
        return self.values.size(1)


class StoredWeight(Weight):
    """An FP8/FP4 weight kept in memory as the checkpoint stores it: E4M3 codes [out, in] with E8M0 scales
    per 32x32 tile, or E2M1 codes packed two a byte [out, in/2] with E8M0 scales per row and 32 inputs --
    its stored bytes, not 4 B a parameter. `values` and `scale` are decoded when a GEMM reads them: exactly
    the fp32 code values and per-(row, K-block) scales a widened Weight holds, so the GEMM's bits are the
    same."""

    def __init__(self, kind: str, codes: torch.Tensor, stored_scale: torch.Tensor):
        assert kind in ("fp8", "fp4"), kind
        self.kind, self.codes, self.stored_scale = kind, codes, stored_scale

    @property
    def values(self) -> torch.Tensor:
        if self.kind == "fp8":
            return decode_e4m3(self.codes)
        return decode_fp4_packed(self.codes)

    @property
    def scale(self) -> torch.Tensor:
        scale = self.stored_scale.float()
        return scale.repeat_interleave(BLOCK, dim=0)[: self.out_features] if self.kind == "fp8" else scale

    @property
    def out_features(self) -> int:
        return self.codes.size(0)

    @property
    def in_features(self) -> int:
        return self.codes.size(1) * (2 if self.kind == "fp4" else 1)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.stored_scale.nbytes


def _block_scaled_gemm(a: torch.Tensor, a_s: torch.Tensor, w: Weight) -> torch.Tensor:
    """sum_k (A_k @ B_k^T) * a_s[:, k] * b_s[:, k] over 32-wide K blocks: the partials of each K range
    (quant.k_range_blocks) added in K order, then the range sums in order. `a` may have more rows than `a_s`
    (the ROW_TILE a GEMM's bits are pinned to): their partials are computed and dropped, and only a_s's rows
    are scaled and summed (elementwise, so the other rows never change a row's bits)."""
    m, k = a_s.size(0), a.size(1)
    nb = k // BLOCK
    partial = torch.bmm(
        a.view(-1, nb, BLOCK).transpose(0, 1),
        w.values.view(-1, nb, BLOCK).permute(1, 2, 0),
    )[:, :m]  # [nb, m, n]
    scaled = partial * a_s.t().unsqueeze(-1) * w.scale.t().unsqueeze(1)
    acc = torch.zeros(m, w.out_features, dtype=torch.float32, device=a.device)
    per = k_range_blocks(w.k_range_out or w.out_features, nb)
    for start in range(0, nb, per):
        total = torch.zeros_like(acc)
        for kb in range(start, min(start + per, nb)):
            total += scaled[kb]
        acc += total
    return acc


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """y = x @ W^T by the weight's storage kind. x: [N, in]. Quantised weights take an FP8 activation
    (per-32 power-of-two scales) and give bf16; bf16/fp32 weights give their own dtype. The GEMMs run on
    ROW_TILE-padded rows, whatever N: their bits are those of a full tile."""
    if w.kind in ("fp8", "fp4"):
        codes, scales = fp8_act_codes(x)
        return _block_scaled_gemm(pad_rows(codes), scales, w).to(torch.bfloat16)
    return F.linear(pad_rows(x).to(w.values.dtype), w.values)[: x.size(0)]  # a bf16 x widens exactly for fp32


def expert_bank(weights: list[Weight]) -> list[Weight]:
    """The routed experts' weights of one projection, indexable by expert id."""
    return list(weights)


def expert_slots(like: Weight, count: int, pinned: bool = False) -> list[Weight]:
    """A bank of `count` entries for weights shaped like `like` (an expert cache's slots, or the host tier's
    copy of a layer's experts), filled by `expert_put`; entries not yet put read as `like`. `pinned` means
    nothing here: the reference backend's device is host memory."""
    return [like] * count


def expert_put(bank: list[Weight], i: int, w: Weight) -> None:
    """Entry i of a bank (expert_slots) becomes w."""
    bank[i] = w


def expert_linear(x: torch.Tensor, bank: list[Weight], experts: torch.Tensor, slots_per_row: int) -> torch.Tensor:
    """Routed-expert GEMM over slots: row s is x[s // slots_per_row] @ W_{experts[s]}^T (bf16), computed
    per expert over that expert's slots (row-invariant like `linear`)."""
    experts = experts.reshape(-1)
    rows = torch.arange(experts.numel(), device=x.device) // slots_per_row
    y = torch.empty(experts.numel(), bank[0].out_features, dtype=torch.bfloat16, device=x.device)
    for e in torch.unique(experts).tolist():
        slots = torch.nonzero(experts == e).flatten()
        y[slots] = linear(x[rows[slots]], bank[e])
    return y


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float) -> torch.Tensor:
    """Single-KV-head attention over gathered rows with a per-head sink.

    q [N, H, D] bf16; kv [R, D] bf16 (K = V); sink [H] fp32; idx [N, K] int (-1 = no row).
    Online softmax over blocks of 64 indices; probabilities rounded to bf16 before the value product,
    relative to the running maximum. A row with no valid index gives zeros. Returns bf16 [N, H, D].
    """
    return sparse_attn_lse(q, kv, sink, idx, scale)[0]


def sparse_attn_lse(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_attn` and the log of each (query, head)'s softmax denominator, sink included (fp32 [N, H]):
    what a backward needs to recompute the probabilities (train/backend.py)."""
    n, h, d = q.shape
    qf = q.float().unsqueeze(0)
    kvf = kv.float()
    acc = q.new_zeros(1, n, h, d, dtype=torch.float32)
    sum_exp = q.new_zeros(1, n, h, dtype=torch.float32)
    run_max = q.new_full((1, n, h), -1e30, dtype=torch.float32)
    for start in range(0, idx.size(1), SPARSE_ATTN_BLOCK):
        blk = idx[:, start:start + SPARSE_ATTN_BLOCK].long().unsqueeze(0)
        valid = blk != -1
        rows = kvf[blk.clamp_min(0)] * valid.unsqueeze(-1)
        s = torch.einsum("bmhd,bmkd->bmhk", qf, rows)
        # (a Python float: times the float32 scale, with no host tensor for a CUDA graph capture to copy)
        s = torch.where(valid.unsqueeze(2), s, -torch.inf) * scale
        prev = run_max
        run_max = torch.maximum(prev, s.amax(dim=-1))
        rescale = torch.exp(prev - run_max)
        p = torch.exp(s - run_max.unsqueeze(-1))
        sum_exp = sum_exp * rescale + p.sum(dim=-1)
        acc = acc * rescale.unsqueeze(-1) + torch.einsum("bmhk,bmkd->bmhd", p.to(torch.bfloat16).float(), rows)
    sum_exp = sum_exp + torch.exp(sink.float() - run_max)
    return (acc / sum_exp.unsqueeze(-1)).to(torch.bfloat16)[0], (run_max + torch.log(sum_exp))[0]


def mean_square(x: torch.Tensor) -> torch.Tensor:
    """mean(x^2) over the last dim, keepdim (x fp32)."""
    return x.square().mean(-1, keepdim=True)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    return x.sum(-1)


def small_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over a short dim (the mHC streams, the top-k weights, the indexer heads)."""
    return torch.sum(x, dim=dim)


def rms_scale(values: torch.Tensor, x: torch.Tensor, eps: float, mean_square=mean_square) -> torch.Tensor:
    """values * rsqrt(mean(x^2) + eps) per row, fp32 (x bf16 or fp32, its statistics in fp32). `mean_square`
    is the backend's (the composition a fused kernel reproduces)."""
    return values * torch.rsqrt(mean_square(x.float()) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, mean_square=mean_square) -> torch.Tensor:
    """fp32 statistics, the weight multiplied in fp32, result in the input dtype (spec §3)."""
    xf = x.float()
    return (weight * rms_scale(xf, xf, eps, mean_square)).to(x.dtype)


def rope_rotate(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, dim: int, inverse: bool
                ) -> torch.Tensor:
    """Rotate the last `dim` channels of x ([N, C] or [N, H, C], bf16) in place by the complex64 factors
    table[positions] ([N, dim/2]; conjugated when `inverse`): interleaved pairs as complex numbers, each
    product's two fp32 terms rounded, then added (torch's CPU complex multiply), back to x's dtype."""
    tail = x[..., -dim:]
    z = torch.view_as_complex(tail.float().unflatten(-1, (-1, 2)))
    f = table[positions]
    if inverse:
        f = f.conj()
    f = f.view(x.size(0), 1, -1) if x.ndim == 3 else f
    tail.copy_(torch.view_as_real(z * f).flatten(-2))
    return x


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, weights: torch.Tensor | None = None) -> torch.Tensor:
    """An expert's hidden rows: silu(gate) * up in fp32 with the V4.1 clamps (limit > 0), times the routing
    weight when given (broadcast over the last dim), in gate's dtype. gate, up: [..., D]."""
    g, u = gate.float(), up.float()
    if limit > 0:
        u = torch.clamp(u, min=-limit, max=limit)
        g = torch.clamp(g, max=limit)
    h = F.silu(g) * u
    return (h if weights is None else weights * h).to(gate.dtype)


def engram_rows(table: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Engram's hashed rows: table rows (FP8 [rows, De]) times their per-32 scales ([rows, De / 32]),
    gathered by ids [...] -> bf16 [..., De]."""
    values = table[ids].float()
    scales = scale[ids].float()
    return (values.unflatten(-1, (-1, BLOCK)) * scales.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)


def moe_sum(routed: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """A MoE layer's output: the routed experts' rows [N, k, D] (slots in ascending expert id) added to an fp32
    zero in slot order, then the shared expert's [N, D]; in the shared expert's dtype."""
    y = torch.zeros(shared.shape, dtype=torch.float32, device=shared.device)
    for slot in range(routed.size(1)):
        y += routed[:, slot]
    y += shared
    return y.to(shared.dtype)


def stream_mean(h: torch.Tensor) -> torch.Tensor:
    """Mean over the mHC streams (dim 1), in h's dtype (the DSpark taps)."""
    return h.mean(dim=1)


def grouped_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The grouped output projection `wo_a`: x [N, G, D] bf16, w [G, R, D] bf16 -> [N, G, R] bf16 (no
    activation quantisation). A group's result does not depend on how many groups share the call (a
    tensor-parallel rank holds some of them), except that MKL takes another kernel for a batch of one: a
    single group runs as two (itself twice)."""
    if w.size(0) == 1:
        return torch.einsum("sgd,grd->sgr", x.repeat(1, 2, 1), w.repeat(2, 1, 1))[:, :1]
    return torch.einsum("sgd,grd->sgr", x, w)


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, visible: torch.Tensor,
                 keep_blocks: torch.Tensor | None, block: int, small_sum=small_sum) -> torch.Tensor:
    """The indexer's scores of T entries, bf16 [N, T]: each head's logit q.k in bf16 (q [N, H, D], keys
    [T, D]), relu, times the head's weight (weights [N, H] bf16), summed over the heads (`small_sum`: the
    backend's). Entries at or past `visible` [N, 1] are -inf, and with `keep_blocks` (bool [N, ceil(T /
    block)], candidate_blocks) those outside the kept blocks."""
    scores = small_sum(torch.einsum("shd,td->sht", q, keys).relu_() * weights.unsqueeze(-1), 1)
    entries = torch.arange(keys.size(0), device=keys.device)
    scores.masked_fill_(entries >= visible, -torch.inf)
    if keep_blocks is not None:
        scores.masked_fill_(~keep_blocks.repeat_interleave(block, dim=-1)[..., : keys.size(0)], -torch.inf)
    return scores


_KEY_INDEX_BITS = 20  # rows of up to 2^20 values take the keyed top-k below


def topk_lowest_index(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values per row, best first; among exactly equal values the lowest index
    wins (a stable descending sort's first k). For float32/bf16/fp16 rows of fewer than 2^20 values, one
    top-k of distinct integer keys -- each value's order-preserving bits above its reversed index -- gives
    exactly those indices without sorting the whole row (the indexer's rows are thousands wide). A 16-bit
    value in a row of at most 2^16 (the indexer's bf16 scores) makes an int32 key: a radix top-k passes over
    its digits, and half the digits of an int64 key halve its time (the trainer's largest op on a GPU)."""
    width = scores.size(-1)
    if scores.dtype not in (torch.float32, torch.bfloat16, torch.float16) or width >= 1 << _KEY_INDEX_BITS:
        return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    v = scores + 0.0  # exact; -0.0 becomes +0.0, which the sort holds equal
    v = torch.where(v.isnan(), torch.nan, v)  # every NaN as the one positive NaN: above +inf, as the sort has it
    if v.element_size() == 2 and width <= 1 << 16:
        bits, sign, index_bits, key = v.view(torch.int16).int(), 0x7FFF, 16, torch.int32
    else:
        bits, sign, index_bits, key = v.float().view(torch.int32).long(), 0x7FFFFFFF, _KEY_INDEX_BITS, torch.int64
    ordered = torch.where(bits < 0, bits ^ sign, bits)  # negative floats: magnitude bits reversed
    reversed_index = (1 << index_bits) - 1 - torch.arange(width, device=scores.device, dtype=key)
    return torch.topk((ordered << index_bits) | reversed_index, k, dim=-1).indices


def topk_indices(scores: torch.Tensor, k: int, visible: torch.Tensor, width: int) -> torch.Tensor:
    """The indexer's picks: the k best entries of each row (topk_lowest_index), ascending, those at or past
    `visible` [N, 1] as -1, padded with -1 to `width` columns: int64 [N, width]."""
    picks = topk_lowest_index(scores, k).sort(dim=-1).values
    out = torch.full((scores.size(0), width), -1, dtype=torch.int64, device=scores.device)
    out[:, :k] = torch.where(picks < visible, picks, -1)
    return out


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block: int) -> torch.Tensor:
    """Level one of the two-level top-k (the candidate source layer): of each row's blocks of `block`
    entries, keep the `topk_blocks` with the best maximum (topk_lowest_index), always the block of the
    newest visible entry, never a block with no finite score. scores [N, T] (invisible entries -inf),
    visible [N, 1] -> bool [N, ceil(T / block)]."""
    width = scores.size(-1)
    padded = F.pad(scores, (0, -width % block), value=-torch.inf)
    block_scores = padded.unflatten(-1, (-1, block)).amax(dim=-1)
    n_blocks = block_scores.size(-1)
    newest = (visible - 1) // block
    block_scores = block_scores.masked_fill(torch.arange(n_blocks, device=scores.device) == newest, torch.inf)
    picks = topk_lowest_index(block_scores, min(topk_blocks, n_blocks))
    kept = torch.gather(block_scores, -1, picks) > -torch.inf
    return torch.zeros_like(block_scores, dtype=torch.bool).scatter_(-1, picks, kept)


def hc_split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC coefficients from the 24 mixes (fp32): pre, post and the Sinkhorn-normalised comb [.., hc, hc]
    (row = source stream, column = destination), 1 softmax + `iters` alternating normalisations."""
    m = mixes.float()
    pre = torch.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = torch.exp(comb - comb.amax(dim=-1, keepdim=True))
    comb = comb / comb.sum(dim=-1, keepdim=True) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb
