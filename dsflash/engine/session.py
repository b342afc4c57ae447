"""Engine and Session: the narrow boundary everything above the model uses (ds4.h style).

The model runs as two halves split at the first decoder layer d (20 in V4.1): the encoder (embed,
Engram, layers [0, d), and layer d's KV-cache write) and the decoder (layers [d, n), head, DSpark).
In one process both are local; with a box the encoder half runs there (dsflash/split). `Session` is
one sequence's timeline: prefill in chunks, `step` (roll back to `keep` tokens, append rows, get their
logits), DSpark drafts, snapshot/restore. Every operation is exact: a step of L rows gives the bits a
prefill of the same rows gives, and prefill runs the decoder only over the rows its final state needs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsflash.checkpoint.reader import model_identity
from dsflash.config import ModelArgs
from dsflash.engine import snapshot
from dsflash.engine.depth import DraftDepth
from dsflash.engine.halves import EncoderHalf, HandOff, LocalHalf
from dsflash.engine.images import ImageSpan, SpanKey, cache_key, span_keys, token_types
from dsflash.engine.prefix_cache import PrefixCache
from dsflash.engine.runner import Runner
from dsflash.model.attention import append_entries
from dsflash.model.load import load_model
from dsflash.model.parallel import Sharding
from dsflash.model.state import ROLLBACK_ROWS, PositionRing
from dsflash.model.tiers import RESIDENT, Tiers, sum_stats
from dsflash.model.transformer import Streams, Transformer, tail_rows
from dsflash.model.vision import TEXT
from dsflash.numerics import numerics_version

log = logging.getLogger(__name__)

DEFAULT_CHUNK = 8192
MAX_STEP_ROWS = 8


@dataclass
class Synced:
    """What `Session.sync` did."""

    logits: torch.Tensor  # fp32 [V]: the prompt's last row's
    reused: int  # prompt tokens not prefilled again: kept by the session or resumed from the prefix cache
    prefill_s: float


class ContextLengthError(ValueError):
    def __init__(self, requested: int, limit: int):
        super().__init__(f"this request needs {requested} tokens of context; the model's limit is {limit}")
        self.requested, self.limit = requested, limit


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_identity(model: Transformer) -> str:
    """The model identity both sides of a split compare and, with the numerics version (Engine.numerics),
    every snapshot and prefix-cache entry carries: the whole checkpoint's config and tensor index (either half
    loads the same files; each may compute on its own backend)."""
    return model_identity(model.args, model.ckpt)


@dataclass
class Engine:
    """The loaded model: the decoder half here, the encoder half handed in (here or on a box)."""

    decoder: Runner
    encoder: EncoderHalf
    max_context: int
    identity: str = ""
    parallel: Sharding | None = None  # the ranks the halves here are sharded over (their health)
    # adaptive DSpark depth by most drafts, kept from session to session (engine/depth.DraftDepth)
    draft_depths: dict[int, DraftDepth] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path, max_context: int | None = None,
             encoder: Callable[[Engine], EncoderHalf] | None = None, device: str = "cpu",
             reference: bool = False, cuda_graphs: bool = True, tiers: Tiers = RESIDENT,
             loaded: Callable[[int], None] | None = None,
             ranges: Sequence[tuple[range, str]] | None = None, parallel: Sharding | None = None) -> Engine:
        """The decoder half from the checkpoint at `path`, and the encoder half from it too, or from
        `encoder(engine)` when given (e.g. `dsflash.split.link.box_half`, a box over TCP). `device`/
        `reference` pick the kernel backend (dsflash.kernels); `cuda_graphs` lets short forwards replay
        captured segments (engine/graphs.py); `tiers` places Engram and the routed experts (model/tiers.py);
        `loaded(i)` is called after each layer i of either half (a progress bar); `ranges`: layer ranges over
        devices (model/transformer.py), each half taking its part. `parallel`: rank 0 of an expert or tensor
        parallel layout (engine/ranks.start_ranks), over which the halves here are sharded; their forwards run
        eagerly (the collectives are not captured in graphs)."""
        def half(name: str) -> Runner:
            return Runner(load_model(path, half=name, device=device, reference=reference, tiers=tiers,
                                     loaded=loaded, ranges=ranges, parallel=parallel),
                          cuda_graphs and parallel is None)

        decoder = half("decoder")
        engine = cls(decoder, None, max_context or decoder.args.max_seq_len, engine_identity(decoder.model), parallel)
        engine.encoder = encoder(engine) if encoder is not None else LocalHalf(half("encoder"))
        if parallel is not None:
            parallel.ready()
        return engine

    @property
    def args(self) -> ModelArgs:
        return self.decoder.args

    @property
    def numerics(self) -> str:
        """The numerics its states are computed with, which key its snapshots and prefix cache: the decoder
        half's backend version, and the encoder half's before it where that one differs (a box on another
        backend: "6.cuda1+6"). A box's version is known once it has answered (asking for it may connect)."""
        own = numerics_version(self.decoder.device)
        encoder = self.encoder.numerics
        return own if encoder == own else f"{encoder}+{own}"

    def prefix_cache(self, **kw) -> PrefixCache:
        """A prefix cache for this engine's snapshots (PrefixCache's options in `kw`), keyed by its identity and
        numerics; the numerics asked at each use, since a box's part is known only once the box has answered."""
        return PrefixCache(self.identity, lambda: self.numerics, **kw)

    def session(self) -> Session:
        return Session(self)

    def tier_stats(self) -> dict[str, dict]:
        """The off-device tiers' counters (Transformer.tier_stats) of the model halves in this process, summed
        (a box's are its own)."""
        runners = [self.decoder] + ([self.encoder.runner] if isinstance(self.encoder, LocalHalf) else [])
        return sum_stats([r.model.tier_stats() for r in runners])


