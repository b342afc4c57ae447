"""The model's training mode: the inference forward (dsflash/model, unchanged) over a kernel record whose
ops autograd can differentiate, with straight-through estimators where the forward quantises.

What the reference ops (kernels/cpu.py) give autograd, and what this backend changes:
- FP8/FP4 GEMMs: the reference sums 32-wide K blocks of integer codes in a fixed order, which autograd could
  follow but at the memory of one [K/32, rows, out] partial per call. Here a GEMM is one bf16 matmul of the
  fake-quantised activation and weight (both exact in bf16: E4M3/E2M1 values times powers of two), the
  reference's products summed in the matmul's order; the quantisers' rounding passes the gradient straight
  through (`ste`).
- The weights: fp32 master tensors (`Masters`) behind the checkpoint's names. A linear's FP8 tiles or FP4
  rows and an Engram table's FP8 rows are re-quantised from the master whenever it changed, as the export
  writes them (numerics/codecs.py's bits), so the forward sees the bits the saved checkpoint will hold; the
  weights of one format and shape in one call (`fake_values`: no host reads), once per optimiser step.
- The routed experts: every (row, expert) pair of a MoE layer in one grouped GEMM per projection
  (`expert_linear`), instead of the reference's loop over the experts with its host read of their loads.
- The packed FP4 caches (compressed KV, index keys): the state holds their fake-quantised values instead of
  packed bytes (`TrainState`), so the gradient reaches the compressors through the entries.
- Sparse attention: the reference's forward (a softmax of our own, the same function in other roundings, moved
  the logits far more than its rounding: a small model amplifies it) with an analytic backward
  (`_SparseAttention`): the probabilities recomputed from the saved log-denominators, the kv rows' gradient
  summed by index_add_ on the CPU and in 64-bit fixed point on a GPU (`kv_sums_fixed_point`: integer sums, so
  atomics give the same bits in any order), where autograd kept every block's gathered rows and scatter-added
  their gradient one duplicate at a time (deterministic CUDA index_put sorts, then adds serially: each kv row
  is read by ~128 queries).
- The indexer's scores, top-k and candidate blocks choose indices only: computed without autograd.
- The mHC split + Sinkhorn on a GPU: kernels/cuda's one-launch forward, keeping each normalisation's result,
  and its backward kernel (`_Sinkhorn`), where autograd through the reference's 20 alternating normalisations
  launches ~250 small kernels a site each way. On the CPU autograd follows the reference.
Everything else (norms, the mHC streams, RoPE in place, the router, SwiGLU, the compressor's pooling, the
state's ring writes) is the reference's own torch code, which autograd follows.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.nn.functional as F

from dsflash.checkpoint.reader import Checkpoint
from dsflash.kernels import Kernels, cpu, load_kernels
from dsflash.kernels.cpu import Weight
from dsflash.model.state import GrowingRows, SequenceState
from dsflash.numerics import BLOCK
from dsflash.numerics.codecs import (
    E2M1_MAX,
    E4M3_MAX_INV,
    dequant_fp4_rows,
    dequant_fp8_blocks,
    dequant_fp8_rows,
    e2m1_magnitude,
    quantize_fp4_rows,
    quantize_fp8_blocks,
    quantize_fp8_rows,
)
from dsflash.numerics.quant import e4m3_saturate, fp4_fake_quant, fp8_fake_quant, pow2_ceil, pow2_scale

# how each stored dtype is held as a master, and quantised back (export.py writes these formats)
FP8, FP4, ENGRAM, PLAIN = "fp8", "fp4", "engram", "plain"


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, quantised: torch.Tensor) -> torch.Tensor:
        ctx.dtype = x.dtype
        return quantised.view_as(quantised)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.dtype), None


def ste(x: torch.Tensor, quantised: torch.Tensor) -> torch.Tensor:
    """`quantised`'s values exactly, in its dtype, with x's gradient (the straight-through estimator): no
    arithmetic in the forward (x + (q - x) rounds twice in bf16 and misses q) and one cast in the backward."""
    return _StraightThrough.apply(x, quantised.detach())


def quantised(kind: str, master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, E8M0 scale codes) of a master in its stored format."""
    with torch.no_grad():
        if kind == FP8:
            return quantize_fp8_blocks(master)
        if kind == FP4:
            return quantize_fp4_rows(master)
        return quantize_fp8_rows(master)


