"""One sequence's model state (spec §6.7): what a position needs from the positions before it.

- window[layer]: the layer's FP8-valued KV rows by position (the last window_size are attended).
- compressed[src] / index_keys[src]: per KV source, the RoPE'd FP4 compressed KV and index keys, one
  entry per completed group, in group order, packed in the model's format (288 B / 68 B per entry at
  the released widths, numerics/packing.py; the attention decodes the entries it reads).
- raw[src]: a ratio>1 source's fp32 (kv, score) rows by position, for the incomplete group.
- engram_ids: the compressed token id of every position (Engram hashes look back three of them).
- dspark[stage]: each DSpark stage's context KV by target position.

Rings keep ROLLBACK_ROWS positions more than the model reads, so the last step's rows (at most that
many) can be undone exactly by `truncate` without recomputing anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ROLLBACK_ROWS = 64


class RollbackError(ValueError):
    """A rollback reaches further back than the rings keep; restore a snapshot instead."""


class GrowingRows:
    """An append-only [n, *shape] tensor with amortised growth. Rows past n (the spare capacity) are zero
    until written: a CUDA graph reads the whole buffer (masking what is not yet visible), so it must never
    meet uninitialised memory."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"):
        self._buf = torch.empty(0, *shape, dtype=dtype, device=device)
        self.n = 0

    def reserve(self, n: int) -> None:
        """Capacity for n rows (the buffer moves when it grows, to twice n: a prefill's one large append
        would otherwise leave it full, and the first steps after it would each grow a buffer of theirs --
        on a GPU each growth retires the CUDA graphs that read it by address and size, a recapture of
        10-40 ms for a 2 ms step)."""
        if n > self._buf.size(0):
            grown = self._buf.new_zeros(max(2 * n, 64), *self._buf.shape[1:])
            grown[: self.n] = self._buf[: self.n]
            self._buf = grown

    def append(self, rows: torch.Tensor) -> None:
        need = self.n + rows.size(0)
        self.reserve(need)
        self._buf[self.n:need] = rows
        self.n = need

    def put(self, first: torch.Tensor, rows: torch.Tensor, end: int) -> None:
        """Write rows at first, first + 1, ... (first: an int64 [1] device tensor, so a CUDA graph writes
        wherever a replay's positions say) and count `end` rows."""
        self.reserve(end)
        self._buf[first + torch.arange(rows.size(0), device=rows.device)] = rows
        self.n = end

    def truncate(self, n: int) -> None:
        self.n = min(self.n, n)

    def move(self, device: torch.device) -> None:
        """The rows (and spare capacity) onto `device`, when they are elsewhere."""
        if self._buf.device != device:
            self._buf = self._buf.to(device)

    def copy_to(self, device: torch.device) -> GrowingRows:
        """A copy of the n rows on `device` (no spare capacity), for a reader on another device."""
        out = GrowingRows(tuple(self._buf.shape[1:]), self._buf.dtype, device)
        out._buf, out.n = self.rows.to(device), self.n
        return out

    @property
    def rows(self) -> torch.Tensor:
        return self._buf[: self.n]

    @property
    def buffer(self) -> torch.Tensor:
        """All of the capacity: the n rows, then zeros or rows a truncation gave up."""
        return self._buf


class PositionRing:
    """Rows addressed by absolute position; the last `capacity` positions written are kept."""

    def __init__(self, capacity: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.data = torch.zeros(capacity, *shape, dtype=dtype, device=device)

    @property
    def capacity(self) -> int:
        return self.data.size(0)

    def write(self, positions: torch.Tensor, rows: torch.Tensor) -> None:
        keep = min(positions.numel(), self.capacity)
        self.data[positions[-keep:] % self.capacity] = rows[-keep:]

    def read(self, positions: torch.Tensor) -> torch.Tensor:
        return self.data[positions % self.capacity]

    def move(self, device: torch.device) -> None:
        if self.data.device != device:
            self.data = self.data.to(device)


@dataclass
class SequenceState:
    """`device`: where the tables go unless `layers` names another device for their layer (a model over
    layer ranges on several devices, `SequenceState.place`); the DSpark rings always go there."""

    pos: int = 0  # committed tokens
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    window: dict[int, PositionRing] = field(default_factory=dict)
    compressed: dict[int, GrowingRows] = field(default_factory=dict)
    index_keys: dict[int, GrowingRows] = field(default_factory=dict)
    raw: dict[int, PositionRing] = field(default_factory=dict)
    engram_ids: GrowingRows | None = None
    dspark: dict[int, PositionRing] = field(default_factory=dict)
    dspark_pos: int = 0  # target positions whose DSpark context has been written
    # the device of each layer's window ring and (a KV source) its compressed rows, index keys and raw ring
    layers: dict[int, torch.device] = field(default_factory=dict)

    def ring(self, table: dict, key: int, window: int, shape: tuple[int, ...], dtype: torch.dtype) -> PositionRing:
        r = table.get(key)
        if r is None:
            device = self.device if table is self.dspark else self.layers.get(key, self.device)
            r = table[key] = PositionRing(window + ROLLBACK_ROWS, shape, dtype, device)
        return r

    def place(self, device: torch.device, layers: dict[int, torch.device], tokens: torch.device) -> None:
        """Each layer's tables on layers[layer] (else `device`), the DSpark rings on `device`, the Engram ids on
        `tokens`; what is elsewhere (a snapshot decoded onto one device, entries appended before the first
        forward) moves there. A no-op once placed so."""
        if self.layers == layers and self.device == device and self.engram_ids.buffer.device == tokens:
            return
        self.device, self.layers = device, dict(layers)
        for table in (self.window, self.raw, self.compressed, self.index_keys):
            for key, t in table.items():
                t.move(self.layers.get(key, device))
        for t in self.dspark.values():
            t.move(device)
        self.engram_ids.move(tokens)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        if self.engram_ids is None:
            self.engram_ids = GrowingRows((), torch.int64, self.device)

    def rows(self, table: dict, key: int, shape: tuple[int, ...], dtype: torch.dtype) -> GrowingRows:
        r = table.get(key)
        if r is None:
            r = table[key] = GrowingRows(shape, dtype, self.layers.get(key, self.device))
        return r

    def cache_bytes(self) -> int:
        """Bytes of the caches that grow with the sequence (compressed entries, index keys)."""
        return sum(r.rows.nbytes for table in (self.compressed, self.index_keys) for r in table.values())

    def truncate(self, keep: int, ratios: dict[int, int]) -> None:
        """Forget positions >= keep. `ratios` maps each KV source to its compression ratio."""
        if keep > self.pos or keep < 0:
            raise RollbackError(f"cannot roll back to {keep}: the sequence has {self.pos} tokens")
        if self.pos - keep > ROLLBACK_ROWS:
            raise RollbackError(f"rollback of {self.pos - keep} rows exceeds the {ROLLBACK_ROWS} the state keeps")
        for src, rows in self.compressed.items():
            rows.truncate(keep // ratios[src])
            self.index_keys[src].truncate(keep // ratios[src])
        self.engram_ids.truncate(keep)
        self.dspark_pos = min(self.dspark_pos, keep)
        self.pos = keep
