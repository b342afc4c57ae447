"""Engram tables by tier (issue 17, model/tiers.py): where the hashed rows live and how a chunk's rows reach
the device. Every tier hands the kernel the same thing, `Gathered` = (FP8 rows, E8M0 scales, ids into
them), so `k.engram_rows(*gathered)` gives the bits of `k.engram_rows(table, scale, hash_ids)`: the row
gather and dequantisation are per row, so gathering a chunk's distinct rows into a compact table first and
indexing that changes nothing.

- `ResidentTable` ("gpu"): the table on the compute device; the ids are the hash ids themselves.
- `HostTable` ("host", CUDA): the table in page-locked host memory; a chunk's distinct rows are gathered
  on the host into a pinned staging buffer and uploaded on a side stream.
- `DiskTable` ("disk"): the table stays in the checkpoint file; a chunk's distinct rows are read with
  `os.preadv` by a thread pool, through a bounded hot-row cache (`RowCache`).

Host and disk tables work off the forward's thread: `request` starts a lookup (the hash ids leave the
device without stalling the host), `Lookup.wait` hands its rows to the current stream. The Transformer
requests both Engram layers' rows when it hashes a chunk, and the next chunk's (`prefetch`) when it knows
it, so the gathers overlap the layers' compute.
"""

from __future__ import annotations

import os
import time
import weakref
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from dsflash.checkpoint.reader import Checkpoint, CheckpointError, has_nan
from dsflash.kernels import Kernels

READ_THREADS = 16  # preads in flight per disk table: enough to keep an NVMe queue busy with 264-byte reads
LOAD_PIECE = 1 << 26  # bytes per read while filling a host table from its file


class Gathered(NamedTuple):
    """What `k.engram_rows` takes: FP8 rows [R, De], their E8M0 scales [R, De/32], row ids [...] into them."""

    table: torch.Tensor
    scale: torch.Tensor
    ids: torch.Tensor