def dequantised(kind: str, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if kind == FP8:
        return dequant_fp8_blocks(codes, scale)
    if kind == FP4:
        return dequant_fp4_rows(codes, scale)
    return dequant_fp8_rows(codes, scale)


def _e4m3_values(groups: torch.Tensor, dims: int | tuple[int, ...]) -> torch.Tensor:
    """E4M3 values times the power-of-two scale 2^ceil(log2(amax x 1/448)) of each block over `dims` (the
    float32 reciprocal, a floor of 1e-4 on amax), float32: codecs' FP8 quantisers, then their dequantisation."""
    s = pow2_scale(groups.abs().amax(dim=dims, keepdim=True).clamp_min(1e-4), E4M3_MAX_INV)
    return e4m3_saturate(groups / s).float() * s


def fake_values(kind: str, w: torch.Tensor) -> torch.Tensor:
    """float32 [..., out, in] (one weight, or a stack of weights of one shape) -> its values as the stored
    format holds them: `dequantised(kind, *quantised(kind, w))`'s bits, each weight of a stack on its own,
    computed without the codecs' host-side checks (a host read each on a GPU)."""
    w = w.float()
    if kind == FP4:  # codecs.quantize_fp4_rows: the scale from amax / 6, divided (not times 1/6)
        groups = w.unflatten(-1, (-1, BLOCK))
        s = pow2_ceil(groups.abs().amax(dim=-1, keepdim=True).clamp_min(E2M1_MAX * 2.0**-126) / E2M1_MAX)
        v = groups / s
        return (torch.copysign(e2m1_magnitude(v), v) * s).flatten(-2)  # decode(encode(v)): the sign of 0 kept
    if kind == FP8:  # codecs.quantize_fp8_blocks: BLOCK x BLOCK tiles, partial edge tiles included
        rows, cols = w.shape[-2:]
        tiles = F.pad(w, (0, -cols % BLOCK, 0, -rows % BLOCK)).unflatten(-2, (-1, BLOCK)).unflatten(-1, (-1, BLOCK))
        return _e4m3_values(tiles, (-3, -1)).flatten(-2).flatten(-3, -2)[..., :rows, :cols]
    return _e4m3_values(w.unflatten(-1, (-1, BLOCK)), -1).flatten(-2)


class Masters:
    """The trainable tensors by checkpoint name, in fp32, and a checkpoint-like face (`get`, `has`, `names`,
    `args`) the model's WeightLoader reads.

    `get` of a plain (BF16/F32) tensor is the master cast to the stored dtype: a fresh autograd node, so a
    model built for a step differentiates into the masters (a model is built per step; building is cheap next
    to a forward). `get` of a quantised weight or Engram table is a fixed handle tensor with the stored codes'
    dtype; the training backend's `weight` and `engram_rows` look the master up by the handle, and a linear
    reads its stored values from `values`."""

    def __init__(self, ckpt: Checkpoint, device: torch.device | str):
        self.args, self.device = ckpt.args, torch.device(device)
        self.params: dict[str, torch.Tensor] = {}
        self.kinds: dict[str, str] = {}
        self.stored_dtype: dict[str, torch.dtype] = {}
        self._handles: dict[str, torch.Tensor] = {}
        self._by_handle: dict[int, str] = {}
        self._formats: dict[tuple, list[str]] = {}  # (kind, shape) -> the FP8/FP4 linears quantised together
        self._values: dict[str, tuple[int, torch.Tensor]] = {}  # name -> (its master's version, bf16 values)
        # name -> (its master's version when loaded, the checkpoint's codes and scale): `stored`
        self._loaded: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = {}
        for name in ckpt.names():
            t = ckpt.get(name)
            if t.dtype == torch.float8_e8m0fnu:  # a scale: re-derived from its weight's master
                continue
            if t.dtype == torch.float8_e4m3fn or t.dtype in (torch.int8, torch.uint8):
                scale = ckpt.get(name[: -len("weight")] + "scale")
                kind = ENGRAM if ".engram.embed." in name else FP8 if t.dtype == torch.float8_e4m3fn else FP4
                value = dequantised(kind, t, scale)
                self._handles[name] = t.to(self.device)
                self._handles[name[: -len("weight")] + "scale"] = scale.to(self.device)
                self._by_handle[id(self._handles[name])] = name
            else:
                kind, value = PLAIN, t.float()
            self.kinds[name], self.stored_dtype[name] = kind, t.dtype
            self.params[name] = value.to(self.device).requires_grad_(not name.endswith(".gate.bias"))
            if kind != PLAIN:
                self._loaded[name] = (self.params[name]._version, t, scale)
            if kind in (FP8, FP4):
                self._formats.setdefault((kind, tuple(value.shape)), []).append(name)

    def names(self) -> list[str]:
        return sorted([*self.params, *(n for n in self._handles if n not in self.params)])

    def has(self, name: str) -> bool:
        return name in self.params or name in self._handles

    def get(self, name: str) -> torch.Tensor:
        if name in self._handles:
            return self._handles[name]
        return self.params[name].to(self.stored_dtype[name])

    def name_of(self, handle: torch.Tensor) -> str:
        """The name of a quantised tensor's handle (what `get` gave the model)."""
        name = self._by_handle.get(id(handle))
        if name is None:
            raise KeyError("not a handle of these masters: the model was built from another checkpoint")
        return name

    def values(self, name: str) -> torch.Tensor:
        """An FP8/FP4 linear's stored values (bf16, which holds them exactly) with its master's gradient.
        Re-quantised only when the master changed since (its in-place version counter: the optimiser's step),
        then with every weight of its format and shape in one `fake_values` call."""
        master = self.params[name]
        held = self._values.get(name)
        if held is None or held[0] != master._version:
            names = self._formats[(self.kinds[name], tuple(master.shape))]
            with torch.no_grad():
                stacked = fake_values(self.kinds[name], torch.stack([self.params[n] for n in names]))
            for n, v in zip(names, stacked.to(torch.bfloat16), strict=True):
                self._values[n] = (self.params[n]._version, v)
            held = self._values[name]
        return ste(master, held[1]) if master.requires_grad and torch.is_grad_enabled() else held[1]

    def stored(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A quantised tensor's (codes in its stored dtype, E8M0 scale) on the CPU: the checkpoint's own while
        its master is as loaded -- re-quantising the dequantised values gives the same values but not always the
        same bytes (an all-zero block's scale, a block whose largest value two scales represent) -- else its
        master quantised."""
        master, loaded = self.params[name], self._loaded.get(name)
        if loaded is not None and loaded[0] == master._version:
            return loaded[1].cpu(), loaded[2].cpu()
        codes, scale = quantised(self.kinds[name], master.detach())
        return codes.view(self.stored_dtype[name]).cpu(), scale.view(torch.float8_e8m0fnu).cpu()

    def forget_values(self) -> None:
        """Drop the cached stored values, so the next forward quantises every linear from its master (what a
        CUDA graph capturing that forward must record: its replays follow the optimiser's steps)."""
        self._values.clear()

    def trainable(self, prefix: str = "") -> list[torch.Tensor]:
        return [p for n, p in self.params.items() if p.requires_grad and n.startswith(prefix)]


class TrainWeight(Weight):
    """A quantised linear's master; `values` are its stored values (FP8 tiles or FP4 rows), straight through."""

    def __init__(self, masters: Masters, name: str):
        self.masters, self.name = masters, name
        self.kind, self.master = masters.kinds[name], masters.params[name]

    @property
    def values(self) -> torch.Tensor:
        return self.masters.values(self.name)

    @property
    def scale(self) -> None:
        return None

    @property
    def out_features(self) -> int:
        return self.master.size(0)

    @property
    def in_features(self) -> int:
        return self.master.size(1)


class _LazyRows(GrowingRows):
    """GrowingRows whose row shape and dtype are the first rows written (the cache values of TrainState)."""

    def __init__(self, device: torch.device):
        self._buf, self.n, self._device = None, 0, device
        self._pool, self._role = None, None  # a training forward's state is its own

    def reserve(self, n: int) -> None:
        if self._buf is not None:
            super().reserve(n)

    def put(self, first: torch.Tensor, rows: torch.Tensor, end: int) -> None:
        if self._buf is None:
            self._buf = rows.new_zeros(0, *rows.shape[1:])
        super().put(first, rows, end)


class TrainState(SequenceState):
    """A sequence's state in training: the compressed KV and index keys as their fake-quantised bf16 values
    (what the reference's packing reads back), so autograd follows the entries."""

    def rows(self, table: dict, key: int, shape: tuple[int, ...], dtype: torch.dtype) -> GrowingRows:
        r = table.get(key)
        if r is None:
            r = table[key] = _LazyRows(self.device)
        return r


class _Rows(torch.autograd.Function):
    """Rows of x by `index` (index x.size(0): a zero row) whose backward is a gather too, by `inverse` (the
    row of the result each row of x went to, or the result's row count: none), where each row of x goes to
    at most one row: no scatter-add, which a deterministic CUDA run does by sorting."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return F.pad(x, (0, 0, 0, 1)).index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        return F.pad(grad, (0, 0, 0, 1)).index_select(0, inverse), None, None


KvParts = list[tuple[torch.Tensor, torch.Tensor]]  # (kv row of each index [M], its gradient fp32 [M, D]), -1: none


def kv_sums(parts: KvParts, kv: torch.Tensor) -> torch.Tensor:
    """The kv rows' gradient, fp32 [R, D]: each part's rows added at their indices in order (the CPU's
    index_add_ is sequential, so the sums are reproducible; an index of -1 carries a zero gradient)."""
    out = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    for rows_of, part in parts:
        out.index_add_(0, rows_of.clamp_min(0), part)
    return out


def kv_sums_fixed_point(parts: KvParts, kv: torch.Tensor, add_rows=None) -> torch.Tensor:
    """`kv_sums` on a GPU, where adding floats by atomics lands in any order: each contribution times 2^k
    truncated to int64 (exact in fp32 for a power of two), the integers added (kernels/cuda add_rows_fixed_point),
    then divided back. k = 62 - bits - e, with every contribution below 2^e and 2^bits above the count of
    contributions, so no sum overflows; the resolution is 2^-(62 - bits) of the largest (2^-40 at 16K queries
    of 192 indices); k is capped at 100 so that 2^k stays an fp32."""
    if add_rows is None:
        from dsflash.kernels import cuda  # Triton: imported only where a GPU trains

        add_rows = cuda.add_rows_fixed_point
    largest = torch.stack([part.abs().amax() for _, part in parts]).amax()
    bits = sum(rows_of.numel() for rows_of, _ in parts).bit_length()
    k = (62 - bits - torch.frexp(largest).exponent).clamp_max(100)
    factor = torch.ldexp(torch.ones((), dtype=torch.float32, device=kv.device), k)
    fixed = torch.zeros(kv.shape, dtype=torch.int64, device=kv.device)
    for rows_of, part in parts:
        add_rows(fixed, rows_of, part, factor)
    return (fixed.double() / factor.double()).float()


def sparse_attn_grads(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                      out: torch.Tensor, lse: torch.Tensor, d_out: torch.Tensor, sums=kv_sums
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (q, kv, sink) of cpu.sparse_attn's output `out` ([N, H, D]; lse: cpu.sparse_attn_lse's)
    given d_out, a block of 64 indices at a time: p = exp(s - lse), ds = p * (d_out . v - d_out . out). K = V, so
    a picked row's gradient is its key's (ds q) plus its value's (p d_out) over the heads, one product of the
    two side by side; `sums` adds them into the kv rows. An index of -1 has p = 0, so its gathered row (row 0)
    contributes nothing. The bf16 rounding of p before the value product is passed straight through, as
    autograd through the reference did."""
    qf, do, kvf = q.float(), d_out.float(), kv.float()
    delta = (do * out.float()).sum(-1)
    dq = torch.zeros_like(qf)
    q_and_do = torch.cat([qf, do], dim=1)
    parts = []
    for start in range(0, idx.size(1), cpu.SPARSE_ATTN_BLOCK):
        blk = idx[:, start:start + cpu.SPARSE_ATTN_BLOCK].long()
        rows = kvf[blk.clamp_min(0)]
        s = torch.where((blk >= 0).unsqueeze(1), torch.einsum("nhd,nbd->nhb", qf, rows), -torch.inf) * scale
        p = torch.exp(s - lse.unsqueeze(-1))
        ds = p * (torch.einsum("nhd,nbd->nhb", do, rows) - delta.unsqueeze(-1)) * scale
        dq += torch.einsum("nhb,nbd->nhd", ds, rows)
        parts.append((blk.reshape(-1), torch.einsum("nhb,nhd->nbd", torch.cat([ds, p], dim=1), q_and_do)
                      .reshape(-1, kv.size(1))))
    dsink = -(torch.exp(sink.float() - lse) * delta).sum(0)
    return dq.to(q.dtype), sums(parts, kv).to(kv.dtype), dsink.to(sink.dtype)


class _SparseAttention(torch.autograd.Function):
    """cpu.sparse_attn (its bits) whose backward is `sparse_attn_grads`, the kv sums in fixed point on a GPU."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float
                ) -> torch.Tensor:
        out, lse = cpu.sparse_attn_lse(q, kv, sink, idx, scale)
        ctx.save_for_backward(q, kv, sink, idx, out, lse)
        ctx.scale = scale
        return out.clone()  # the caller rotates it in place (inverse RoPE), which a view or the saved out forbid

    @staticmethod
    def backward(ctx, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, kv, sink, idx, out, lse = ctx.saved_tensors
        sums = kv_sums_fixed_point if kv.is_cuda else kv_sums
        return (*sparse_attn_grads(q, kv, sink, idx, ctx.scale, out, lse, d_out, sums), None, None)


class _Sinkhorn(torch.autograd.Function):
    """kernels/cuda's hc_split_sinkhorn (the CUDA backend's bits) with its backward kernel; the gradients of the
    mixes, the scales and the bases from the pre-activations' gradient by a product and sums over the rows."""

    @staticmethod
    def forward(ctx, mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from dsflash.kernels import cuda  # Triton: imported only where a GPU trains

        m = mixes.float().reshape(-1, mixes.size(-1))
        states = torch.empty((iters, m.size(0), hc * hc), dtype=torch.float32, device=m.device)
        out = cuda.hc_split_sinkhorn(mixes, scale, base, hc, iters, eps, states)
        ctx.save_for_backward(m, scale, base, states)
        ctx.shape, ctx.dtypes, ctx.hc, ctx.iters, ctx.eps = mixes.shape, (mixes.dtype, scale.dtype, base.dtype), hc, \
            iters, eps
        return out

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        from dsflash.kernels import cuda

        m, scale, base, states = ctx.saved_tensors
        hc = ctx.hc
        widths = (hc, hc, hc * hc)
        g_pre, g_post, g_comb = (torch.zeros((m.size(0), w), dtype=torch.float32, device=m.device) if g is None
                                 else g for g, w in zip(grads, widths, strict=True))
        dz = cuda.hc_split_sinkhorn_backward(m, scale, base, states, g_pre, g_post, g_comb, hc, ctx.iters, ctx.eps)
        s = scale.float()
        g_mixes = dz * torch.cat([s[i].expand(w) for i, w in enumerate(widths)])
        g_scale = torch.stack([part.sum() for part in (dz * m).split(widths, dim=-1)])
        dtypes = ctx.dtypes
        return (g_mixes.view(ctx.shape).to(dtypes[0]), g_scale.to(dtypes[1]), dz.sum(0).to(dtypes[2]), None, None,
                None)


# rows of one expert in a grouped GEMM start at a multiple of this: 16-byte aligned bf16 operands for CUDA's
# grouped kernel (its weight gradient slices the rows by expert)
GROUP_ROWS = 16


def id_counts(ids: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of 0..n-1 occurs in ids, int64 [n] (not bincount: on a GPU it reads the largest id back
    to the host, which a CUDA graph cannot capture)."""
    return (ids.reshape(-1, 1) == torch.arange(n, device=ids.device)).sum(0)


def grouped_slots(experts: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layout of a grouped GEMM over slots (experts: the bank entry of each slot, [S]), computed on the
    device: (the slot of each grouped row or S for padding [S + n * (GROUP_ROWS - 1)], the grouped row of each
    slot [S], the end of each entry's rows int32 [n]). Entry by entry ascending, its slots in order."""
    s = experts.numel()
    order = torch.sort(experts, stable=True).indices
    counts = id_counts(experts, n)
    padded = (counts + GROUP_ROWS - 1) // GROUP_ROWS * GROUP_ROWS
    ends = padded.cumsum(0)
    by_entry = experts[order]
    rank = torch.arange(s, device=experts.device) - (counts.cumsum(0) - counts)[by_entry]
    grouped = (ends - padded)[by_entry] + rank
    slot_of_row = torch.full((s + n * (GROUP_ROWS - 1),), s, dtype=torch.int64, device=experts.device)
    slot_of_row[grouped] = order
    row_of_slot = torch.empty_like(order)
    row_of_slot[order] = grouped
    return slot_of_row, row_of_slot, ends.to(torch.int32)


def training_kernels(masters: Masters) -> Kernels:
    """The reference record with the training ops above, on the masters' device."""
    base = load_kernels(masters.device, reference=True)

    def weight(kind: str, stored: torch.Tensor, scale: torch.Tensor | None) -> Weight:
        if kind in (FP8, FP4):
            return TrainWeight(masters, masters.name_of(stored))
        return Weight(kind, stored.to(torch.float32 if kind == "fp32" else torch.bfloat16))

    def act(x: torch.Tensor) -> torch.Tensor:
        return ste(x, fp8_fake_quant(x.detach()))

    def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
        if w.kind in (FP8, FP4):
            return F.linear(act(x), w.values)
        # a copy: autograd saves the input for the weight's gradient, and the forward may rotate it in place
        # afterwards (the compressor's latent after the index keys' wk, which the indexer's KL differentiates)
        return F.linear(x.to(w.values.dtype, copy=True), w.values)

    def expert_linear(x: torch.Tensor, bank: list[TrainWeight], experts: torch.Tensor, slots_per_row: int
                      ) -> torch.Tensor:
        """kernels/cpu.py's expert_linear (row s: x[s // slots_per_row] @ W_{experts[s]}^T, bf16), every slot
        in one grouped GEMM: each row's FP8 activation once, then its slots grouped by bank entry."""
        experts = experts.reshape(-1)
        slot_of_row, row_of_slot, ends = grouped_slots(experts, len(bank))
        slots = act(x).unsqueeze(1).expand(-1, slots_per_row, -1).reshape(experts.numel(), -1)
        w = torch.stack([b.values for b in bank])
        y = torch._grouped_mm(_Rows.apply(slots, slot_of_row, row_of_slot), w.transpose(1, 2), offs=ends)
        return _Rows.apply(y, row_of_slot, slot_of_row)

    def engram_rows(table: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        name = masters.name_of(table)
        rows = masters.params[name][ids.flatten()]
        return ste(rows, fake_values(masters.kinds[name], rows.detach())).view(*ids.shape, -1).to(torch.bfloat16)

    def fp4_values(x: torch.Tensor, block: int, e4m3_scale: bool) -> torch.Tensor:
        return ste(x, fp4_fake_quant(x.detach(), block, e4m3_scale))

    sinkhorn = _Sinkhorn.apply if masters.device.type == "cuda" else base.hc_split_sinkhorn

    # every MoE chunk through `expert_linear` (model/moe.py's slot path, no host read of the routing)
    return dataclasses.replace(
        base, name="training", row_tile=1, slot_moe_rows=sys.maxsize, weight=weight, linear=linear,
        expert_bank=list, expert_linear=expert_linear, engram_rows=engram_rows, hc_split_sinkhorn=sinkhorn,
        sparse_attn=_SparseAttention.apply,
        fp8_fake_quant=act, fp4_fake_quant=fp4_values,
        fp4_quant_packed=fp4_values, fp4_dequant_packed=lambda values, d, block, e4m3: values,
        index_scores=torch.no_grad()(cpu.index_scores))
