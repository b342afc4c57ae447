"""One sequence's model state (spec §6.7): what a position needs from the positions before it.

- window[layer]: the layer's last `window_size` FP8-valued KV rows, a ring indexed by position.
- compressed[src] / index_keys[src]: per KV source, the RoPE'd FP4 compressed KV and index keys,
  one entry per completed group, in group order.
- pending[src]: the raw fp32 (kv, score) rows of a ratio>1 source's incomplete group.
- engram_ids: the compressed token id of every position (Engram hashes look back 3 of them).
- dspark_window[stage]: each DSpark stage's ring of context KV at target positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class GrowingRows:
    """An append-only [n, width] tensor with amortised growth."""

    def __init__(self, width: int, dtype: torch.dtype):
        self._buf = torch.empty(0, width, dtype=dtype)
        self.n = 0

    def append(self, rows: torch.Tensor) -> None:
        need = self.n + rows.size(0)
        if need > self._buf.size(0):
            grown = torch.empty(max(need, 2 * self._buf.size(0), 64), self._buf.size(1), dtype=self._buf.dtype)
            grown[: self.n] = self._buf[: self.n]
            self._buf = grown
        self._buf[self.n:need] = rows
        self.n = need

    def truncate(self, n: int) -> None:
        self.n = min(self.n, n)

    @property
    def rows(self) -> torch.Tensor:
        return self._buf[: self.n]


@dataclass
class SequenceState:
    pos: int = 0  # committed tokens
    window: dict[int, torch.Tensor] = field(default_factory=dict)
    compressed: dict[int, GrowingRows] = field(default_factory=dict)
    index_keys: dict[int, GrowingRows] = field(default_factory=dict)
    pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    engram_ids: GrowingRows | None = None
    dspark_window: dict[int, torch.Tensor] = field(default_factory=dict)
    dspark_pos: int = 0  # target positions whose DSpark context is in the rings
