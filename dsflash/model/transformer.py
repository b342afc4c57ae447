"""DeepSeek-V4.1-Flash text model: embed -> 4 streams -> [Engram] + mHC blocks -> collapse -> head.

`Transformer.forward` processes one chunk of rows of one sequence and advances its state; any chunking
gives the same bits for a position. The model is built over a layer range so each side of the split
loads only its part: the encoder (embed, Engram, layers [0, d) and the cache write of layer d, a KV
source whose input is the hand-off) and the decoder (layers [d, n), head, DSpark), d = the first
ratio-1 layer (20 in V4.1).

A model can also span several devices in one process (`ranges`: consecutive layer ranges, a device each):
each layer's weights and its part of the state live on its range's device (`layer_devices`), the streams
(h, pre, the DSpark taps, what the layers published for the chunk) move at each range boundary, and a KV
source written in one range is copied to each later range that reads it (sources 2, 8, 14 for the encoder
layers, 20 for layers 21-39). Copies are exact, so the bits are one device's. A model over several ranges
runs eagerly (no CUDA graphs): a graph per range is left for when the step time asks for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F

from dsflash.checkpoint.reader import Checkpoint
from dsflash.config import ModelArgs
from dsflash.kernels import Kernels, load_kernels
from dsflash.model.attention import Attention, SourceWriter, source_rows
from dsflash.model.common import Chunk, Replayer, Selections, fit_rows
from dsflash.model.dspark import DSpark
from dsflash.model.engram import Engram, EngramLayout
from dsflash.model.engram_tables import Gathered, Lookup, TableStats
from dsflash.model.expert_cache import ExpertStore
from dsflash.model.mhc import Block, FfnInput, hc_pre
from dsflash.model.parallel import Sharding, expert_share
from dsflash.model.rope import Rope
from dsflash.model.state import ROLLBACK_ROWS, SequenceState
from dsflash.model.tiers import RESIDENT, Tiers, sum_stats
from dsflash.model.vision import Vision
from dsflash.model.weights import WeightLoader


@dataclass
class Tokens:
    """The first layer range's input: token ids, and for image prompts where the image spans sit."""

    ids: torch.Tensor  # int64 [n]
    # -1 text, 0 IMAGE_START, 1 IMAGE, 2 IMAGE_NEW_LINE, 3 IMAGE_END (model/vision.py); None: all text
    token_types: torch.Tensor | None = None
    image_rows: torch.Tensor | None = None  # bf16 [IMAGE rows of the chunk, dim]: aligner rows, reading order
    # the token ids of the chunk that comes next, when known and all text: Engram tables off the device start
    # gathering its rows while this chunk computes (the hashes need only the ids and the history)
    next_ids: torch.Tensor | None = None


@dataclass
class Streams:
    """A later layer range's input: the hand-off of the range below (the encoder half's last layer)."""

    h: torch.Tensor  # bf16 [n, hc, D]
    pre_mix: torch.Tensor  # fp32 [n, hc]
    image_mask: torch.Tensor | None = None  # bool [n]: image-span rows (they route with gate.bias_vl)


@dataclass
class Debug:
    """Golden checks and debugging: forced selections, and a dict to fill with intermediate outputs."""

    select: Selections | None = None
    trace: dict | None = None


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # fp32 [n, V] (None without the head)
    handoff_streams: torch.Tensor | None  # bf16 [n, hc, D]: output of the last encoder layer
    handoff_pre_mix: torch.Tensor | None  # fp32 [n, hc]
    main_hidden: torch.Tensor | None  # bf16 [n, n_taps*D]: the DSpark taps (stream means of layer inputs)
    streams: torch.Tensor  # bf16 [n, hc, D] after the last layer run
    pre_mix: torch.Tensor  # fp32 [n, hc]
    source_entries: tuple[torch.Tensor, torch.Tensor] | None = None  # next layer's (compressed KV, index keys)
    first_row: int = 0  # absolute position of row 0 of the outputs (later than the chunk start in tail mode)


