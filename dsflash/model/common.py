"""Pieces every module uses: RMSNorm, the per-chunk context, and the optional selection overrides."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from dsflash.model.state import GrowingRows, SequenceState


def fit_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """First `rows` rows of t, padded by repeating its last row."""
    if t.size(0) >= rows:
        return t[:rows]
    return torch.cat([t, t[-1:].expand(rows - t.size(0), *t.shape[1:])])


class Replayer(Protocol):
    """What a forward needs of the engine's CUDA-graph store (engine/graphs.py): the model says what a
    segment of it reads and computes, the store captures and replays it."""

    def begin(self, rows: int, epoch: Hashable, eligible: bool = True) -> bool:
        """Whether a forward of `rows` rows replays graphs; `epoch` names what graphs read by address besides
        weights and the key's tensors (the RoPE tables), `eligible` is the model's own condition."""

    def run(self, key: Hashable, fn: Callable[..., tuple[torch.Tensor, ...]], *inputs: torch.Tensor
            ) -> tuple[torch.Tensor, ...]:
        """fn(*inputs) from a graph keyed by `key` (which names every tensor fn reads in place)."""


@dataclass
class Selections:
    """Forced top-k choices by absolute position (replay of another implementation's picks).

    index_topk[layer]: int [positions, k] compressed-cache rows, ascending, -1 padded.
    moe_ids[layer]: int [positions, k] expert ids in the order the router returned them.
    moe_weights[layer]: float32 [positions, k] their routing weights (debugging: another implementation's
    fp32 router arithmetic replayed too; without it the weights come from the engine's own router scores).
    Positions past the arrays' ends use the engine's own choice.
    picker(attention, x, qr, chunk): an index layer's picks made by another rule than its indexer's ([rows,
    index_topk], as Indexer.select gives them; training's warm-up picks by the main attention, train/indexer.py).
    """

    index_topk: dict[int, torch.Tensor] = field(default_factory=dict)
    moe_ids: dict[int, torch.Tensor] = field(default_factory=dict)
    moe_weights: dict[int, torch.Tensor] = field(default_factory=dict)
    picker: Callable[..., torch.Tensor] | None = None

    def rows(self, table: dict[int, torch.Tensor], layer: int, positions: torch.Tensor) -> torch.Tensor | None:
        t = table.get(layer)
        if t is None or int(positions.max()) >= t.size(0):
            return None
        return t.to(positions.device)[positions]


@dataclass
class Chunk:
    """What one forward over a chunk of rows shares between layers.

    Rows n..len(positions)-1 are padding (see kernels/cpu.py on batch invariance): computed like real
    rows at the following positions, never written to the state.
    """

    state: SequenceState
    positions: torch.Tensor  # int64 [rows incl. padding]
    n: int  # real rows
    select: Selections | None = None
    image_mask: torch.Tensor | None = None  # bool [rows]
    topk: torch.Tensor | None = None  # published by the latest index source: [rows, index_topk]
    candidates: torch.Tensor | None = None  # published by the candidate source: bool [rows, blocks]
    trace: dict | None = None  # debugging: per-layer intermediate outputs when a dict is given
    # the attention's sources, made once per chunk (model/attention.py): the window ring's side (slots read,
    # window indices, slots written) and the latest index layer's (picked entries, attention indices)
    window: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    picks: tuple[torch.Tensor, torch.Tensor] | None = None
    graphed: bool = False  # the forward replays CUDA graphs: nothing the graphs read may take a context's shape
    row_tile: int = 1  # rows are padded to a multiple of this (see Transformer.forward)
    # KV sources held on another device than this chunk's (a model over layer ranges): (compressed entries,
    # index keys) copied to this one when the chunk crossed into its range (`moved`)
    remote: dict[int, tuple[GrowingRows, GrowingRows]] = field(default_factory=dict)
    _p0: int | None = None
    _shared: dict = field(default_factory=dict)

    def source(self, src: int) -> tuple[GrowingRows, GrowingRows]:
        """KV source src's (compressed entries, index keys), on this chunk's device."""
        return self.remote.get(src) or (self.state.compressed[src], self.state.index_keys[src])

    def moved(self, device: torch.device, reads: set[int]) -> Chunk:
        """The chunk on `device` (the next layer range's): what the layers published so far moved with it,
        the KV sources in `reads` (written by another range) copied there (exact copies: the same bits; on
        one device too, so that one GPU, or the CPU, runs the code two devices run). What is made once per
        chunk is made again there (the same values)."""
        def to(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        remote = {src: (rows.copy_to(device), self.state.index_keys[src].copy_to(device))
                  for src in reads if (rows := self.state.compressed.get(src)) is not None}
        return Chunk(self.state, self.positions.to(device), self.n, self.select, to(self.image_mask), to(self.topk),
                     to(self.candidates), self.trace, graphed=self.graphed, row_tile=self.row_tile, remote=remote,
                     _p0=self.p0)

    def shared(self, key, make):
        """A value every layer of this chunk would compute alike (ring slots, index layouts), made once."""
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]

    def drop_front(self, k: int) -> Chunk:
        """The same chunk without its first k rows (re-padded), keeping what the layers published."""
        n = self.n - k
        rows = n + (-n % self.row_tile)
        start = self.p0 + k
        positions = torch.arange(start, start + rows, device=self.positions.device)

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fit_rows(t[k:], rows)

        return Chunk(self.state, positions, n, self.select, cut(self.image_mask), cut(self.topk),
                     cut(self.candidates), self.trace, row_tile=self.row_tile, remote=self.remote, _p0=start)

    @property
    def p0(self) -> int:
        # positions are consecutive; the first is read once (a device read per use would stall the GPU)
        if self._p0 is None:
            self._p0 = int(self.positions[0])
        return self._p0

    @property
    def rows(self) -> int:
        return self.positions.numel()
