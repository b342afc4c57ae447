"""Routed experts off the compute device (issue 17): the checkpoint's experts in pinned host memory
("host") or left in its files ("disk"), and one device cache of expert slots that every MoE layer of a
model runs its experts from.

The cache is sized in bytes (`Tiers.expert_cache`; default: one layer's bank) and holds whole experts --
w1, w3 and w2 with their scales -- in the kernels' bank layout: `w13` has w1 of slot s at entry s and w3 at
entry slots + s, `w2` has w2 at s, so `expert_linear` runs over the slots exactly as over a resident
bank, with the routing ids remapped expert -> slot on the device. Only the weights' addresses change, not
a row's arithmetic: the bits are the resident bank's. Slots are shared by all layers, the least recently
used evicted first.

A MoE call reads its routing on the host (a step: its few experts; a prefill: nearly all), asks for its
experts in groups that fit (`groups`), and `acquire`s each group before computing it. Loads overlap work
where the data allow:
- disk: every missing expert of a group is read at once by a pool of `pread` threads (O_DIRECT where the
  file system takes it: a cold expert costs a disk read, not a page-cache copy), the next group's reads
  start before this group computes, and a wide call (a prefill) reads the next layer's experts ahead
  while it computes; on CUDA the reads land in pinned staging and the codes are converted on the device;
- host (CUDA): the experts are kept in the kernels' layout in pinned host memory and copied to the slots
  by DMA on a side stream, which the compute stream waits for; a wide call is split into two groups so
  the second group's copies run while the first computes.
On the reference backend "host" keeps the experts as resident weights do (its device is host memory), so
the tier exercises the cache's bookkeeping only.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dsflash.checkpoint.reader import CheckpointError
from dsflash.config import ModelArgs
from dsflash.kernels import Kernels
from dsflash.kernels.cpu import Weight
from dsflash.model.tiers import Tiers

PROJECTIONS = ("w1", "w3", "w2")
ALIGN = 4096  # O_DIRECT: file offsets, lengths and buffers aligned to the logical block size (4 KiB covers both)
READ_THREADS = 8  # concurrent preads: an NVMe drive needs several requests in flight to reach its bandwidth
# a call with at least this many routing picks per expert uses nearly every expert (8,192 rows x 6 picks over
# 384 experts: 128 per expert, an expert left out with probability ~e^-128); such a call reads the next
# layer's experts ahead, and splits into two groups so one group's loads overlap the other's compute
WIDE_PICKS_PER_EXPERT = 4
_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8, "U8": torch.uint8}
_KINDS = {"F8_E4M3": "fp8", "I8": "fp4", "U8": "fp4"}

Key = tuple[int, int]  # (layer, expert)
Stored = list[tuple[str, torch.Tensor, torch.Tensor]]  # per projection: (kind, codes, stored scale), host memory


@dataclass
class ExpertStats:
    """What the cache did, summed over a model's forwards: experts found in a slot (`hits`) or loaded
    (`misses`), slots overwritten (`evictions`), payload bytes brought from host memory or disk
    (`bytes_read`, reads ahead included), experts read ahead (`prefetched`) and of those the ones read but
    not routed to (`ahead_unused`), and host seconds a forward waited in `acquire` for reads and for issuing
    copies (`stall_s`)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_read: int = 0
    prefetched: int = 0
    ahead_unused: int = 0
    stall_s: float = 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["hit_rate"] = self.hits / max(1, self.hits + self.misses)
        return d


def nbytes(w: Weight) -> int:
    """A weight's bytes as held (stored codes and scales, or the CUDA layout)."""
    stored = getattr(w, "codes", None)
    if stored is not None:
        return stored.nbytes + w.stored_scale.nbytes
    return w.values.nbytes + (0 if w.scale is None else w.scale.nbytes)


def _aligned(size: int, pinned: bool) -> torch.Tensor:
    """A uint8 buffer of `size` bytes starting on an ALIGN boundary (O_DIRECT's rule for buffers)."""
    raw = torch.empty(size + ALIGN, dtype=torch.uint8, pin_memory=pinned)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip:skip + size]


