"""The encoder half as the engine sees it: the embedding, Engram, layers [0, d) and layer d's cache write
(d = the first decoder layer, 20 in V4.1), in this process or on a box.

The engine is handed an `EncoderHalf` and never learns where it runs: `LocalHalf` runs a Transformer here;
`dsflash.split.link.BoxHalf` (above the engine) talks to a box over TCP. Each session opens an
`EncoderSession` on it, whose `append` yields a `HandOff` per chunk.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from dsflash.engine.images import ImageSpan, token_types
from dsflash.engine.runner import Runner
from dsflash.engine.snapshot import SnapshotError
from dsflash.model.state import SequenceState, StatePool
from dsflash.model.transformer import Tokens
from dsflash.model.vision import IMAGE, IMAGE_START, TEXT
from dsflash.numerics import numerics_version


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
    """One sequence on the encoder half."""

    pos: int

    def append(self, ids: list[int], keep: int, chunk: int, tail: int, images: Sequence[ImageSpan] = ()
               ) -> Iterator[HandOff]:
        """Roll back to `keep` tokens, append `ids` in chunks; per chunk, its new cache entries and the
        hand-off of those of its rows that are among the last `tail` rows of the append. `images`:
        spans inside the appended positions."""

    def rollback(self, keep: int) -> None: ...

    def saved_state(self) -> SequenceState | None:
        """The state a snapshot keeps (None: the half rebuilds its side from the tokens on resume)."""

    def close(self) -> None: ...


class EncoderHalf(Protocol):
    """Where the encoder half runs; opens its sessions."""

    reconnects: int | None  # link reconnections so far (None: in this process, no link)
    pool: StatePool | None  # where a snapshot's encoder state takes its buffers (None: elsewhere or fresh)
    numerics: str  # the numerics version of the backend it computes on (numerics.numerics_version)

    def open(self) -> EncoderSession: ...

    def resume(self, tokens: list[int], state: SequenceState | None, has_images: bool) -> EncoderSession:
        """A session holding `tokens` again, from a snapshot's encoder `state` (None when it kept none)."""


class LocalEncoder:
    """An EncoderSession over the encoder layers, in this process."""

    def __init__(self, runner: Runner, state: SequenceState | None = None):
        self.runner = runner
        self.state = state or runner.state()

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
            vision, dev = self.runner.model.vision, self.runner.model.input_device
            if vision is None:
                raise ValueError("this model has no vision tower: it takes no images")
            rows = torch.cat([vision.encode(s.image.pixels.to(dev), s.image.n_vit_h, s.image.n_vit_w)[1]
                              for s in sorted(images, key=lambda s: s.start)])
        bounds = [0]
        while bounds[-1] < len(ids):
            end = min(bounds[-1] + chunk, len(ids))
            # a chunk ends outside image spans, so an interrupted append never stops inside one
            while types is not None and end < len(ids) and types[end] != TEXT and types[end] != IMAGE_START:
                end += 1
            bounds.append(end)

        def has_image(i: int, end: int) -> bool:
            return types is not None and bool((types[i:end] != TEXT).any())

        for i, end, after in zip(bounds[:-1], bounds[1:], [*bounds[2:], None], strict=True):
            start = self.pos
            kwargs = {}
            if has_image(i, end):
                # the chunk's IMAGE positions take the next aligner rows, in reading order
                done = int((types[:i] == IMAGE).sum())
                here = int((types[i:end] == IMAGE).sum())
                kwargs = {"token_types": types[i:end], "image_rows": rows[done:done + here]}
            if after is not None and not has_image(end, after):  # Engram off the device reads its rows ahead
                kwargs["next_ids"] = torch.tensor(ids[end:after], dtype=torch.int64)
            piece = torch.tensor(ids[i:end], dtype=torch.int64, device=self.runner.device)
            out = self.runner.forward(self.state, Tokens(piece, **kwargs))
            skip = min(max(tail_from - start, 0), out.streams.size(0))
            yield HandOff(start + skip, out.streams[skip:], out.pre_mix[skip:], *out.source_entries, end - i)

    def rollback(self, keep: int) -> None:
        self.state.truncate(keep, self.runner.args.compress_ratios)

    def saved_state(self) -> SequenceState:
        return self.state

    def close(self) -> None:
        self.state.release()


class LocalHalf:
    """The encoder half in this process."""

    reconnects = None

    def __init__(self, runner: Runner):
        self.runner = runner
        self.pool = runner.pool
        self.numerics = numerics_version(runner.device)

    def open(self) -> LocalEncoder:
        return LocalEncoder(self.runner)

    def resume(self, tokens: list[int], state: SequenceState | None, has_images: bool) -> LocalEncoder:
        if state is None:
            raise SnapshotError("snapshot holds no encoder state (made with a box)")
        return LocalEncoder(self.runner, state)
