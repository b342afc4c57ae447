"""CSA2 attention (spec §6): a sliding window of this layer's own FP8 KV plus, for ratio>0 layers,
`index_topk` compressed rows of the nearest KV source picked by the nearest index source.

Index layout per query (fixed, so a row's arithmetic never depends on the chunk it came in):
`window_size` window slots, ascending positions from max(0, t - window + 1), -1 where the slot is
before the sequence; then `index_topk` compressed rows ascending, -1 padded. This is the layout of
DeepSeek's one-shot prefill whenever the prompt is at least one window and `index_topk` groups long.
"""

from __future__ import annotations

import torch

from dsflash.config import ModelArgs
from dsflash.kernels import Kernels
from dsflash.kernels.cpu import Weight
from dsflash.model.common import Chunk
from dsflash.model.rope import Rope
from dsflash.model.state import GrowingRows, PositionRing
from dsflash.model.weights import WeightLoader
from dsflash.numerics.packing import ENTRY, INDEX_KEY, packed_width

INDEXER_ROWS = 1024


def window_source(k: Kernels, positions: torch.Tensor, n: int, window: int, capacity: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The window ring's side of a chunk whose rows sit at `positions` (consecutive, the first n real): (the
    ring slots of positions p0-window .. p0-1, int64 [window]; indices [N, window] into those rows then the
    chunk's rows, ascending positions from max(0, t - window + 1), -1 past the row's own position; the ring
    slots the chunk's last min(n, capacity) real rows go to). Device ops on the positions only, so a CUDA graph
    replays them for any p0. `k.window_source`, where the backend fuses it (a dozen small ops a chunk)."""
    if k.window_source is not None:
        return k.window_source(positions, n, window, capacity)
    first = positions[:1] - window
    start = (positions - window + 1).clamp_min(0).unsqueeze(1)
    pos = start + torch.arange(window, device=positions.device)
    slots = (first + torch.arange(window, device=positions.device)) % capacity
    keep = min(n, capacity)
    return (slots, torch.where(pos > positions.unsqueeze(1), -1, pos - first),
            positions[n - keep:n] % capacity)


def window_rows(k: Kernels, ring: PositionRing, slots: torch.Tensor, written: torch.Tensor, kv: torch.Tensor, n: int,
                comp: torch.Tensor | None) -> torch.Tensor:
    """The attention's source rows -- the ring's rows at `slots` (window_source's), the chunk's kv rows, then
    the compressed rows if any -- as a new tensor, then the chunk's last real kv rows into the ring at
    `written` (the source keeps the rows it read). `k.window_rows`, where the backend fuses the gather, the
    concatenation and the ring's write, when no slot written is read: the ring holds the window, n rows and
    more (a decode step's rows fit its rollback rows; a long prefill chunk wraps)."""
    if k.window_rows is not None and ring.capacity >= slots.numel() + n:
        return k.window_rows(ring.data, slots, written, kv, n, comp)
    # the gather and the concatenation cost ~3 µs of GPU time in a graph; reading the three sources in place
    # doubled the attention kernel's time (docs/rejected-ideas.md)
    source = torch.cat([ring.data[slots], kv, *([] if comp is None else [comp])])
    ring.data[written] = kv[n - written.numel():n]
    return source


def attention_indices(k: Kernels, window_idx: torch.Tensor, picks: torch.Tensor, offset: int, local: bool
                      ) -> torch.Tensor:
    """The attention's indices [rows, window + topk]: the window's, then the compressed picks past the window
    source (`offset`) -- as the slots r * topk + j of the rows decoded one a pick when `local`, else as
    themselves -- valid entries first, in order: which 64-block of the online softmax an entry falls in changes
    the bits. `k.attention_indices`, where the backend fuses it (a dozen small ops an index layer's step)."""
    if k.attention_indices is not None:
        return k.attention_indices(window_idx, picks, offset, local)
    if local:
        picks = torch.where(picks >= 0, torch.arange(picks.numel(), device=picks.device).view_as(picks), -1)
    idx = torch.cat([window_idx, torch.where(picks >= 0, picks + offset, -1)], dim=1)
    return torch.gather(idx, 1, torch.sort((idx < 0).to(torch.int8), dim=1, stable=True).indices)


def picked_entries(k: Kernels, packed: torch.Tensor, picks: torch.Tensor, d: int) -> torch.Tensor:
    """The packed compressed entries `picks` names, decoded, a row a pick (a -1 reads row 0, which the
    attention's indices never name). `k.fp4_dequant_picked`, where the backend gathers inside the decode."""
    if k.fp4_dequant_picked is not None:
        return k.fp4_dequant_picked(packed, picks, d, *ENTRY)
    return k.fp4_dequant_packed(packed[picks.flatten().clamp_min(0)], d, *ENTRY)


class Compressor:
    """Pools `ratio` consecutive tokens into one latent (pre-RoPE). Ratio 1 is a plain projection;
    ratio > 1 is a per-channel softmax gate over the group's tokens, in fp32."""

    def __init__(self, args: ModelArgs, layer: int, w: WeightLoader, prefix: str):
        self.k = w.k
        self.ratio = args.compress_ratios[layer]
        self.eps = args.norm_eps
        self.norm = w.tensor(prefix + "norm.weight")
        self.wkv = w.linear(prefix + "wkv", widen=self.ratio > 1)
        self.wgate = w.linear(prefix + "wgate", widen=True) if self.ratio > 1 else None
        self.layer, self.dim = layer, args.head_dim

    def raw_ring(self, state) -> PositionRing:
        """A ratio > 1 source's fp32 (kv, score) rows by position: the incomplete group's."""
        return state.ring(state.raw, self.layer, self.ratio, (2, self.dim), torch.float32)

    def __call__(self, x: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        """Latents of the groups completed by the chunk's real rows: (p0 % ratio + n) // ratio of them, the
        first being group p0 // ratio. Positions by device tensors only (a CUDA graph serves any p0 with the
        same p0 % ratio)."""
        state, ratio = chunk.state, self.ratio
        if ratio == 1:
            return self.k.rms_norm(self.k.linear(x, self.wkv)[: chunk.n], self.norm, self.eps)
        xf = x.float()
        kv, score = self.k.linear(xf, self.wkv)[: chunk.n], self.k.linear(xf, self.wgate)[: chunk.n]
        rows = torch.stack([kv, score], dim=1)
        raw = self.raw_ring(state)
        # the chunk's groups, including the one its first rows complete from earlier positions
        held = raw.read(group_start(chunk, ratio) + torch.arange(chunk.p0 % ratio, device=x.device))
        raw.write(chunk.positions[: chunk.n], rows)
        rows = torch.cat([held, rows])
        grouped = rows[: rows.size(0) // ratio * ratio].unflatten(0, (-1, ratio))
        return self.k.rms_norm(softmax_pool(self.k, grouped[:, :, 0], grouped[:, :, 1]), self.norm, self.eps)


def softmax_pool(k: Kernels, kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """The compressor's pooling: a group's `ratio` rows kv [G, ratio, D] weighted by the per-channel softmax
    over the group of score [G, ratio, D] (fp32), summed over the group, in bf16 [G, D]. `k.softmax_pool`,
    where the backend has it, is one kernel with these bits."""
    if k.softmax_pool is not None:
        return k.softmax_pool(kv, score)
    return (kv * score.softmax(dim=1)).sum(dim=1).to(torch.bfloat16)


class SourceWriter:
    """A KV source's cache write (spec §6.3): pool the group latents, derive the FP4 index keys from the
    pre-RoPE latent, RoPE + FP4 the latent into the compressed KV. Runs on whichever side of the split
    owns the layer's input: layer 20's on the box, since its input is the hand-off."""

    def __init__(self, args: ModelArgs, layer: int, w: WeightLoader, prefix: str, rope: Rope):
        self.k = w.k
        self.args, self.layer, self.rope = args, layer, rope
        self.ratio = args.compress_ratios[layer]
        self.eps = args.norm_eps
        self.compressor = Compressor(args, layer, w, prefix + "compressor.")
        self.wk = w.linear(prefix + "indexer.wk")
        self.k_norm = w.tensor(prefix + "indexer.k_norm.weight")

    def entries(self, x: torch.Tensor, chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        """(compressed entries, index keys) of the groups the chunk's real rows complete, packed as the
        state holds them (numerics/packing.py)."""
        latent = self.compressor(x, chunk)
        group_pos = group_start(chunk, self.ratio) + torch.arange(latent.size(0), device=latent.device) * self.ratio
        # the keys only choose indices: they learn from the indexer's own loss alone (train/indexer.py), which
        # must not reach the compressor and the layers below through them (a no-op in inference)
        k = self.k.rms_norm(self.k.linear(latent.detach(), self.wk), self.k_norm, self.eps)
        self.rope.rotate(k, group_pos)
        self.rope.rotate(latent, group_pos)
        return self.k.fp4_quant_packed(latent, *ENTRY), self.k.fp4_quant_packed(k, *INDEX_KEY)

    def __call__(self, x: torch.Tensor, chunk: Chunk) -> None:
        """Write the chunk's new entries and keys at their group ids (device positions: a CUDA graph writes
        them at any p0 with the same p0 % ratio; the graph's caller reserves the rows beforehand)."""
        first = group_start(chunk, self.ratio) // self.ratio
        end = (chunk.p0 + chunk.n) // self.ratio
        for rows, new in zip(source_rows(chunk.state, self.args, self.layer), self.entries(x, chunk), strict=True):
            rows.put(first, new, end)


def group_start(chunk: Chunk, ratio: int) -> torch.Tensor:
    """Position of the first token of the group the chunk's first row belongs to (int64 [1], on the device)."""
    return chunk.positions[:1] - chunk.p0 % ratio


def source_rows(state, args: ModelArgs, layer: int) -> tuple[GrowingRows, GrowingRows]:
    """A KV source's packed compressed entries and index keys (SourceWriter.entries), one row per group."""
    return (state.rows(state.compressed, layer, (packed_width(args.head_dim, ENTRY[0]),), torch.uint8),
            state.rows(state.index_keys, layer, (packed_width(args.index_head_dim, INDEX_KEY[0]),), torch.uint8))


def append_entries(state, args: ModelArgs, layer: int, entries: torch.Tensor, keys: torch.Tensor) -> None:
    """Append a source's packed compressed entries and index keys (SourceWriter.entries)."""
    for rows, new in zip(source_rows(state, args, layer), (entries, keys), strict=True):
        rows.append(new)


def visible_entries(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """[rows, 1]: how many compressed entries of a ratio-`ratio` source each query position sees (its groups
    complete up to and including it)."""
    return ((positions + 1) // ratio).unsqueeze(-1)


class Indexer:
    """Scores compressed entries per query with FP4 queries against FP4 index keys and keeps the top
    `index_topk` (spec §6.4)."""

    def __init__(self, args: ModelArgs, layer: int, w: WeightLoader, prefix: str):
        self.k = w.k
        self.args, self.layer = args, layer
        self.ratio = args.compress_ratios[layer]
        self.wq_b = w.linear(prefix + "wq_b")
        self.weights_proj = w.linear(prefix + "weights_proj")
        self.is_candidate_source = layer == args.candidate_source_layer
        self.uses_candidates = 0 <= args.candidate_source_layer < layer

    def queries(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, rope: Rope
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' index queries, RoPE'd and FP4-valued [rows, index heads, index_head_dim], and their heads'
        weights [rows, index heads], from the attention input x and the q LoRA latent qr."""
        a = self.args
        q = self.k.linear(qr, self.wq_b).unflatten(-1, (a.index_n_heads, a.index_head_dim))
        rope.rotate(q, positions)
        q = self.k.fp4_fake_quant(q, *INDEX_KEY)  # the index queries take the index keys' FP4 format
        weights = self.k.linear(x, self.weights_proj) * (a.index_head_dim ** -0.5 * a.index_n_heads ** -0.5)
        return q, weights

    def select(self, x: torch.Tensor, qr: torch.Tensor, source: int, chunk: Chunk, rope: Rope) -> torch.Tensor:
        """[rows, index_topk] entries of KV source `source` per query, ascending, -1 padded."""
        a = self.args
        # a graphed forward scores the whole capacity (its shape must not follow the context): the rows past
        # the source's count are past every query's `visible`, so they score -inf and are never picked
        held = chunk.source(source)[1]
        packed = held.buffer if chunk.graphed else held.rows
        # every index layer reading this source in this chunk scores the same keys: decoded once
        keys = chunk.shared(("index keys", source, packed.size(0)),
                            lambda: self.k.fp4_dequant_packed(packed, a.index_head_dim, *INDEX_KEY))
        q, weights = self.queries(x, qr, chunk.positions, rope)
        k = min(a.index_topk, keys.size(0))
        out = torch.empty((chunk.rows, a.index_topk), dtype=torch.int64, device=keys.device)
        visible = visible_entries(chunk.positions, self.ratio)
        if self.is_candidate_source:
            n_blocks = -(-keys.size(0) // a.candidate_block_size)
            chunk.candidates = torch.empty(chunk.rows, n_blocks, dtype=torch.bool, device=keys.device)
        # the score rows grow with the context: score query rows a block at a time
        for r in range(0, chunk.rows, INDEXER_ROWS):
            rows = slice(r, r + INDEXER_ROWS)
            keep = chunk.candidates[rows] if self.uses_candidates else None
            scores = self.k.index_scores(q[rows], keys, weights[rows], visible[rows], keep, a.candidate_block_size)
            if self.is_candidate_source:
                chunk.candidates[rows] = self.k.candidate_blocks(scores, visible[rows], a.candidate_topk_blocks,
                                                                 a.candidate_block_size)
            out[rows] = self.k.topk_indices(scores, k, visible[rows], a.index_topk)
        forced = chunk.select and chunk.select.rows(chunk.select.index_topk, self.layer, chunk.positions[: chunk.n])
        if forced is not None:
            out[: chunk.n] = -1
            out[: chunk.n, : forced.size(1)] = forced
        return out


def head_outputs(k: Kernels, rope: Rope, qr: torch.Tensor, source: torch.Tensor, idx: torch.Tensor,
                 positions: torch.Tensor, wq_b: Weight, sink: torch.Tensor, wo_a: torch.Tensor, head_dim: int
                 ) -> torch.Tensor:
    """Some heads' part of the attention sub-layer, up to `wo_a`: their q (wq_b's rows for them) RoPE'd, the
    sparse attention of each over the source rows [R, head_dim] at idx [N, K], inverse RoPE, then the grouped
    `wo_a` of the groups they make up (wo_a [groups, o_lora_rank, heads_per_group * head_dim]) -> bf16 [N,
    groups, o_lora_rank]. Nothing here sums across heads or groups: a tensor-parallel rank's heads give the
    one-device bits of their columns (model/parallel.py AttentionShard)."""
    q = k.linear(qr, wq_b).unflatten(-1, (-1, head_dim))
    rope.rotate(q, positions)
    o = k.sparse_attn(q, source, sink, idx, head_dim ** -0.5)
    rope.rotate(o, positions, inverse=True)
    return k.grouped_linear(o.view(o.size(0), wo_a.size(0), -1), wo_a)


class Attention:
    """`writes_source`: False when another side computes this KV source's cache entries (the first
    decoder layer of a split, whose input the box holds). Under tensor parallelism the heads' part (wq_b, the
    sinks, the attention, `wo_a`, `wo_b`) runs over the ranks, each its heads (`self.tp`); the q and kv LoRA, the
    indexer, the sources and the state stay here."""

    def __init__(self, args: ModelArgs, layer: int, w: WeightLoader, prefix: str, ropes: tuple[Rope, Rope],
                 writes_source: bool = True):
        self.k = w.k
        self.args, self.layer = args, layer
        self.ratio = args.compress_ratios[layer]
        self.eps = args.norm_eps
        self.rope = ropes[1] if self.ratio else ropes[0]
        self.wq_a = w.linear(prefix + "wq_a")
        self.q_norm = w.tensor(prefix + "q_norm.weight")
        self.wkv = w.linear(prefix + "wkv")
        self.kv_norm = w.tensor(prefix + "kv_norm.weight")
        self.tp = w.parallel.attention(w, prefix, self.rope) if w.parallel is not None else None
        if self.tp is None:
            self.attn_sink = w.tensor(prefix + "attn_sink").float()
            self.wq_b = w.linear(prefix + "wq_b")
            self.wo_a = w.tensor(prefix + "wo_a.weight").view(args.o_groups, args.o_lora_rank, -1)
            self.wo_b = w.linear(prefix + "wo_b")
        backbone = layer < args.n_layers
        self.is_kv_source = backbone and layer in args.kv_source_layers
        self.is_index_source = backbone and layer in args.index_source_layers
        self.kv_source = args.kv_source_of(layer) if self.ratio else None
        self.source_writer = None
        if self.is_kv_source and writes_source:
            self.source_writer = SourceWriter(args, layer, w, prefix, self.rope)
        self.indexer = Indexer(args, layer, w, prefix + "indexer.") if self.is_index_source else None

    def __call__(self, x: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        """The attention sub-layer over the chunk's rows: normalised input x [rows, D] -> output [rows, D]. The
        window KV is forked (`Kernels.fork`, lane 1: on CUDA a side stream of its own) beside the q LoRA and an
        index layer's selection, which do not read it."""
        kv = self.k.fork(self.window_kv, x, chunk.positions, lane=1)
        qr = self.k.rms_norm(self.k.linear(x, self.wq_a), self.q_norm, self.eps)
        if self.indexer is not None:
            self.select(x, qr, chunk)
        self.k.join(1)
        source, idx = self.core(x, qr, kv, chunk)
        return self.output(qr, source, idx, chunk.positions)

    def core(self, x: torch.Tensor, qr: torch.Tensor, kv: torch.Tensor, chunk: Chunk
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """What the queries attend to: (source rows, indices)."""
        return self.attend(kv, chunk)

    def window_kv(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The rows' window kv: RoPE'd and FP8-valued over all of its channels."""
        kv = self.k.rms_norm(self.k.linear(x, self.wkv), self.kv_norm, self.eps)
        self.rope.rotate(kv, positions)
        return self.k.fp8_fake_quant(kv)

    def output(self, qr: torch.Tensor, source: torch.Tensor, idx: torch.Tensor, positions: torch.Tensor
               ) -> torch.Tensor:
        """Every head's attention of the rows (head_outputs), then FP8 `wo_b` (over the ranks' heads under
        tensor parallelism)."""
        if self.tp is not None:
            return self.tp(qr, source, idx, positions)
        o = head_outputs(self.k, self.rope, qr, source, idx, positions, self.wq_b, self.attn_sink, self.wo_a,
                         self.args.head_dim)
        return self.k.linear(o.flatten(1), self.wo_b)

    def window_ring(self, state) -> PositionRing:
        return state.ring(state.window, self.layer, self.args.window_size, (self.args.head_dim,), torch.bfloat16)

    def select(self, x: torch.Tensor, qr: torch.Tensor, chunk: Chunk) -> None:
        """An index layer's selection: write this KV source's new compressed entries, pick the chunk's
        compressed rows (chunk.topk) and publish what the attention of this and the following layers reads
        (chunk.picks). A graphed forward reads the sources' whole buffers (shapes fixed by the capacity)."""
        a = self.args
        if self.source_writer is not None:
            self.source_writer(x, chunk)
        if chunk.trace is not None:  # what the indexer scored from (training distils the indexer from it)
            n = chunk.n
            chunk.trace.setdefault("indexer_inputs", {})[self.layer] = (chunk.positions[:n], x[:n], qr[:n])
        if chunk.source(self.kv_source)[0].n == 0:
            chunk.topk = torch.full((chunk.rows, a.index_topk), -1, dtype=torch.int64, device=x.device)
        elif chunk.select is not None and chunk.select.picker is not None:
            chunk.topk = chunk.select.picker(self, x, qr, chunk)
        else:
            chunk.topk = self.indexer.select(x, qr, self.kv_source, chunk, self.rope)
        chunk.picks = self._picks(chunk)

    def attend(self, kv: torch.Tensor, chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        """What the rows attend to -- the window ring, the chunk's rows and (ratio > 0) the chunk's picks, as
        (source rows, indices) -- then the chunk's rows into the ring (the source is a copy). Fixed shapes for
        a row count, positions by device tensors: CUDA graphs capture it (model/transformer.py)."""
        slots, idx, written = self._window(chunk)
        comp = None
        if self.ratio:
            if chunk.picks is None:  # dropped with the rows of a tail-mode forward
                chunk.picks = self._picks(chunk)
            comp, idx = chunk.picks
        return window_rows(self.k, self.window_ring(chunk.state), slots, written, kv, chunk.n, comp), idx

    def _window(self, chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """window_source of the chunk, made once: alike for every layer (all rings have one capacity)."""
        if chunk.window is None:
            chunk.window = window_source(self.k, chunk.positions, chunk.n, self.args.window_size,
                                         self.window_ring(chunk.state).capacity)
        return chunk.window

    def _picks(self, chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        """(the compressed entries chunk.topk picks, as bf16 rows; the attention's indices: the window, then
        the picks as indices into those rows). A step picks fewer entries than a long context holds: only
        those are decoded, one row per pick, and a graphed forward always takes this path (its shapes must not
        follow the context). Either way the attention reads the same values in the same order: the same bits."""
        held, picks = chunk.source(self.kv_source)[0], chunk.topk
        if held.n == 0 or (picks.numel() >= held.n and not chunk.graphed):
            # the whole source, decoded once for every layer reading it
            rows = chunk.shared(("compressed entries", self.kv_source, held.n),
                                lambda: self.k.fp4_dequant_packed(held.rows, self.args.head_dim, *ENTRY))
            local = False
        else:
            packed = held.buffer if chunk.graphed else held.rows  # a graph's shapes never follow the count
            rows, local = picked_entries(self.k, packed, picks, self.args.head_dim), True
        return rows, attention_indices(self.k, self._window(chunk)[1], picks, self.args.window_size + chunk.rows,
                                       local)