@dataclass
class TableStats:
    """One table's lookups so far (summed over tables by `Transformer.tier_stats`)."""

    rows_requested: int = 0  # row ids looked up, repeats included
    rows_unique: int = 0  # distinct rows per lookup, summed
    rows_read: int = 0  # rows read from the checkpoint file (disk tier)
    cache_hits: int = 0  # distinct rows served by the hot-row cache (disk tier)
    bytes_read: int = 0  # bytes read from the file for those rows
    read_s: float = 0.0  # seconds spent reading them

    def add(self, other: TableStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class Lookup:
    """A lookup in flight; `wait` gives its `Gathered`, ready for the current stream."""

    def __init__(self, ready: Gathered | None = None, future: Future | None = None):
        self._ready, self._future = ready, future

    def wait(self) -> Gathered:
        if self._ready is None:
            gathered, event = self._future.result()
            if event is not None:  # uploaded on the table's side stream
                stream = torch.cuda.current_stream(gathered.ids.device)
                stream.wait_event(event)
                for t in gathered:
                    t.record_stream(stream)
            self._ready = gathered
        return self._ready


class EngramTable(ABC):
    """One Engram layer's table. `request(ids)` (int64 hash ids [...]) starts the lookup of those rows."""

    name: str  # the weight's checkpoint name (for messages)
    rows: int
    row_bytes: int  # De + De/32: one FP8 row and its scales

    def __init__(self) -> None:
        self.stats = TableStats()

    @property
    def resident(self) -> bool:
        return False

    @abstractmethod
    def request(self, ids: torch.Tensor) -> Lookup:
        """Start the lookup of the rows `ids` name (each tier its way)."""

    def prefetch(self, ids: torch.Tensor) -> None:  # noqa: B027 (a resident table has nothing to fetch ahead)
        """Start the lookup of rows a later `request` will ask for (the next chunk's); nothing by default."""


class ResidentTable(EngramTable):
    def __init__(self, name: str, table: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.name, self.table, self.scale = name, table, scale
        self.rows, self.row_bytes = table.size(0), table.size(1) + scale.size(1)

    @property
    def resident(self) -> bool:
        return True

    def request(self, ids: torch.Tensor) -> Lookup:
        # no counting here: a device tensor's size is free, but this runs inside CUDA-graph captures too
        return Lookup(Gathered(self.table, self.scale, ids))


class StagedTable(EngramTable):
    """A table off the compute device: per lookup the distinct rows are fetched on the host (`_fetch`, by
    the subclass) and moved to the device with ids remapped into them. One worker thread per table runs
    the lookups in order, so a request finds a prefetch of the same ids finished before it."""

    def __init__(self, name: str, rows: int, de: int, device: torch.device):
        super().__init__()
        self.name, self.rows, self.de, self.device = name, rows, de, device
        self.row_bytes = de + de // 32
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="engram-lookup")
        self._ahead: tuple[Future, list] | None = None  # the latest prefetch and its host ids (once known)

    @abstractmethod
    def _fetch(self, unique: torch.Tensor, out_rows: torch.Tensor, out_scales: torch.Tensor) -> None:
        """Fill out_rows / out_scales (uint8 host tensors [u, ...]) with the table rows `unique` (int64 [u],
        ascending)."""

    def _host(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.uint8, pin_memory=self._cuda)

    def request(self, ids: torch.Tensor) -> Lookup:
        return Lookup(future=self._submit(ids, self._take_ahead()))

    def prefetch(self, ids: torch.Tensor) -> None:
        known: list = []
        self._ahead = (self._submit(ids, None, known), known)

    def _take_ahead(self) -> tuple[Future, list] | None:
        ahead, self._ahead = self._ahead, None
        return ahead

    def _submit(self, ids: torch.Tensor, ahead: tuple[Future, list] | None, known: list | None = None) -> Future:
        event = None
        if self._cuda:  # the ids come to the host without stalling this thread: the worker waits for them
            host_ids = ids.to("cpu", non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        else:
            host_ids = ids
        return self._worker.submit(self._lookup, host_ids, event, ahead, known)

    def _lookup(self, host_ids: torch.Tensor, ready: torch.cuda.Event | None, ahead: tuple[Future, list] | None,
                known: list | None) -> tuple[Gathered, torch.cuda.Event | None]:
        if ready is not None:
            ready.synchronize()
        if known is not None:
            known.append(host_ids)
        # the worker runs lookups in order: a prefetch submitted before this request has finished
        if ahead is not None and ahead[1] and torch.equal(ahead[1][0], host_ids):
            return ahead[0].result()
        unique, inverse = torch.unique(host_ids.reshape(-1), sorted=True, return_inverse=True)
        u = unique.numel()
        rows, scales = self._host((u, self.de)), self._host((u, self.de // 32))
        self._fetch(unique, rows, scales)
        s = self.stats
        s.rows_requested += host_ids.numel()
        s.rows_unique += u
        inverse = inverse.reshape(host_ids.shape)
        if not self._cuda:
            return self._gathered(rows, scales, inverse), None
        with torch.cuda.stream(self._stream):
            moved = [t.to(self.device, non_blocking=True) for t in (rows, scales, inverse)]
            done = torch.cuda.Event()
            done.record(self._stream)
        return self._gathered(*moved), done

    @staticmethod
    def _gathered(rows: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor) -> Gathered:
        return Gathered(rows.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu), ids)


class HostTable(StagedTable):
    """The table in host memory, page-locked on CUDA (so it is never paged out and could be read by the
    device directly); read from the file straight into that memory, never through a second copy."""

    def __init__(self, ckpt: Checkpoint, name: str, scale_name: str, device: torch.device):
        (path, begin, _), (spath, sbegin, _) = ckpt.byte_range(name), ckpt.byte_range(scale_name)
        rows, de = ckpt.dtype_shape(name)[1]
        super().__init__(name, rows, de, device)
        self.table = torch.empty((rows, de), dtype=torch.uint8)
        self.scale = torch.empty((rows, de // 32), dtype=torch.uint8)
        for t, p, b, n in ((self.table, path, begin, name), (self.scale, spath, sbegin, scale_name)):
            _read_into(p, b, t, n)
            if has_nan(t.view(torch.float8_e4m3fn if t is self.table else torch.float8_e8m0fnu)):
                raise CheckpointError(f"{p}: tensor {n!r} holds NaN: the file is damaged")
            if self._cuda:
                _page_lock(self, t, n)

    def _fetch(self, unique: torch.Tensor, out_rows: torch.Tensor, out_scales: torch.Tensor) -> None:
        torch.index_select(self.table, 0, unique, out=out_rows)
        torch.index_select(self.scale, 0, unique, out=out_scales)


def _read_into(path: Path, begin: int, t: torch.Tensor, name: str) -> None:
    """t's bytes from the file at `begin` on (a host table filled without a second copy)."""
    view = memoryview(t.numpy()).cast("B")
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:done + LOAD_PIECE]], begin + done)
            if got <= 0:
                raise CheckpointError(f"{path}: truncated inside tensor {name!r} ({done} of {len(view)} bytes)")
            done += got
    finally:
        os.close(fd)


def _page_lock(owner: object, t: torch.Tensor, name: str) -> None:
    """Page-lock t's memory for as long as `owner` lives (cudaHostRegister: the caching pinned allocator
    would round a 94 GiB table up to 128 GiB)."""
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.nbytes, 0)
    err = err[0] if isinstance(err, tuple) else err  # (some bindings return (error, ...))
    if int(err) != 0:
        raise RuntimeError(f"Engram table {name!r}: page-locking {t.nbytes / 2**30:.1f} GiB of host memory failed "
                           f"(CUDA error {int(err)}); place Engram on disk instead")
    weakref.finalize(owner, _page_unlock, t)


def _page_unlock(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


class RowCache:
    """Hot rows by id in `budget` bytes, the index included: a set-associative cache (row r in set r mod
    sets, `WAYS` rows a set), each set dropping its least recently used row first. Vectorised over a
    lookup's rows, so a prefill chunk's ~200K rows cost numpy calls, not a Python loop."""

    WAYS = 8

    def __init__(self, budget: int, width: int, rows: int):
        # a row, its id and its last use; never more sets than the table has rows
        self.sets = min(budget // ((width + 16) * self.WAYS), rows)
        self.slab = np.empty((self.sets, self.WAYS, width), dtype=np.uint8)
        self.tags = np.full((self.sets, self.WAYS), -1, dtype=np.int64)  # row id held per way, -1: none
        self.used = np.zeros((self.sets, self.WAYS), dtype=np.int64)  # the lookup that last used it
        self.clock = 0

    def find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(held: bool [u], the held rows [held, width]) for distinct ids [u]; marks the held ones used."""
        self.clock += 1
        if not self.sets:
            return np.zeros(ids.shape, dtype=bool), self.slab.reshape(0, self.slab.shape[-1])
        sets = ids % self.sets
        match = self.tags[sets] == ids[:, None]
        held = match.any(axis=1)
        where = sets[held], match[held].argmax(axis=1)
        self.used[where] = self.clock
        return held, self.slab[where]

    def insert(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Hold rows [k, width] under distinct ids not held, each in its set's least recently used way (the
        rows of this lookup last; a set given more new rows than it has ways keeps the first ones)."""
        if not self.sets or not ids.size:
            return
        sets = ids % self.sets
        order = np.argsort(sets, kind="stable")
        sets, ids, rows = sets[order], ids[order], rows[order]
        rank = np.arange(sets.size) - np.searchsorted(sets, sets)  # k-th new row of its set
        keep = rank < self.WAYS
        sets, ids, rows, rank = sets[keep], ids[keep], rows[keep], rank[keep]
        ways = np.argsort(self.used[sets], axis=1, kind="stable")[np.arange(sets.size), rank]
        self.tags[sets, ways], self.used[sets, ways], self.slab[sets, ways] = ids, self.clock, rows


class DiskTable(StagedTable):
    """The table left in the checkpoint file: row r of the weight at begin + r*De, its scales at the scale
    tensor's begin + r*De/32. A lookup's distinct rows not in the hot-row cache (`cache_bytes`, its index
    included) are read by `READ_THREADS` threads; the table is never loaded."""

    def __init__(self, ckpt: Checkpoint, name: str, scale_name: str, device: torch.device, cache_bytes: int):
        (self.path, self.begin, _), (self.scale_path, self.scale_begin, _) = (ckpt.byte_range(name),
                                                                              ckpt.byte_range(scale_name))
        rows, de = ckpt.dtype_shape(name)[1]
        super().__init__(name, rows, de, device)
        self.scale_name = scale_name
        self.cache = RowCache(cache_bytes, self.row_bytes, rows)
        self._fds = (os.open(self.path, os.O_RDONLY), os.open(self.scale_path, os.O_RDONLY))
        weakref.finalize(self, _close, self._fds)
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="engram-read")

    def _fetch(self, unique: torch.Tensor, out_rows: torch.Tensor, out_scales: torch.Tensor) -> None:
        ids, rows, scales, de = unique.numpy(), out_rows.numpy(), out_scales.numpy(), self.de
        held, cached = self.cache.find(ids)
        rows[held], scales[held] = cached[:, :de], cached[:, de:]
        s = self.stats
        s.cache_hits += int(held.sum())
        missing = np.flatnonzero(~held)
        if not missing.size:
            return
        t0 = time.perf_counter()
        parts = np.array_split(missing, min(READ_THREADS, missing.size))
        for f in [self._readers.submit(self._read, part, ids, rows, scales) for part in parts]:
            f.result()
        s.read_s += time.perf_counter() - t0
        s.rows_read += missing.size
        s.bytes_read += missing.size * self.row_bytes
        new_rows, new_scales = rows[missing], scales[missing]
        self._check(new_rows, new_scales, ids[missing])
        self.cache.insert(ids[missing], np.concatenate([new_rows, new_scales], axis=1))

    def _read(self, part: np.ndarray, ids: np.ndarray, rows: np.ndarray, scales: np.ndarray) -> None:
        fd, sfd = self._fds
        de, sde = self.de, self.de // 32
        for i, r in zip(part.tolist(), ids[part].tolist(), strict=True):
            for f, buf, offset, width, path, name in (
                    (fd, rows[i], self.begin + r * de, de, self.path, self.name),
                    (sfd, scales[i], self.scale_begin + r * sde, sde, self.scale_path, self.scale_name)):
                if os.preadv(f, [buf], offset) != width:
                    raise CheckpointError(f"{path}: tensor {name!r}: short read of row {r} (the file is truncated)")

    def _check(self, rows: np.ndarray, scales: np.ndarray, ids: np.ndarray) -> None:
        """Damage the resident tier would refuse at load (reader.has_nan), refused on the rows read."""
        for data, dtype, path, name in ((rows, torch.float8_e4m3fn, self.path, self.name),
                                        (scales, torch.float8_e8m0fnu, self.scale_path, self.scale_name)):
            t = torch.from_numpy(data).view(dtype)
            if has_nan(t):
                bad = ids[int(torch.isnan(t.float()).any(dim=1).nonzero()[0])]
                raise CheckpointError(f"{path}: tensor {name!r} row {bad} holds NaN: the file is damaged")


def _close(fds: tuple[int, ...]) -> None:
    for fd in fds:
        os.close(fd)


def open_table(tier: str, ckpt: Checkpoint, k: Kernels, prefix: str, cache_bytes: int) -> EngramTable:
    """Layer `prefix`'s table (`{prefix}embed.weight` / `.scale`) on `tier` for backend k. On the CPU
    backend host memory is the compute device's, so "host" is the resident table there."""
    name, scale_name = prefix + "embed.weight", prefix + "embed.scale"
    if tier == "disk":
        return DiskTable(ckpt, name, scale_name, k.device, cache_bytes)
    if tier == "host" and k.device.type == "cuda":
        return HostTable(ckpt, name, scale_name, k.device)
    return ResidentTable(name, ckpt.get(name).to(k.device), ckpt.get(scale_name).to(k.device))
