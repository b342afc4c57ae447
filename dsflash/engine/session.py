"""Engine and Session: the narrow boundary everything above the model uses (ds4.h style).

`Engine` holds the loaded model; `Session` is one sequence's timeline: prefill in chunks, `step`
(roll back to `keep` tokens, append rows, get their logits), DSpark drafts, snapshot/restore. Every
operation is exact: a step of L rows gives the bits a prefill of the same rows gives.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from dsflash.engine import snapshot
from dsflash.engine.state import ROLLBACK_ROWS, PositionRing, SequenceState
from dsflash.model.dspark import argmax_sampler
from dsflash.model.load import load_model
from dsflash.model.transformer import Transformer
from dsflash.numerics import NUMERICS_VERSION

DEFAULT_CHUNK = 8192
MAX_STEP_ROWS = 8


class ContextLengthError(ValueError):
    def __init__(self, requested: int, limit: int):
        super().__init__(f"this request needs {requested} tokens of context, the model's limit is {limit}")
        self.requested, self.limit = requested, limit


def model_identity(model: Transformer) -> str:
    """Hash of the config and the tensor index (names, dtypes, shapes): two processes agree on it
    exactly when they load the same model."""
    ckpt = model.ckpt
    index = [(n, *ckpt.dtype_shape(n)) for n in ckpt.names()]
    blob = json.dumps({"config": model.args.to_dict(), "tensors": index}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


@dataclass
class Engine:
    model: Transformer
    max_context: int

    @classmethod
    def load(cls, path: str | Path, max_context: int | None = None) -> Engine:
        model = load_model(path)
        return cls(model, max_context or model.args.max_seq_len)

    @property
    def identity(self) -> str:
        ident = getattr(self, "_identity", None)
        if ident is None:
            ident = self._identity = f"{model_identity(self.model)}-n{NUMERICS_VERSION}"
        return ident

    def session(self) -> Session:
        return Session(self)


class Session:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.model = engine.model
        self.state = SequenceState()
        self.tokens: list[int] = []
        # DSpark context inputs of recent rows, written into the drafter's rings only when a draft needs them
        width = self.model.args.dim * len(self.model.args.dspark_target_layer_ids)
        self._main_hidden = PositionRing(self.model.args.window_size + ROLLBACK_ROWS, (width,), torch.bfloat16)
        self.last_logits: torch.Tensor | None = None

    @property
    def pos(self) -> int:
        return self.state.pos

    def _check_ids(self, ids: list[int]) -> None:
        vocab = self.model.args.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids outside [0, {vocab}): {bad[:5]}")
        if self.pos + len(ids) > self.engine.max_context:
            raise ContextLengthError(self.pos + len(ids), self.engine.max_context)

    def _forward(self, ids: list[int]) -> torch.Tensor:
        start = self.pos
        out = self.model.forward(self.state, torch.tensor(ids, dtype=torch.int64))
        self.tokens.extend(ids)
        if out.main_hidden is not None:
            self._main_hidden.write(torch.arange(start, self.pos), out.main_hidden)
        return out.logits

    def prefill(self, ids: list[int], chunk: int = DEFAULT_CHUNK,
                progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
        """Append a prompt in chunks; returns the last row's logits [V]."""
        self._check_ids(ids)
        for i in range(0, len(ids), chunk):
            logits = self._forward(ids[i:i + chunk])
            if progress:
                progress(min(i + chunk, len(ids)), len(ids))
        self.last_logits = logits[-1]
        return self.last_logits

    def rollback(self, keep: int) -> None:
        ratios = {s: self.model.args.compress_ratios[s] for s in self.state.compressed}
        self.state.truncate(keep, ratios)
        del self.tokens[keep:]

    def step(self, keep: int, rows: list[int]) -> torch.Tensor:
        """Roll back to `keep` tokens, append 1..8 rows, return their logits [L, V]."""
        if not 1 <= len(rows) <= MAX_STEP_ROWS:
            raise ValueError(f"a step appends 1 to {MAX_STEP_ROWS} rows, got {len(rows)}")
        self.rollback(keep)
        self._check_ids(rows)
        logits = self._forward(rows)
        self.last_logits = logits[-1]
        return logits

    def draft(self, anchor: int, sampler: Callable[[torch.Tensor], int] = argmax_sampler) -> list[int]:
        """DSpark proposals for the positions after `anchor`, which is the token at position `pos`."""
        dspark = self.model.dspark
        win = self.model.args.window_size
        first = max(self.state.dspark_pos, self.pos - win)
        if first < self.pos:
            positions = torch.arange(first, self.pos)
            dspark.write_context(self.state, self._main_hidden.read(positions), positions)
        return dspark.draft(self.state, anchor, sampler)[0][1:]

    def snapshot(self) -> bytes:
        extras = {"main_hidden": self._main_hidden.data}
        if self.last_logits is not None:
            extras["last_logits"] = self.last_logits
        return snapshot.encode(self.state, self.tokens, self.engine.identity, extras)

    @classmethod
    def restore(cls, engine: Engine, blob: bytes) -> Session:
        s = cls(engine)
        s.state, s.tokens, extras = snapshot.decode(blob, engine.identity)
        s._main_hidden.data.copy_(extras["main_hidden"])
        s.last_logits = extras.get("last_logits")
        return s
