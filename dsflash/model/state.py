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

A state may take its buffers from a `StatePool` and give them back when its sequence ends (`release`), so
the next sequence holds the same tensors in the same roles (why: `StatePool`).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

ROLLBACK_ROWS = 64
GROWN_MIN_ROWS = 64  # the smallest capacity a GrowingRows grows to
# bytes of ended sequences' buffers a pool keeps, beyond which it lets them go (within the memory plan's
# graphs/workspace allowance, engine/plan.py GPU_WORKSPACE)
POOL_BYTES = 256 << 20
POOL_PER_ROLE = 2  # buffers a pool keeps of one role and shape
TABLES = ("window", "raw", "compressed", "index_keys", "dspark")  # the SequenceState tables by layer or stage
ENGRAM_IDS = ("engram_ids", 0)  # the pool role of a state's Engram ids


class StatePool:
    """Buffers of ended sequences' states, for the next sequences' same roles (a table, its layer or
    stage, the shape). A CUDA graph reads a sequence's state by address and size (engine/graphs.py), so
    a sequence on fresh buffers warms up and captures graphs of its own -- on the H200 its first cycles
    cost 10-40x a warm one -- while on the buffers an ended sequence held, in the same roles, it replays
    that one's graphs. A buffer is zeroed when taken: a sequence's bits are a fresh state's. Thread-safe
    (the server starts and ends sequences on two threads)."""

    def __init__(self, max_bytes: int = POOL_BYTES, per_role: int = POOL_PER_ROLE):
        self.max_bytes, self.per_role = max_bytes, per_role
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, role: Hashable, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
             ) -> torch.Tensor:
        """A zeroed [*shape] tensor: the one given back last in this role and shape, else a new one."""
        device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as a given tensor names it
        with self._lock:
            free = self._free.get((role, tuple(shape), dtype, device))
            t = free.pop() if free else None
            if t is not None:
                self._bytes -= t.nbytes
        return torch.zeros(shape, dtype=dtype, device=device) if t is None else t.zero_()

    def give(self, role: Hashable, t: torch.Tensor) -> None:
        """Keep `t` for the next take of its role and shape (or let it go: the pool is full)."""
        if not t.numel():
            return
        with self._lock:
            free = self._free.setdefault((role, tuple(t.shape), t.dtype, t.device), [])
            if len(free) < self.per_role and self._bytes + t.nbytes <= self.max_bytes:
                free.append(t)
                self._bytes += t.nbytes

    @property
    def bytes(self) -> int:
        return self._bytes


class RollbackError(ValueError):
    """A rollback reaches further back than the rings keep; restore a snapshot instead."""


class GrowingRows:
    """An append-only [n, *shape] tensor with amortised growth. Rows past n (the spare capacity) are zero
    until written: a CUDA graph reads the whole buffer (masking what is not yet visible), so it must never
    meet uninitialised memory."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu",
                 pool: StatePool | None = None, role: Hashable = None):
        self._buf = torch.empty(0, *shape, dtype=dtype, device=device)
        self.n = 0
        self._pool, self._role = pool, role

    def reserve(self, n: int) -> None:
        """Capacity for n rows: the buffer moves when it grows, to the least power of two above n (at most
        2n). Above n: a prefill's one large append would otherwise leave it full, and the first steps after
        it would each grow a buffer of theirs -- on a GPU each growth retires the CUDA graphs that read it by
        address and size, a recapture of 10-40 ms for a 2 ms step. A power of two: sequences of similar
        lengths hold buffers of one size, so a pooled one fits the next sequence (`StatePool`)."""
        if n > self._buf.size(0):
            shape = (max(1 << n.bit_length(), GROWN_MIN_ROWS), *self._buf.shape[1:])
            if self._pool is None:
                grown = self._buf.new_zeros(shape)
            else:
                grown = self._pool.take(self._role, shape, self._buf.dtype, self._buf.device)
            grown[: self.n] = self._buf[: self.n]
            if self._pool is not None:
                self._pool.give(self._role, self._buf)
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

    def __init__(self, capacity: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu",
                 pool: StatePool | None = None, role: Hashable = None):
        self.data = (torch.zeros(capacity, *shape, dtype=dtype, device=device) if pool is None
                     else pool.take(role, (capacity, *shape), dtype, device))

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
    pool: StatePool | None = None  # where new buffers come from and `release` gives them back to

    def _role(self, table: dict, key: int) -> tuple[str, int]:
        return next(name for name in TABLES if getattr(self, name) is table), key

    def ring(self, table: dict, key: int, window: int, shape: tuple[int, ...], dtype: torch.dtype) -> PositionRing:
        r = table.get(key)
        if r is None:
            device = self.device if table is self.dspark else self.layers.get(key, self.device)
            r = table[key] = PositionRing(window + ROLLBACK_ROWS, shape, dtype, device, self.pool,
                                          self._role(table, key))
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
            self.engram_ids = GrowingRows((), torch.int64, self.device, self.pool, ENGRAM_IDS)

    def rows(self, table: dict, key: int, shape: tuple[int, ...], dtype: torch.dtype) -> GrowingRows:
        r = table.get(key)
        if r is None:
            r = table[key] = GrowingRows(shape, dtype, self.layers.get(key, self.device), self.pool,
                                         self._role(table, key))
        return r

    def release(self) -> None:
        """The sequence has ended: its buffers go to the pool (with none, to the allocator) and the state is
        an empty one's."""
        if self.pool is not None:
            for name in TABLES:
                for key, t in getattr(self, name).items():
                    self.pool.give((name, key), t.data if isinstance(t, PositionRing) else t.buffer)
            self.pool.give(ENGRAM_IDS, self.engram_ids.buffer)
        for name in TABLES:
            getattr(self, name).clear()
        self.engram_ids = GrowingRows((), torch.int64, self.device, self.pool, ENGRAM_IDS)
        self.pos = self.dspark_pos = 0

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
