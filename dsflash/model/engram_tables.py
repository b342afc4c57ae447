"""Engram tables by tier (issue 17, model/tiers.py): where the hashed rows live and how a chunk's rows reach
the device. Every tier hands the kernel the same thing, `Gathered` = (FP8 rows, E8M0 scales, ids into
them), so `k.engram_rows(*gathered)` gives the bits of `k.engram_rows(table, scale, hash_ids)`: the row
gather and dequantisation are per row, so gathering a chunk's distinct rows into a compact table first and
indexing that changes nothing.

- `ResidentTable` ("gpu"): the table on the compute device; the ids are the hash ids themselves.
- `HostTable` ("host", CUDA): the table in page-locked host memory; a chunk's distinct rows are gathered
  on the host into a pinned staging buffer and uploaded on a side stream.
- `DiskTable` ("disk"): the table stays in the checkpoint file; a chunk's distinct rows are read with
  `os.preadv` by a thread pool, through a bounded hot-row cache (least recently used first out).

Host and disk tables work off the forward's thread: `request` starts a lookup (the hash ids leave the
device without stalling the host), `Lookup.wait` hands its rows to the current stream. The Transformer
requests both Engram layers' rows when it hashes a chunk, and the next chunk's (`prefetch`) when it knows
it, so the gathers overlap the layers' compute.
"""

from __future__ import annotations

import os
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
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


class EngramTable:
    """One Engram layer's table. `request(ids)` (int64 hash ids [...]) starts the lookup of those rows."""

    name: str  # the weight's checkpoint name (for messages)
    rows: int
    row_bytes: int  # De + De/32: one FP8 row and its scales

    def __init__(self) -> None:
        self.stats = TableStats()

    @property
    def resident(self) -> bool:
        return False

    def request(self, ids: torch.Tensor) -> Lookup:
        raise NotImplementedError

    def prefetch(self, ids: torch.Tensor) -> None:
        """Start the lookup of rows a later `request` will ask for (the next chunk's)."""


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

    def _fetch(self, unique: torch.Tensor, out_rows: torch.Tensor, out_scales: torch.Tensor) -> None:
        """Fill out_rows / out_scales (uint8 host tensors [u, ...]) with the table rows `unique` (int64 [u],
        ascending)."""
        raise NotImplementedError

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


def _read_into(path, begin: int, t: torch.Tensor, name: str) -> None:
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
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        raise RuntimeError(f"Engram table {name!r}: page-locking {t.nbytes / 2**30:.1f} GiB of host memory failed "
                           f"(CUDA error {int(err)}); place Engram on disk instead")
    weakref.finalize(owner, _page_unlock, t)


def _page_unlock(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


class RowCache:
    """Hot rows by id, least recently used dropped first; `slots` rows of `width` bytes in one slab (plus an
    index entry of ~100 bytes a row, not counted in the size)."""

    def __init__(self, slots: int, width: int):
        self.slab = np.empty((slots, width), dtype=np.uint8)
        self.where: OrderedDict[int, int] = OrderedDict()  # row id -> slot, least recently used first
        self.filled = 0  # slots [0, filled) hold rows; a full cache reuses its least recently used row's

    def find(self, ids: list[int]) -> tuple[list[int], list[int], list[int]]:
        """(positions of ids held, their slots, positions of ids not held); marks the held ones used."""
        held, slots, missing = [], [], []
        where = self.where
        for i, r in enumerate(ids):
            slot = where.get(r)
            if slot is None:
                missing.append(i)
            else:
                where.move_to_end(r)
                held.append(i)
                slots.append(slot)
        return held, slots, missing

    def insert(self, ids: list[int], rows: np.ndarray) -> None:
        """Hold rows [k, width] under ids (not held yet); the latest ones only when they exceed the cache."""
        cap = self.slab.shape[0]
        if not cap:
            return
        ids, rows = ids[-cap:], rows[-cap:]
        slots = []
        for r in ids:
            if self.filled < cap:
                slot, self.filled = self.filled, self.filled + 1
            else:
                slot = self.where.popitem(last=False)[1]
            self.where[r] = slot
            slots.append(slot)
        self.slab[slots] = rows


class DiskTable(StagedTable):
    """The table left in the checkpoint file: row r of the weight at begin + r*De, its scales at the scale
    tensor's begin + r*De/32. A lookup's distinct rows not in the hot-row cache (`cache_bytes` of rows) are
    read by `READ_THREADS` threads; the table is never loaded."""

    def __init__(self, ckpt: Checkpoint, name: str, scale_name: str, device: torch.device, cache_bytes: int):
        (self.path, self.begin, _), (self.scale_path, self.scale_begin, _) = (ckpt.byte_range(name),
                                                                              ckpt.byte_range(scale_name))
        rows, de = ckpt.dtype_shape(name)[1]
        super().__init__(name, rows, de, device)
        self.scale_name = scale_name
        self.cache = RowCache(cache_bytes // self.row_bytes, self.row_bytes)
        self._fds = (os.open(self.path, os.O_RDONLY), os.open(self.scale_path, os.O_RDONLY))
        weakref.finalize(self, _close, self._fds)
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="engram-read")

    def _fetch(self, unique: torch.Tensor, out_rows: torch.Tensor, out_scales: torch.Tensor) -> None:
        ids = unique.tolist()
        rows, scales = out_rows.numpy(), out_scales.numpy()
        de = self.de
        held, slots, missing = self.cache.find(ids)
        if held:
            cached = self.cache.slab[slots]
            rows[held], scales[held] = cached[:, :de], cached[:, de:]
        s = self.stats
        s.cache_hits += len(held)
        if not missing:
            return
        t0 = time.perf_counter()
        parts = np.array_split(np.array(missing), min(READ_THREADS, len(missing)))
        for f in [self._readers.submit(self._read, part, ids, rows, scales) for part in parts]:
            f.result()
        s.read_s += time.perf_counter() - t0
        s.rows_read += len(missing)
        s.bytes_read += len(missing) * self.row_bytes
        new_rows, new_scales = rows[missing], scales[missing]
        self._check(new_rows, new_scales, [ids[i] for i in missing])
        self.cache.insert([ids[i] for i in missing], np.concatenate([new_rows, new_scales], axis=1))

    def _read(self, part: np.ndarray, ids: list[int], rows: np.ndarray, scales: np.ndarray) -> None:
        fd, sfd = self._fds
        de, sde = self.de, self.de // 32
        for i in part.tolist():
            r = ids[i]
            for f, buf, offset, width, path, name in (
                    (fd, rows[i], self.begin + r * de, de, self.path, self.name),
                    (sfd, scales[i], self.scale_begin + r * sde, sde, self.scale_path, self.scale_name)):
                if os.preadv(f, [buf], offset) != width:
                    raise CheckpointError(f"{path}: tensor {name!r}: short read of row {r} (the file is truncated)")

    def _check(self, rows: np.ndarray, scales: np.ndarray, ids: list[int]) -> None:
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