class Session:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.decoder = engine.decoder
        self.encoder = engine.encoder.open()
        self.device = engine.decoder.device
        self.state = self.decoder.state()  # the decoder half's
        self.tokens: list[int] = []
        self.spans: list[SpanKey] = []  # the image spans among self.tokens (start, length, digest)
        a = engine.args
        # DSpark context inputs of recent rows, written into the drafter's rings only when a draft needs them
        width = a.dim * len(a.dspark_target_layer_ids)
        self._main_hidden = PositionRing(a.window_size + ROLLBACK_ROWS, (width,), torch.bfloat16, self.device)
        self.last_logits: torch.Tensor | None = None

    @property
    def pos(self) -> int:
        return self.state.pos

    def tail_rows(self) -> int:
        """Rows of hand-off the decoder needs at the end of a prefill: its first layer's input over the tail
        triangle (model/transformer.tail_rows)."""
        a = self.engine.args
        return tail_rows(a, a.n_layers - 1 - a.first_decoder_layer)

    def _check_ids(self, ids: list[int]) -> None:
        vocab = self.engine.args.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids outside [0, {vocab}): {bad[:5]}")
        if self.pos + len(ids) > self.engine.max_context:
            raise ContextLengthError(self.pos + len(ids), self.engine.max_context)

    def _append_entries(self, hand: HandOff) -> None:
        """Layer d's cache entries, computed by the encoder half, into the decoder half's state."""
        a = self.engine.args
        append_entries(self.state, a, a.first_decoder_layer, hand.entries.to(self.device), hand.keys.to(self.device))

    def _decode_rows(self, hand: HandOff, tail_only: bool, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        self.state.pos = hand.start
        streams, pre_mix = hand.streams.to(self.device), hand.pre_mix.to(self.device)
        out = self.decoder.forward(self.state, Streams(streams, pre_mix, image_mask), tail_only=tail_only)
        if out.main_hidden is not None:
            self._main_hidden.write(torch.arange(out.first_row, self.pos, device=self.device), out.main_hidden)
        return out.logits

    def prefill(self, ids: list[int], chunk: int = DEFAULT_CHUNK,
                progress: Callable[[int, int], None] | None = None,
                images: Sequence[ImageSpan] = ()) -> torch.Tensor:
        """Append a prompt: the encoder half in chunks, then the decoder over the tail triangle only.
        `images`: image spans (absolute positions) inside the appended tokens, whose ids carry the image
        token id. Returns the last row's logits [V]."""
        if not ids:
            raise ValueError("prefill needs at least one token")
        self._check_ids(ids)
        first = self.pos
        types = token_types(len(ids), list(images), first)
        if images and any(ids[s.start - first + k] != self.engine.args.image_token_id
                          for s in images for k in range(s.length)):
            raise ValueError("an image span's positions must carry the image token id")
        hands, done = [], 0
        for hand in self.encoder.append(ids, first, chunk, self.tail_rows(), images):
            self._append_entries(hand)
            if hand.streams.size(0):
                hands.append(hand)
            done += hand.rows
            if progress:
                progress(done, len(ids))
        self.tokens.extend(ids)
        self.spans.extend(span_keys(list(images)))
        tail = HandOff(hands[0].start, torch.cat([h.streams for h in hands]), torch.cat([h.pre_mix for h in hands]),
                       hands[0].entries[:0], hands[0].keys[:0])
        # image rows route with gate.bias_vl in the decoder layers too
        mask = None if types is None else (types[tail.start - first:] != TEXT).to(self.device)
        logits = self._decode_rows(tail, tail_only=True, image_mask=mask)
        self.last_logits = logits[-1]
        return self.last_logits

    def rollback(self, keep: int) -> None:
        a = self.engine.args
        self.encoder.rollback(keep)
        if any(start + length > keep for start, length, _ in self.spans):
            raise ValueError(f"cannot roll back to {keep}: an image span would be cut")
        self.state.truncate(keep, {s: a.compress_ratios[s] for s in self.state.compressed})
        del self.tokens[keep:]

    def step(self, keep: int, rows: list[int]) -> torch.Tensor:
        """Roll back to `keep` tokens, append 1..8 rows, return their logits [L, V]."""
        if not 1 <= len(rows) <= MAX_STEP_ROWS:
            raise ValueError(f"a step appends 1 to {MAX_STEP_ROWS} rows, got {len(rows)}")
        self.rollback(keep)
        self._check_ids(rows)
        (hand,) = self.encoder.append(rows, keep, MAX_STEP_ROWS, len(rows))
        self._append_entries(hand)
        self.tokens.extend(rows)
        logits = self._decode_rows(hand, tail_only=False)
        self.last_logits = logits[-1]
        return logits

    def draft(self, anchor: int) -> list[int]:
        """DSpark's greedy proposals for the positions after `anchor`, which is the token at position `pos`."""
        win = self.engine.args.window_size
        first = max(self.state.dspark_pos, self.pos - win)
        if first < self.pos:
            positions = torch.arange(first, self.pos, device=self.device)
            self.decoder.write_context(self.state, self._main_hidden.read(positions), first)
        return self.decoder.draft(self.state, anchor)[0][1:]

    def cache_key(self) -> list[int]:
        """The prefix-cache key of the session's tokens (image spans by content, see engine/images.py)."""
        return cache_key(self.tokens, self.spans)

    def sync(self, prompt: list[int], *, images: Sequence[ImageSpan] = (), cache: PrefixCache | None = None,
             chunk: int = DEFAULT_CHUNK, snapshot_at: int | None = None,
             progress: Callable[[int, int], None] | None = None, pass_rows: int | None = None) -> Synced:
        """Make the session hold `prompt` (ds4's sync): keep the longest prefix of it the session holds (rolled
        back when that is within reach), or resume the prefix cache's longest entry when that is longer, then
        prefill the rest in pieces on the `chunk` grid. With a cache, a snapshot is stored at each grid point,
        at `snapshot_at` (where a chat prompt's generation tail starts: the next turn, whose text differs
        there, resumes from it) and at the end. `images`: the prompt's image spans (absolute positions); a
        piece never cuts one. `progress(done, total)` counts the tokens to prefill, after each encoder pass of
        `pass_rows` (default `chunk`: smaller passes report more often, the same bits)."""
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        images = sorted(images, key=lambda s: s.start)
        key = cache_key(prompt, span_keys(images))
        kept = self._reusable(key)
        n, blob = cache.lookup(key) if cache is not None else (0, None)
        if blob is not None and n > kept:
            try:
                self._load(blob)
                kept = self.pos
            except snapshot.SnapshotError as e:  # a damaged entry costs a prefill, never the request
                log.warning("prefix cache: ignoring a %d-token entry: %s", n, e)
        if kept == 0 and self.pos:
            self._reset()
        elif kept < self.pos:
            self.rollback(kept)
        reused, logits = self.pos, self.last_logits
        t0 = time.perf_counter()
        while self.pos < len(prompt):
            end = min(self.pos + chunk - self.pos % chunk, len(prompt))
            if snapshot_at is not None and self.pos < snapshot_at < end:
                end = snapshot_at
            for s in images:  # keys inside a span are never stored, so none is ever resumed
                if s.start < end < s.start + s.length:
                    end = s.start + s.length
            piece = [s for s in images if self.pos <= s.start < end]
            report = None
            if progress:
                def report(done: int, _: int, before: int = self.pos - reused) -> None:
                    progress(before + done, len(prompt) - reused)
            logits = self.prefill(prompt[self.pos:end], chunk=pass_rows or chunk, progress=report, images=piece)
            if cache is not None and (self.pos % chunk == 0 or self.pos in (snapshot_at, len(prompt))):
                cache.put(self.cache_key(), self.snapshot())
        return Synced(logits, reused, time.perf_counter() - t0)

    def _reusable(self, key: list[int]) -> int:
        """How much of the prompt with cache key `key` the session can keep: the common prefix, not inside an
        image span, within rollback reach (else 0: start again), and short of the whole prompt unless the
        session's last logits are that prompt's."""
        have = self.cache_key()
        common = next((i for i, (x, y) in enumerate(zip(have, key, strict=False)) if x != y), min(len(have), len(key)))
        if common == len(key) and (common < self.pos or self.last_logits is None):
            common -= 1  # the last row's logits are needed again
        for start, length, _ in self.spans:
            if start < common < start + length:
                common = start
        return common if self.pos - common <= ROLLBACK_ROWS else 0

    def _reset(self) -> None:
        """An empty timeline (a prompt that shares nothing within rollback reach)."""
        self.encoder.close()
        self.encoder = self.engine.encoder.open()
        self.state.release()
        self.state = self.decoder.state()
        self.tokens, self.spans, self.last_logits = [], [], None

    def close(self) -> None:
        self.encoder.close()
        self.state.release()

    def snapshot(self) -> bytes:
        """The decoder half's state, and the encoder half's when it keeps one (a box keeps its own and is
        re-synchronised from the tokens on restore)."""
        extras = {"main_hidden": self._main_hidden.data,
                  "image_spans": torch.tensor(self.spans, dtype=torch.int64).view(-1, 3)}
        if self.last_logits is not None:
            extras["last_logits"] = self.last_logits
        states = {"decoder": self.state}
        encoder = self.encoder.saved_state()
        if encoder is not None:
            states["encoder"] = encoder
        return snapshot.encode(states, self.tokens, self.engine.identity, self.engine.numerics, extras)

    @classmethod
    def restore(cls, engine: Engine, blob: bytes) -> Session:
        s = cls(engine)
        s._load(blob)
        return s

    def _load(self, blob: bytes) -> None:
        """Take a snapshot's timeline in place of this one (nothing changes when it is refused)."""
        states, tokens, extras = snapshot.decode(blob, self.engine.identity, self.engine.numerics, self.device,
                                                 {"decoder": self.decoder.pool, "encoder": self.engine.encoder.pool})
        spans = extras.get("image_spans", torch.zeros(0, 3, dtype=torch.int64))
        encoder = self.engine.encoder.resume(tokens, states.get("encoder"), bool(spans.numel()))
        self.encoder.close()
        self.state.release()
        self.encoder, self.state, self.tokens = encoder, states["decoder"], tokens
        self._main_hidden.data.copy_(extras["main_hidden"])
        self.spans = [tuple(row) for row in spans.tolist()]
        self.last_logits = extras.get("last_logits")
