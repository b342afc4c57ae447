"""Engine and Session: the narrow boundary everything above the model uses (ds4.h style).

The model runs as two halves split at the first decoder layer d (20 in V4.1): the encoder (embed,
Engram, layers [0, d), and layer d's KV-cache write) and the decoder (layers [d, n), head, DSpark).
In one process both are local; with a box the encoder half runs there (dsflash/split). `Session` is
one sequence's timeline: prefill in chunks, `step` (roll back to `keep` tokens, append rows, get their
logits), DSpark drafts, snapshot/restore. Every operation is exact: a step of L rows gives the bits a
prefill of the same rows gives, and prefill runs the decoder only over the rows its final state needs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from dsflash.checkpoint.reader import model_identity
from dsflash.engine import snapshot
from dsflash.engine.images import ImageSpan, SpanKey, cache_key, span_keys, token_types
from dsflash.engine.state import ROLLBACK_ROWS, PositionRing, SequenceState
from dsflash.model.attention import append_entries
from dsflash.model.dspark import argmax_sampler
from dsflash.model.load import load_model
from dsflash.model.transformer import Transformer
from dsflash.model.vision import IMAGE, IMAGE_START, TEXT
from dsflash.numerics import NUMERICS_VERSION

DEFAULT_CHUNK = 8192
MAX_STEP_ROWS = 8


class ContextLengthError(ValueError):
    def __init__(self, requested: int, limit: int):
        super().__init__(f"this request needs {requested} tokens of context, the model's limit is {limit}")
        self.requested, self.limit = requested, limit


@dataclass
class HandOff:
    """What the encoder half gives the decoder half for rows [start, start+n)."""

    start: int
    streams: torch.Tensor  # bf16 [n, hc, D]: layer d-1's output
    pre_mix: torch.Tensor  # fp32 [n, hc]
    entries: torch.Tensor  # uint8: layer d's new compressed KV entries, packed (numerics/packing.py)
    keys: torch.Tensor  # uint8: layer d's new index keys, packed
    rows: int = 0  # tokens this chunk appended


class EncoderSession(Protocol):
    """One sequence on the encoder half: local (LocalEncoder) or on a box (dsflash.split.link)."""

    pos: int

    def append(self, ids: list[int], keep: int, chunk: int, tail: int, images: Sequence[ImageSpan] = ()
               ) -> Iterator[HandOff]:
        """Roll back to `keep` tokens, append `ids` in chunks; per chunk, its new cache entries and the
        hand-off of those of its rows that are among the last `tail` rows of the append. `images`:
        spans inside the appended positions."""

    def rollback(self, keep: int) -> None: ...

    def close(self) -> None: ...


class LocalEncoder:
    def __init__(self, model: Transformer, state: SequenceState | None = None):
        self.model = model
        self.state = state or SequenceState(device=model.device)

    @property
    def pos(self) -> int:
        return self.state.pos

    def append(self, ids: list[int], keep: int, chunk: int, tail: int, images: Sequence[ImageSpan] = ()
               ) -> Iterator[HandOff]:
        self.rollback(keep)
        tail_from = keep + len(ids) - tail
        types = token_types(len(ids), list(images), keep)
        rows = None
        if images:
            if self.model.vision is None:
                raise ValueError("this model has no vision tower: it takes no images")
            dev = self.model.device
            rows = torch.cat([self.model.vision.encode(s.image.pixels.to(dev), s.image.n_vit_h, s.image.n_vit_w)[1]
                              for s in sorted(images, key=lambda s: s.start)])
        i = 0
        while i < len(ids):
            end = min(i + chunk, len(ids))
            # a chunk ends outside image spans, so an interrupted append never stops inside one
            while types is not None and end < len(ids) and types[end] != TEXT and types[end] != IMAGE_START:
                end += 1
            start = self.pos
            kwargs = {}
            if types is not None and bool((types[i:end] != TEXT).any()):
                # the chunk's IMAGE positions take the next aligner rows, in reading order
                done = int((types[:i] == IMAGE).sum())
                here = int((types[i:end] == IMAGE).sum())
                kwargs = {"token_types": types[i:end], "image_rows": rows[done:done + here]}
            out = self.model.forward(self.state, torch.tensor(ids[i:end], dtype=torch.int64,
                                                              device=self.model.device), **kwargs)
            skip = min(max(tail_from - start, 0), out.streams.size(0))
            yield HandOff(start + skip, out.streams[skip:], out.pre_mix[skip:], *out.source_entries, end - i)
            i = end

    def rollback(self, keep: int) -> None:
        a = self.model.args
        self.state.truncate(keep, {s: a.compress_ratios[s] for s in self.state.compressed})

    def close(self) -> None:
        pass


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_identity(model: Transformer) -> str:
    """The model identity both sides of a split compare: the whole checkpoint's config and tensor index
    (either half loads the same files) and the numerics version."""
    return f"{model_identity(model.args, model.ckpt)}-n{NUMERICS_VERSION}"


@dataclass
class Engine:
    decoder: Transformer
    encoder: Transformer | None  # None when the encoder half runs on a box
    max_context: int
    identity: str = ""
    open_encoder: Callable[[], EncoderSession] | None = field(default=None, repr=False)

    @classmethod
    def load(cls, path: str | Path, max_context: int | None = None, box: str | None = None,
             box_token: str | None = None, box_deadline: float = 60.0, device: str = "cpu",
             reference: bool = False, cuda_graphs: bool = True) -> Engine:
        """Both halves from one checkpoint, or with `box` (HOST:PORT) the decoder half here and the
        encoder half on that box. `device`/`reference` pick the kernel backend (dsflash.kernels);
        `cuda_graphs` lets short forwards replay captured segments (model/graphs.py)."""
        decoder = load_model(path, half="decoder", device=device, reference=reference, cuda_graphs=cuda_graphs)
        encoder = None if box else load_model(path, half="encoder", device=device, reference=reference,
                                              cuda_graphs=cuda_graphs)
        engine = cls(decoder, encoder, max_context or decoder.args.max_seq_len, engine_identity(decoder))
        if encoder is not None:
            engine.open_encoder = lambda: LocalEncoder(encoder)
        else:
            from dsflash.split.link import BoxLink, RemoteEncoder

            engine.link = BoxLink(box, engine.identity, box_token, box_deadline)
            engine.open_encoder = lambda: RemoteEncoder(engine.link, decoder.args)
        return engine

    @property
    def args(self):
        return self.decoder.args

    def session(self) -> Session:
        return Session(self)


class Session:
    def __init__(self, engine: Engine, encoder: EncoderSession | None = None):
        self.engine = engine
        self.decoder = engine.decoder
        self.encoder = encoder or engine.open_encoder()
        self.device = engine.decoder.device
        self.state = SequenceState(device=self.device)  # the decoder half's
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
        """Rows of hand-off the decoder needs at the end of a prefill: the window of the last layer plus
        window-1 more per decoder layer below it."""
        a = self.engine.args
        layers = a.n_layers - a.first_decoder_layer
        return a.window_size + (layers - 1) * (a.window_size - 1)

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
        out = self.decoder.forward(self.state, streams=streams, pre_mix=pre_mix, tail_only=tail_only,
                                   image_mask=image_mask)
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

    def draft(self, anchor: int, sampler: Callable[[torch.Tensor], int] = argmax_sampler) -> list[int]:
        """DSpark proposals for the positions after `anchor`, which is the token at position `pos`."""
        dspark = self.decoder.dspark
        win = self.engine.args.window_size
        first = max(self.state.dspark_pos, self.pos - win)
        if first < self.pos:
            positions = torch.arange(first, self.pos, device=self.device)
            dspark.write_context(self.state, self._main_hidden.read(positions), positions)
        return dspark.draft(self.state, anchor, sampler)[0][1:]

    def cache_key(self) -> list[int]:
        """The prefix-cache key of the session's tokens (image spans by content, see engine/images.py)."""
        return cache_key(self.tokens, self.spans)

    def close(self) -> None:
        self.encoder.close()

    def snapshot(self) -> bytes:
        """The decoder half's state, and the encoder half's when it is local (a box keeps its own and is
        re-synchronised from the tokens on restore)."""
        extras = {"main_hidden": self._main_hidden.data,
                  "image_spans": torch.tensor(self.spans, dtype=torch.int64).view(-1, 3)}
        if self.last_logits is not None:
            extras["last_logits"] = self.last_logits
        states = {"decoder": self.state}
        if isinstance(self.encoder, LocalEncoder):
            states["encoder"] = self.encoder.state
        return snapshot.encode(states, self.tokens, self.engine.identity, extras)

    @classmethod
    def restore(cls, engine: Engine, blob: bytes) -> Session:
        states, tokens, extras = snapshot.decode(blob, engine.identity, engine.decoder.device)
        if engine.encoder is not None:
            if "encoder" not in states:
                raise snapshot.SnapshotError("snapshot holds no encoder state (made with a box)")
            s = cls(engine, LocalEncoder(engine.encoder, states["encoder"]))
        else:
            if extras.get("image_spans") is not None and extras["image_spans"].numel():
                # the box would need the images' pixels to rebuild its side; a snapshot holds only their digests
                raise snapshot.SnapshotError("a session with images cannot be resumed through a box")
            s = cls(engine)
            s.encoder.restore(tokens)
        s.state, s.tokens = states["decoder"], tokens
        s._main_hidden.data.copy_(extras["main_hidden"])
        s.spans = [tuple(row) for row in extras.get("image_spans", torch.zeros(0, 3, dtype=torch.int64)).tolist()]
        s.last_logits = extras.get("last_logits")
        return s