@dataclass
class _Range:
    """Consecutive layers on one device, with that device's kernels and weight loader."""

    layers: range
    k: Kernels
    w: WeightLoader

    @property
    def device(self) -> torch.device:
        return self.k.device

    def on(self) -> contextlib.AbstractContextManager:
        """The range's CUDA device as the current one (kernels launch on the current device)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()


@dataclass
class HostTables:
    """What a model computes on the host when it is built: its RoPE tables and its Engram layout. A trainer
    builds a model from its masters every step, and a CUDA graph capturing that build must not copy from the
    host: it builds the later models with the first one's."""

    ropes: tuple[Rope, Rope]
    engram_layout: EngramLayout | None


class Transformer:
    def __init__(self, args: ModelArgs, ckpt: Checkpoint, token_map: list[int] | None, layers: range | None = None,
                 device: str | torch.device = "cpu", reference: bool = False, tiers: Tiers = RESIDENT,
                 loaded: Callable[[int], None] | None = None,
                 ranges: Sequence[tuple[range, str | torch.device]] | None = None, parallel: Sharding | None = None,
                 kernels: Kernels | None = None, tables: HostTables | None = None):
        """`loaded(i)`, when given, is called after layer i's weights are in place (a command's progress bar).
        `ranges`: the layers cut into consecutive ranges, each with its device (module doc); they must cover
        `layers` in order. None: all on `device`. The embedding side (embedding, vision, Engram hashing) sits
        on the first range's device (`input_device`), the head side (norm, head, DSpark, the next source's
        cache write) on the last one's (`device`, where the outputs are). `parallel`: rank 0 of an expert or
        tensor parallel layout (model/parallel.py): this process holds its shards, the other ranks theirs; each
        range runs over its stage's ranks (`Sharding.stage`: with --pp, a group of its own). `kernels`: a
        backend record of the caller's instead of the device's (the training mode's, dsflash/train/backend.py),
        its `weight` reading `ckpt`; one range only. `tables`: another model's `host_tables()` (the same
        configuration on the same devices), taken over instead of built again on the host."""
        self.args, self.ckpt, self.tiers = args, ckpt, tiers
        self.layers = layers if layers is not None else range(args.n_layers)
        spans = list(ranges) if ranges else [(self.layers, device)]
        if [i for r, _ in spans for i in r] != list(self.layers) or not all(len(r) for r, _ in spans):
            raise ValueError(f"ranges {[(r.start, r.stop) for r, _ in spans]} do not cover layers "
                             f"{self.layers.start}-{self.layers.stop - 1} in order")
        if kernels is not None and len(spans) > 1:
            raise ValueError("a caller's kernels serve one range")
        kernels = [kernels] if kernels is not None else [load_kernels(dev, reference) for _, dev in spans]
        if len({k.row_tile for k in kernels}) > 1:
            raise ValueError("layer ranges on backends with different row tiles (CPU and CUDA) in one model")
        # under a parallel layout each range runs over the ranks of its stage (rank 0's part on the range's
        # device, the stage's followers holding the rest of its layers' shards)
        stages = [parallel.stage(r) if parallel is not None else None for r, _ in spans]
        kernels = [k if st is None else st.kernels(k) for st, k in zip(stages, kernels, strict=True)]
        # routed experts on the host or disk tier: one store a layer range, its device cache on the range's
        # device (the size of --expert-cache each: the flag is per GPU), for the range's MoE layers and on the
        # last range DSpark's stages (an expert-parallel rank's store holds its range of each, and by default a
        # cache of its share)
        ep = parallel.layout.ep if parallel is not None else 1
        stores = [ExpertStore(k, ckpt, tiers, args, expert_share(args, ep)) if tiers.experts != "gpu" else None
                  for k in kernels]
        self.expert_stores = [store for store in stores if store is not None]
        self.ranges = [_Range(r, k, WeightLoader(ckpt, k, store, st))
                       for (r, _), k, store, st in zip(spans, kernels, stores, stages, strict=True)]
        first, last = self.ranges[0], self.ranges[-1]
        self.k, self.device, self.input_device = last.k, last.device, first.device
        self.layer_devices = {i: rg.device for rg in self.ranges for i in rg.layers}
        # RoPE tables are kept per device (model/rope.py): one pair serves every range
        self.ropes = tables.ropes if tables is not None else (
            Rope(args, compressed=False, kernels=self.k), Rope(args, compressed=True, kernels=self.k))
        self.embed = first.w.tensor("embed.weight")
        # the side that embeds tokens (the box in a split) owns the vision tower and the span delimiters
        self.vision = Vision(args, first.w) if args.vision_n_layers > 0 and self.layers.start == 0 else None
        self.blocks = {}
        self.engram = {}
        # the disk tier's hot-row cache, shared evenly by this half's tables
        engram_cache = tiers.engram_cache // max(1, sum(i in self.layers for i in args.engram_layer_ids))
        for rg in self.ranges:
            for i in rg.layers:
                prefix = f"layers.{i}."
                attn = Attention(args, i, rg.w, prefix + "attn.", self.ropes,
                                 writes_source=i != self.layers.start or i == 0)
                self.blocks[i] = Block(args, i, rg.w, prefix, attn)
                if i in args.engram_layer_ids:
                    self.engram[i] = Engram(args, rg.w, prefix + "engram.", tiers.engram, engram_cache)
                if loaded is not None:
                    loaded(i)
        w = last.w
        # tables off the device: their rows are fetched on the host, so a replayed forward hashes and gathers
        # before its graph (`_replay`), and a prefill fetches the next chunk's rows ahead
        self.engram_staged = any(not e.table.resident for e in self.engram.values())
        self.engram_layout = None
        if self.engram and tables is not None:
            self.engram_layout = tables.engram_layout
        elif self.engram:
            assert token_map is not None, "Engram layers need the compressed token map"
            self.engram_layout = EngramLayout.build(args, token_map, self.input_device)
        # the encoder side writes the cache of the KV source that starts the next range
        self.next_source = None
        nxt = self.layers.stop
        if nxt < args.n_layers and nxt in args.kv_source_layers:
            self.next_source = SourceWriter(args, nxt, w, f"layers.{nxt}.attn.", self.ropes[1])
            self.next_attn_norm = w.tensor(f"layers.{nxt}.attn_norm.weight")
        self.has_head = self.layers.stop == args.n_layers
        self.norm = w.tensor("norm.weight") if self.has_head else None
        self.head = w.linear("head", widen=True) if self.has_head else None  # fp32 logits
        self.dspark = None
        if self.has_head and args.n_mtp_layers and args.dspark_block_size:
            # DSpark embeds its drafts on the head's device: a second copy when the first range is elsewhere
            embed = self.embed if self.input_device == self.device else w.tensor("embed.weight")
            self.dspark = DSpark(args, w, self.ropes, embed, self.head)
        # per range: the KV sources its layers read that another range writes (copied in at its entry)
        self._reads = [{src for i in rg.layers if (src := self.blocks[i].attn.kv_source) is not None
                        and src not in rg.layers} for rg in self.ranges]
        # each layer's state on its range's device; the writer of the next range's source (the box's layer d
        # cache write) and DSpark on the last
        self._state_devices = dict(self.layer_devices)
        if self.next_source is not None:
            self._state_devices[nxt] = self.device

    def tier_stats(self) -> dict[str, dict]:
        """What the off-device tiers did so far, by family: "experts" (model/expert_cache.ExpertStats, with its
        hit rate; summed over the layer ranges' stores) and "engram" (model/engram_tables.TableStats summed over
        the tables); a family whose weights are resident is left out."""
        stats = sum_stats([{"experts": store.stats.as_dict()} for store in self.expert_stores])
        if self.engram_staged:
            total = TableStats()
            for e in self.engram.values():
                total.add(e.table.stats)
            stats["engram"] = asdict(total)
        return stats

    def on_head(self) -> contextlib.AbstractContextManager:
        """The head side's device as the current CUDA device (DSpark's kernels launch there)."""
        return self.ranges[-1].on()

    def place(self, state: SequenceState) -> SequenceState:
        """`state` with this model's devices (SequenceState.place): what a snapshot decoded onto one device, or
        the hand-off's entries appended before the first forward, moves to its layer's device."""
        state.place(self.device, self._state_devices, self.input_device)
        return state

    @property
    def rope_epoch(self) -> tuple[int, ...]:
        """Changes whenever a RoPE table is rebuilt (CUDA graphs read the tables by address)."""
        return tuple(r.rebuilds for r in self.ropes)

    def host_tables(self) -> HostTables:
        return HostTables(self.ropes, self.engram_layout)

    def forward(self, state: SequenceState, x: Tokens | Streams | torch.Tensor, *, tail_only: bool = False,
                debug: Debug | None = None, graphs: Replayer | None = None) -> ForwardOutput:
        """Run the chunk's rows at positions state.pos .. state.pos+n-1 through this model's layers.

        The first layer range (starting at 0) takes `Tokens` (a bare tensor: token ids, all text); a later
        range takes the `Streams` of those rows. Rows are padded to a multiple of the backend's row tile.

        Images (`Tokens.token_types`): on the first range the image-span rows' inputs are replaced
        (delimiters by the learned vectors, IMAGE rows by `image_rows`, see model/vision.py). Span rows
        (type >= 0) are the image mask: they route with gate.bias_vl and are Engram's dead positions; a
        later range gets the routing mask alone (`Streams.image_mask`). Padding rows are text rows.

        debug.trace (a dict) also gets "input_embeds" (the merged input rows) and "engram_hash_ids" (the
        Engram table rows per position) on the first range, and each layer's output.

        tail_only (encoder-only prefill of the decoder): compute each layer only for the rows the final
        state, or the state after any rollback it allows, needs: a triangle ending at the last row
        (`tail_rows`). Rows are dropped at a layer's entry once no later layer needs them; a kept row's
        arithmetic is that of a full prefill, so the state is bit-identical.

        graphs: the engine's CUDA-graph store (engine/graphs.py); a short forward then runs its layers as
        one replayed segment when it can (`_replay`), with the eager forward's bits.
        """
        a = self.args
        if isinstance(x, torch.Tensor):
            x = Tokens(x)
        debug = debug or Debug()
        n = x.ids.numel() if isinstance(x, Tokens) else x.h.size(0)
        rows = n + (-n % self.k.row_tile)
        self.place(state)
        positions = torch.arange(state.pos, state.pos + rows, device=self.input_device)
        for rope in self.ropes:  # tail mode re-pads its shrinking row set: at most a tile past the last row
            for rg in self.ranges:
                rope.reserve(state.pos + n + self.k.row_tile, rg.device)
        image_mask = self._image_mask(x, n)
        mask = None if image_mask is None else torch.cat([image_mask, image_mask.new_zeros(rows - n)])
        chunk = Chunk(state, positions, n, debug.select, mask, trace=debug.trace, row_tile=self.k.row_tile,
                      _p0=state.pos)
        f = _Pass(chunk, n=n, end=state.pos + n, mask=mask, trace=debug.trace, tail_only=tail_only)
        dev = self.input_device
        if isinstance(x, Tokens):
            f.ids, f.token_types, f.image_rows, f.next_ids = x.ids.to(dev), x.token_types, x.image_rows, x.next_ids
        else:
            f.h, f.pre = fit_rows(x.h.to(dev), rows), fit_rows(x.pre_mix.to(dev), rows)
        eligible = (debug.trace is None and debug.select is None and mask is None and not tail_only
                    and len(self.ranges) == 1)
        replayed = graphs is not None and graphs.begin(rows, self.rope_epoch, eligible) and self._replay(f, graphs)
        if not replayed:
            self._layers(f)
        h, pre, end = f.h, f.pre, f.end
        handoff = f.handoff
        if replayed:  # a graph's outputs are overwritten by its next replay
            h, pre = h.clone(), pre.clone()
            handoff = handoff and (handoff[0].clone(), handoff[1].clone())
        taps, chunk, n = f.taps, f.chunk, f.n
        state.pos = end
        logits = entries = None
        with self.on_head():
            if self.has_head:
                y = self.k.rms_norm(hc_pre(self.k, h, pre), self.norm, a.norm_eps)
                logits = self.k.linear(y.float(), self.head)[:n]
            if self.next_source is not None:
                y = self.k.rms_norm(hc_pre(self.k, h, pre), self.next_attn_norm, a.norm_eps)
                entries = self.next_source.entries(y, chunk)
        main_hidden = torch.cat(taps, dim=-1)[:n] if taps else None
        return ForwardOutput(logits, *(handoff or (None, None)), main_hidden, h[:n], pre[:n], entries,
                             chunk.p0)

    def _image_mask(self, x: Tokens | Streams, n: int) -> torch.Tensor | None:
        """The image-span rows of the input (bool [n]), checked against the input's other fields."""
        if isinstance(x, Tokens) != (self.layers.start == 0):
            raise ValueError("the first layer range takes Tokens, a later one the Streams of the range below")
        if isinstance(x, Streams):
            return None if x.image_mask is None else x.image_mask.to(self.input_device)
        if x.token_types is None:
            if x.image_rows is not None:
                raise ValueError("image_rows need token_types")
            return None
        if x.token_types.numel() != n:
            raise ValueError(f"token_types has {x.token_types.numel()} entries for {n} rows")
        return x.token_types.to(self.input_device) >= 0

    def _embed(self, f: _Pass) -> None:
        """The first range's input rows: the tokens' embeddings (image spans merged) as `hc_mult` streams,
        and the Engram hashes (committing the chunk's compressed ids to the state)."""
        a, chunk, n = self.args, f.chunk, f.n
        ids = fit_rows(f.ids, chunk.rows)
        x = F.embedding(ids, self.embed)
        if f.token_types is not None and bool(chunk.image_mask.any()):
            if self.vision is None:
                raise ValueError("image spans in the input, but the model has no vision tower")
            x = torch.cat([self.vision.merge(x[:n], f.token_types.to(self.input_device), f.image_rows), x[n:]])
        elif f.image_rows is not None and f.image_rows.size(0):
            raise ValueError(f"{f.image_rows.size(0)} image rows given, but the chunk has no IMAGE positions")
        f.h = x.unsqueeze(1).repeat(1, a.hc_mult, 1)
        f.pre = torch.zeros(chunk.rows, a.hc_mult, device=self.input_device)
        f.pre[:, 0] = 1.0
        if self.engram and f.lookups is None:  # (a graph of staged tables is handed its rows)
            self._engram_lookups(f, ids)
        if f.trace is not None:
            f.trace["input_embeds"] = x[:n]
            if f.hashes is not None:
                f.trace["engram_hash_ids"] = f.hashes[:n]

    def _engram_lookups(self, f: _Pass, ids: torch.Tensor) -> None:
        """Hash the chunk (committing its compressed ids) and request every Engram layer's rows; for staged
        tables also the next chunk's, hashed from the history just committed."""
        a, layout = self.args, self.engram_layout
        f.hashes = layout.hash_ids(f.chunk, ids, a.engram_max_ngram_size)
        # each table gathers on its layer's device
        f.lookups = {i: e.table.request(f.hashes[:, a.engram_layer_ids.index(i)].to(self.layer_devices[i]))
                     for i, e in self.engram.items()}
        if f.next_ids is None or not self.engram_staged:
            return
        n = f.next_ids.numel()
        rows = n + (-n % self.k.row_tile)
        start = f.chunk.p0 + f.chunk.n
        nxt = Chunk(f.chunk.state, torch.arange(start, start + rows, device=self.input_device), n,
                    row_tile=self.k.row_tile, _p0=start)
        hashes = layout.hash_ids(nxt, fit_rows(f.next_ids.to(self.input_device), rows), a.engram_max_ngram_size,
                                 commit=False)
        for i, e in self.engram.items():
            e.table.prefetch(hashes[:, a.engram_layer_ids.index(i)].to(self.layer_devices[i]))

    def _layers(self, f: _Pass, halt: bool = False) -> None:
        """The first range's embedding, then the layers over the pass, range by range (each on its device,
        `_cross` at a boundary): Engram before a block, the DSpark taps of its input, the block (mHC around
        attention and MoE).

        A forward replayed in segments (`_replay` with the routed experts in the expert store; one range) runs
        a segment at a time: `halt` stops after the next layer's routing (f.halted, with its expert ids in
        f.route_ids), and a pass that holds a halted layer first finishes it from the slots its experts were
        loaded into (f.slots)."""
        a = self.args
        start = self.layers.start
        for r, rg in enumerate(self.ranges):
            with rg.on():
                if f.halted is not None:
                    i, ffn_in, weights = f.halted
                    block = self.blocks[i]
                    f.h, f.pre = block.finish(block.ffn.from_slots(ffn_in.x, weights, f.slots), ffn_in)
                    f.halted = f.slots = None
                    self._block_done(f, i)
                    start = i + 1
                elif r:
                    self._cross(f, r)
                elif f.h is None:
                    self._embed(f)
                for i in rg.layers:
                    if i < start:
                        continue
                    block = self.blocks[i]
                    if f.tail_only:
                        keep_from = f.end - tail_rows(a, self.layers.stop - 1 - i)
                        drop = keep_from - f.chunk.p0
                        if drop > 0:
                            f.chunk = f.chunk.drop_front(drop)
                            rows = f.chunk.rows
                            f.h, f.pre = fit_rows(f.h[drop:], rows), fit_rows(f.pre[drop:], rows)
                            f.taps = [fit_rows(t[drop:], rows) for t in f.taps]
                            f.n -= drop
                    if i in self.engram:
                        f.h = self.engram[i](f.h, f.lookups[i].wait(), f.mask)
                    if i in a.dspark_target_layer_ids:
                        f.taps.append(self.k.stream_mean(f.h))
                    if halt:
                        ffn_in = block.attend(f.h, f.pre, f.chunk, joined=True)
                        weights, f.route_ids = block.ffn.route(ffn_in.x, f.chunk)
                        f.halted = (i, ffn_in, weights)
                        return
                    f.h, f.pre = block.forward(f.h, f.pre, f.chunk)
                    self._block_done(f, i)

    def _block_done(self, f: _Pass, i: int) -> None:
        if f.trace is not None:
            f.trace.setdefault("layer_out", {})[i] = (f.h[:f.n], f.pre[:f.n])
        if i == self.args.first_decoder_layer - 1:
            f.handoff = (f.h[:f.n], f.pre[:f.n])

    def _cross(self, f: _Pass, r: int) -> None:
        """Into range r: the streams, the DSpark taps so far and the routing mask onto its device, the chunk
        with the KV sources its layers read from earlier ranges (Chunk.moved)."""
        dev = self.ranges[r].device
        f.h, f.pre = f.h.to(dev), f.pre.to(dev)
        f.taps = [t.to(dev) for t in f.taps]
        f.mask = None if f.mask is None else f.mask.to(dev)
        f.chunk = f.chunk.moved(dev, self._reads[r])

    def _replay(self, f: _Pass, graphs: Replayer) -> bool:
        """`_layers(f)` as one CUDA graph, when every KV source the layers read holds an entry and the Engram
        hashes have a whole n-gram behind the chunk (else False: run them eagerly). The graph's inputs: the
        chunk's positions and its token ids (the first range) or streams, and for Engram tables off the device
        the rows each table gathered (hashed and fetched here, before the graph, padded to one row per id: a
        fixed shape); its outputs: the streams, the hand-off, the DSpark taps. It reads and writes the
        session's state in place -- window rings, the compressors' rings, the sources' and (hashing inside)
        the Engram ids' whole buffers (model/attention.py) -- so its key names them by address; their row
        counts are set here, outside the graph.

        With the routed experts in the expert store (host or disk tier) the forward is one graph per layer
        (`_segment`): each stops after its layer's routing, the host reads the expert ids and loads those
        experts into the store's device slots (`ExpertStore.slots_for`), and the next graph runs them from
        the slots and goes on to the next layer's routing. Each layer's arithmetic is the eager forward's, so
        are the bits; a forward whose picks could exceed the cache runs eagerly."""
        chunk, a, state = f.chunk, self.args, f.chunk.state
        # routed experts from the expert store: one segment per layer, each stopping after its routing, which
        # the host reads to load the layer's experts into the store's slots before the next segment runs
        store = self.ranges[0].w.experts  # (a replayed forward runs one range)
        halts = [] if store is None else list(self.layers)
        if store is not None and not store.holds(min(chunk.rows * a.n_activated_experts, a.n_routed_experts)):
            return False
        held, counts, phases = [], {}, []
        for i in self.layers:
            attn = self.blocks[i].attn
            held.append(attn.window_ring(state).data)
            writer = attn.source_writer
            if writer is not None:
                counts[i] = (chunk.p0 + f.n) // writer.ratio
                phases.append(chunk.p0 % writer.ratio)
                if writer.ratio > 1:
                    held.append(writer.compressor.raw_ring(state).data)
            if attn.kv_source is not None and attn.kv_source not in counts:
                source = state.compressed.get(attn.kv_source)
                counts[attn.kv_source] = source.n if source is not None else 0
        hashes_in_graph = f.h is None and self.engram and not self.engram_staged
        if not all(counts.values()) or (hashes_in_graph and chunk.p0 < a.engram_max_ngram_size):
            return False
        growing = [(rows, count) for src, count in counts.items() for rows in source_rows(state, a, src)]
        if hashes_in_graph:
            growing.append((state.engram_ids, chunk.p0 + f.n))
        for rows, count in growing:
            rows.reserve(count)
            held.append(rows.buffer)
        staged = []  # per Engram layer: its gathered rows, scales (as bytes) and ids into them
        if f.h is None and self.engram_staged:
            self._engram_lookups(f, fit_rows(f.ids, chunk.rows))
            for lookup in f.lookups.values():
                g = lookup.wait()
                staged += [fit_zeros(g.table.view(torch.uint8), g.ids.numel()),
                           fit_zeros(g.scale.view(torch.uint8), g.ids.numel()), g.ids]
        chunk.graphed = True
        key = ("layers", f.n, tuple(phases), tuple((t.data_ptr(), t.size(0)) for t in held))
        inputs = [f.ids] if f.h is None else [f.h, f.pre]
        carried = []
        for k in range(len(halts) + 1):
            out = graphs.run((*key, k), self._segment(f, chunk, halts, k, len(staged)), chunk.positions,
                             *inputs, *staged, *carried)
            if k == len(halts):
                break
            # the routing of layer halts[k], read on the host: its experts loaded into the store's slots
            inputs = [*out[:6], store.slots_for(halts[k], out[6])]
            carried = out[7:]
        for rows, count in growing:
            rows.n = count
        f.h, f.pre = out[:2]
        f.handoff = (out[2], out[3]) if out[2].numel() else None
        f.taps = list(out[7:])
        return True

    def _segment(self, f: _Pass, chunk: Chunk, halts: list[int], k: int, n_staged: int
                 ) -> Callable[..., tuple[torch.Tensor, ...]]:
        """Segment k of a replayed forward (`_replay`) as a function of tensors. Its inputs: the positions; the
        first segment's token ids (the first range) or streams, a later one's halted layer (its FFN input,
        routing weights and slots); the staged Engram rows (3 per table); then what a later segment carries:
        the hand-off, the published index picks and candidate blocks, the Engram hashes (an empty tensor
        for each one not made yet), and the DSpark taps so far. Its outputs: the halted layer (FFN input,
        weights, expert ids) or, for the last, the streams; then the carried values."""
        a = self.args
        resume = halts[k - 1] if k else None
        halt = k < len(halts)

        def fn(positions: torch.Tensor, *t: torch.Tensor) -> tuple[torch.Tensor, ...]:
            # a chunk of its own: nothing this graph makes is shared with another graph's memory
            local = replace(chunk, positions=positions, _shared={})
            p = _Pass(local, n=f.n)
            t = list(t)
            if resume is not None:
                p.halted, p.slots = (resume, FfnInput(*t[:5]), t[5]), t[6]
                del t[:7]
            elif f.h is None:
                p.ids = t.pop(0)
            else:
                p.h, p.pre = t.pop(0), t.pop(0)
            rows, t = t[:n_staged], t[n_staged:]
            if rows:
                p.lookups = {i: Lookup(Gathered(rows[3 * j].view(torch.float8_e4m3fn),
                                                rows[3 * j + 1].view(torch.float8_e8m0fnu), rows[3 * j + 2]))
                             for j, i in enumerate(self.engram)}
            if resume is not None:
                hand_h, hand_pre, local.topk, local.candidates, p.hashes = (x if x.numel() else None for x in t[:5])
                p.handoff = None if hand_h is None else (hand_h, hand_pre)
                p.taps = t[5:]
                if p.hashes is not None:  # resident tables: the lookups from the hashes the first segment made
                    p.lookups = {i: e.table.request(p.hashes[:, a.engram_layer_ids.index(i)])
                                 for i, e in self.engram.items()}
            self._layers(p, halt)
            core = (*p.halted[1], p.halted[2], p.route_ids) if halt else (p.h, p.pre)
            empty = positions.new_empty(0)
            kept = (*(p.handoff or (None, None)), p.chunk.topk, p.chunk.candidates, p.hashes)
            return *core, *(empty if x is None else x for x in kept), *p.taps

        return fn