class _Reader:
    """Byte ranges of the checkpoint's files by pread, on a thread pool (pread releases the GIL)."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self.pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="dsflash-experts")
        self._fds: dict[Path, tuple[int, bool]] = {}
        self._lock = threading.Lock()
        # a model dropped without close(): its threads and files go with it
        weakref.finalize(self, _release, self.pool, self._fds)

    def _fd(self, path: Path, direct: bool = True) -> tuple[int, bool]:
        with self._lock:
            if path not in self._fds or (self._fds[path][1] and not direct):
                flag = getattr(os, "O_DIRECT", 0) if direct else 0
                try:
                    fd = os.open(path, os.O_RDONLY | flag)
                except OSError:  # a file system without O_DIRECT (tmpfs): buffered reads
                    fd, flag = os.open(path, os.O_RDONLY), 0
                if path in self._fds:
                    os.close(self._fds[path][0])
                self._fds[path] = (fd, bool(flag))
            return self._fds[path]

    def read(self, path: Path, begin: int, end: int) -> torch.Tensor:
        """The bytes [begin, end) of `path` (uint8, pinned on CUDA)."""
        fd, direct = self._fd(path)
        if direct:
            lo = begin - begin % ALIGN
            buf = _aligned(-(-(end - lo) // ALIGN) * ALIGN, self.pinned)
            try:
                _pread(fd, buf, lo, end - lo, path)
                return buf[begin - lo:end - lo]
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                fd, _ = self._fd(path, direct=False)  # O_DIRECT opened but refused: buffered from now on
        buf = torch.empty(end - begin, dtype=torch.uint8, pin_memory=self.pinned)
        _pread(fd, buf, begin, end - begin, path)
        return buf

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        with self._lock:
            _release(self.pool, self._fds)


def _release(pool: ThreadPoolExecutor, fds: dict[Path, tuple[int, bool]]) -> None:
    pool.shutdown(wait=False, cancel_futures=True)
    for fd, _ in fds.values():
        os.close(fd)
    fds.clear()


def _pread(fd: int, buf: torch.Tensor, offset: int, need: int, path: Path) -> None:
    """Fill buf from `offset` until at least `need` bytes are in (an O_DIRECT read may stop at the file's end)."""
    view, done = memoryview(buf.numpy()), 0
    while done < need:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CheckpointError(f"{path}: truncated: {need - done} bytes missing at offset {offset + done}")
        done += n


@dataclass
class _Layer:
    prefix: str  # "layers.{i}.ffn.experts."
    n: int  # routed experts held here
    first: int = 0  # the checkpoint id of local expert 0 (an expert-parallel rank's range starts there)
    host: list | None = None  # host tier: the w1, w3, w2 banks in host memory (pinned on CUDA)


class ExpertStore:
    """The routed experts of one model (all its MoE layers and DSpark stages) on the host or disk tier,
    and the device cache they run from; see the module docstring."""

    def __init__(self, k: Kernels, ckpt, tiers: Tiers, args: ModelArgs, default_slots: int | None = None):
        """`default_slots`: the cache's slots without --expert-cache (default: one backbone layer's bank; an
        expert-parallel rank's share of it)."""
        if tiers.experts not in ("host", "disk"):
            raise ValueError(f"an expert store holds host or disk experts, not {tiers.experts!r}")
        self.k, self.ckpt, self.tier = k, ckpt, tiers.experts
        # default cache: one backbone layer's bank; backbone layers read ahead backbone layers only (the DSpark
        # stages run in drafts, not after the last layer)
        self.cache_bytes, self.n_layers = tiers.expert_cache, args.n_layers
        self.default_slots = default_slots or args.n_routed_experts
        self.cuda = k.device.type == "cuda"
        self.side = torch.cuda.Stream(k.device) if self.cuda else None
        self.reader = _Reader(pinned=self.cuda) if self.tier == "disk" else None
        self.layers: dict[int, _Layer] = {}
        self.stats = ExpertStats()
        self._stats_lock = threading.Lock()
        self.slots = 0
        self.slot_bytes = 0
        self.w13 = self.w2 = None
        self._slot_of: OrderedDict[Key, int] = OrderedDict()  # least recently used first
        self._free: list[int] = []
        self._held: set[int] = set()  # the previous group's slots: its compute may still be queued
        self._mark = None  # CUDA event: the compute queued before the previous group's
        self._staged: dict[Key, Future] = {}  # disk reads started ahead

    # -- building -----------------------------------------------------------------------------------

    def register(self, layer: int, w, prefix: str, n: int, first: int = 0) -> None:
        """The `n` routed experts under `prefix` (`layers.{i}.ffn.experts.`) of a MoE layer from id `first` on
        (an expert-parallel rank's range; local ids 0 .. n-1 here), from the loader `w`: the host tier copies
        them to host memory, the disk tier checks their stored dtypes."""
        if self.w13 is None:
            self._allocate(w, f"{prefix}{first}.")
        entry = _Layer(prefix, n, first)
        if self.tier == "host":
            entry.host = []
            for name in PROJECTIONS:
                bank = None
                for e in range(n):
                    weight = w.linear(f"{prefix}{first + e}.{name}")
                    if bank is None:
                        bank = self.k.expert_slots(weight, n, True)
                    self.k.expert_put(bank, e, weight)
                entry.host.append(bank)
            if self.cuda:  # the device-to-host copies done before the side stream reads the pinned banks
                torch.cuda.current_stream(self.k.device).synchronize()
        else:
            for e in range(first, first + n):
                for name in PROJECTIONS:
                    dtype, _ = self.ckpt.dtype_shape(f"{prefix}{e}.{name}.weight")
                    if dtype not in _KINDS:
                        raise CheckpointError(f"{prefix}{e}.{name}.weight: routed experts on disk must be FP8 or "
                                              f"FP4, the checkpoint stores {dtype}")
        self.layers[layer] = entry

    def _allocate(self, w, expert: str) -> None:
        """The device slots, shaped like the first layer's first expert (`expert`: its prefix)."""
        w1, w2 = w.linear(expert + "w1"), w.linear(expert + "w2")
        self.slot_bytes = 2 * nbytes(w1) + nbytes(w2)
        self.slots = self.default_slots if self.cache_bytes is None else self.cache_bytes // self.slot_bytes
        if self.slots < 1:
            raise ValueError(f"expert cache of {self.cache_bytes} bytes holds no expert ({self.slot_bytes} bytes "
                             "each): give --expert-cache at least one expert's size")
        self.w13 = self.k.expert_slots(w1, 2 * self.slots, False)
        self.w2 = self.k.expert_slots(w2, self.slots, False)
        self._free = list(range(self.slots))

    # -- a MoE call ----------------------------------------------------------------------------------

    def groups(self, ids: torch.Tensor, n_experts: int) -> tuple[list[list[int]], bool]:
        """The experts a call routes to (one host read), ascending, in groups that fit the cache, and whether
        the call is wide (WIDE_PICKS_PER_EXPERT): a wide call takes two groups, so loads overlap compute."""
        used = torch.unique(ids).tolist()
        wide = ids.numel() >= WIDE_PICKS_PER_EXPERT * n_experts
        if len(used) <= self.slots and not (wide and self.slots > 1 and len(used) > 1):
            return [used], wide
        size = max(1, min(self.slots // 2, -(-len(used) // 2))) if wide else max(1, self.slots // 2)
        return [used[i:i + size] for i in range(0, len(used), size)], wide

    def slots_for(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """A short forward's routing ids [rows, k] of `layer` remapped to slots holding its experts, loaded now
        as one group (one host read of the routing). The caller checks `holds(ids.numel())` first."""
        # one small read-back; the remap is applied on the host, so the step's only device work here is the
        # slots' upload (and the loads)
        ids = ids.cpu()
        used = torch.unique(ids).tolist()
        if len(used) > self.slots:
            raise ValueError(f"{len(used)} experts in one group, the cache holds {self.slots}")
        return self.acquire(layer, used, on_host=True)[ids].to(self.k.device)

    def holds(self, experts: int) -> bool:
        """Whether a forward that routes to up to `experts` distinct experts a layer can load them at once."""
        return experts <= self.slots

    def acquire(self, layer: int, experts: list[int], then: list[int] | None = None, wide: bool = False,
                on_host: bool = False) -> torch.Tensor:
        """Make `experts` of `layer` resident and return the remap table, int64 [layer's experts] on the
        device (`on_host`: in host memory): the slot of each of them, -1 for the others. `then`: the experts of
        this layer's next group, read ahead now; a wide call's last group (`then` None) reads the next layer's
        experts ahead."""
        t0 = time.perf_counter()
        compute = torch.cuda.current_stream(self.k.device) if self.cuda else None
        need = [(layer, e) for e in experts]
        keep = {self._slot_of[key] for key in need if key in self._slot_of}
        missing = [key for key in need if key not in self._slot_of]
        for key in need:
            if key in self._slot_of:
                self._slot_of.move_to_end(key)
        wanted = set(need) | {(layer, e) for e in then or ()}
        for key in [key for key in self._staged if key[0] == layer and key not in wanted]:
            # read ahead for this layer but not routed to: dropped, counted when it was read (or is being read)
            self.stats.ahead_unused += not self._staged.pop(key).cancel()
        reads = {key: self._start_read(key) for key in missing}
        # the reads ahead queue behind this group's at once: the pool stays busy while this group installs
        ahead = [(layer, e) for e in then] if then else self._next_layer(layer) if wide else []
        for key in ahead:
            self._stage(key)
        self.stats.hits += len(need) - len(missing)
        self.stats.misses += len(missing)
        if missing:
            slots, wait_all = self._victims(len(missing), keep)
            with torch.cuda.stream(self.side) if self.cuda else nullcontext():
                if self.cuda:  # overwrite a slot only once the compute that reads it is done
                    if wait_all:
                        self.side.wait_stream(compute)
                    elif self._mark is not None:
                        self.side.wait_event(self._mark)
                for key, slot in zip(missing, slots, strict=True):
                    self._install(key, slot, reads[key])
                    self._slot_of[key] = slot
                    keep.add(slot)
            if self.cuda:
                compute.wait_stream(self.side)
        self._held = keep
        if self.cuda:
            self._mark = compute.record_event()
        remap = torch.full((self.layers[layer].n,), -1, dtype=torch.int64)
        remap[experts] = torch.tensor([self._slot_of[key] for key in need], dtype=torch.int64)
        self.stats.stall_s += time.perf_counter() - t0
        return remap if on_host else remap.to(self.k.device)

    def _victims(self, count: int, keep: set[int]) -> tuple[list[int], bool]:
        """`count` slots to load into: free ones, then the least recently used outside `keep` and the previous
        group's (still queued) slots, then those (the side stream then waits for all queued compute)."""
        slots = self._free[:count]
        del self._free[:count]
        wait_all = False
        for spare_held in (False, True):
            for key in list(self._slot_of):
                if len(slots) == count:
                    break
                slot = self._slot_of[key]
                if slot in keep or (slot in self._held) != spare_held:
                    continue
                del self._slot_of[key]
                slots.append(slot)
                self.stats.evictions += 1
                wait_all |= spare_held
        assert len(slots) == count, "a group larger than the cache"  # groups() never makes one
        return slots, wait_all

    def _next_layer(self, layer: int) -> list[Key]:
        later = [i for i in self.layers if i > layer and (i < self.n_layers) == (layer < self.n_layers)]
        if not later:
            return []
        nxt = min(later)
        return [(nxt, e) for e in range(min(self.layers[nxt].n, self.slots))]

    # -- loading -------------------------------------------------------------------------------------

    def _stage(self, key: Key) -> None:
        """Start reading an expert ahead (disk tier; the host tier's experts are in memory already), at most
        the cache's size in flight: a second buffer in host memory."""
        if self.tier != "disk" or key in self._slot_of or key in self._staged or len(self._staged) >= self.slots:
            return
        self._staged[key] = self.reader.pool.submit(self._read, key)
        self.stats.prefetched += 1

    def _start_read(self, key: Key) -> Future | None:
        if self.tier != "disk":
            return None
        return self._staged.pop(key, None) or self.reader.pool.submit(self._read, key)

    def _read(self, key: Key) -> Stored:
        """An expert's stored codes and scales from the checkpoint's files (a pool thread)."""
        layer, e = key
        entry = self.layers[layer]
        out, total = [], 0
        for name in PROJECTIONS:
            parts = []
            for suffix in (".weight", ".scale"):
                tensor = f"{entry.prefix}{entry.first + e}.{name}{suffix}"
                dtype, shape = self.ckpt.dtype_shape(tensor)
                raw = self.reader.read(*self.ckpt.byte_range(tensor))
                total += raw.numel()
                parts.append(raw.view(_DTYPES[dtype]).view(shape))
            out.append((_KINDS[self.ckpt.dtype_shape(f"{entry.prefix}{entry.first + e}.{name}.weight")[0]], *parts))
        with self._stats_lock:
            self.stats.bytes_read += total
        return out

    def _install(self, key: Key, slot: int, read: Future | None) -> None:
        """Put an expert into a slot (on CUDA: on the side stream)."""
        layer, e = key
        if read is None:
            weights = [bank[e] for bank in self.layers[layer].host]
            self.stats.bytes_read += sum(nbytes(w) for w in weights)
        else:
            dev = self.k.device
            weights = [self.k.weight(kind, codes.to(dev, non_blocking=True), scale.to(dev, non_blocking=True))
                       for kind, codes, scale in read.result()]
        w1, w3, w2 = weights
        self.k.expert_put(self.w13, slot, w1)
        self.k.expert_put(self.w13, self.slots + slot, w3)
        self.k.expert_put(self.w2, slot, w2)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