def tail_rows(args: ModelArgs, layers_above: int) -> int:
    """The rows of input a layer `layers_above` layers below the last one needs at the end of a tail-only
    prefill. A rollback of up to ROLLBACK_ROWS rows must leave the state a full prefill would, since the rows
    stepped again attend over the window before them and a draft reads the DSpark taps of the `window` rows
    before its anchor: so the last layer needs its input on the last `window + ROLLBACK_ROWS` rows (its window
    KV and the taps), and each layer below `window - 1` more rows to attend over."""
    return args.window_size + ROLLBACK_ROWS + layers_above * (args.window_size - 1)


def fit_zeros(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t [k, ...] padded with zero rows to `rows` rows (a fixed shape for a graph's static copy)."""
    return torch.cat([t, t.new_zeros(rows - t.size(0), *t.shape[1:])])


@dataclass
class _Pass:
    """What one forward carries from layer to layer (Transformer._layers)."""
    chunk: Chunk
    n: int  # real rows
    end: int = 0  # position after the chunk's last real row
    ids: torch.Tensor | None = None  # the first range's token ids [n] (embedded by _embed)
    token_types: torch.Tensor | None = None
    image_rows: torch.Tensor | None = None
    h: torch.Tensor | None = None  # bf16 [rows, hc, D] streams
    pre: torch.Tensor | None = None  # fp32 [rows, hc]
    next_ids: torch.Tensor | None = None  # the next chunk's token ids (Tokens.next_ids)
    hashes: torch.Tensor | None = None  # Engram table rows (the first range)
    lookups: dict[int, Lookup] | None = None  # per Engram layer: its rows' lookup, requested at the embedding
    taps: list[torch.Tensor] = field(default_factory=list)  # DSpark taps so far
    handoff: tuple[torch.Tensor, torch.Tensor] | None = None
    mask: torch.Tensor | None = None
    trace: dict | None = None
    tail_only: bool = False
    # a forward replayed in segments (Transformer._layers): the layer stopped after its routing (its index, its
    # FFN input, its routing weights), that routing's expert ids, and the ids remapped to the store's slots
    halted: tuple[int, FfnInput, torch.Tensor] | None = None
    route_ids: torch.Tensor | None = None
    slots: torch.Tensor | None = None
