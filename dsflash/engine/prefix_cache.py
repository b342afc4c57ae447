"""Prefix cache: session snapshots keyed by (model identity with numerics version, token prefix).

RAM holds the most recently used snapshots up to a byte budget; a disk directory (optional) holds
more, evicted by hits and age. A request resumes from the longest cached prefix of its tokens.
A cache file that is corrupt or from another model/numerics is deleted and treated as a miss.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import time
from collections import OrderedDict
from pathlib import Path

from dsflash.engine.snapshot import SnapshotError, read_header
from dsflash.numerics import NUMERICS_VERSION


def prefix_key(identity: str, tokens: list[int]) -> str:
    h = hashlib.sha256(identity.encode())
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.hexdigest()[:40]


class PrefixCache:
    def __init__(self, identity: str, ram_bytes: int = 1 << 30, disk_dir: str | Path | None = None,
                 disk_bytes: int = 20 << 30):
        self.identity = identity
        self.ram_bytes, self.disk_bytes = ram_bytes, disk_bytes
        self._ram: OrderedDict[str, tuple[int, bytes]] = OrderedDict()
        self._lengths: dict[int, int] = {}  # prefix length -> number of entries with it
        self.disk = Path(disk_dir) if disk_dir else None
        self._hits: dict[str, int] = {}
        self._lock = threading.RLock()  # the server runs two generations at once
        if self.disk:
            self.disk.mkdir(parents=True, exist_ok=True)
            for f in self.disk.glob("*.dsnap"):
                self._count(int(f.name.split("-")[0]), +1)

    def _count(self, n: int, delta: int) -> None:
        self._lengths[n] = self._lengths.get(n, 0) + delta
        if self._lengths[n] <= 0:
            del self._lengths[n]

    def _file(self, n: int, key: str) -> Path:
        return self.disk / f"{n}-{key}.dsnap"

    def put(self, tokens: list[int], blob: bytes) -> None:
        with self._lock:
            self._put(tokens, blob)

    def _put(self, tokens: list[int], blob: bytes) -> None:
        key, n = prefix_key(self.identity, tokens), len(tokens)
        if key not in self._ram:
            self._count(n, +1)
        self._ram[key] = (n, blob)
        self._ram.move_to_end(key)
        while sum(len(b) for _, b in self._ram.values()) > self.ram_bytes and len(self._ram) > 1:
            old_key, (old_n, old_blob) = self._ram.popitem(last=False)
            self._count(old_n, -1)
            self._write_disk(old_key, old_n, old_blob)
        self._write_disk(key, n, blob)

    def _write_disk(self, key: str, n: int, blob: bytes) -> None:
        if not self.disk:
            return
        path = self._file(n, key)
        if path.exists():
            return
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(blob)
        os.replace(tmp, path)  # readers never see a half-written snapshot
        self._count(n, +1)
        self._evict_disk()

    def _evict_disk(self) -> None:
        files = list(self.disk.glob("*.dsnap"))
        total = sum(f.stat().st_size for f in files)
        now = time.time()

        def score(f: Path) -> float:
            age_h = (now - f.stat().st_mtime) / 3600
            return (self._hits.get(f.stem.split("-", 1)[1], 0) + 1) / (1 + age_h)

        for f in sorted(files, key=score):
            if total <= self.disk_bytes:
                break
            total -= f.stat().st_size
            f.unlink(missing_ok=True)
            self._count(int(f.name.split("-")[0]), -1)

    def lookup(self, tokens: list[int]) -> tuple[int, bytes | None]:
        """(length, snapshot) of the longest cached prefix of `tokens`, or (0, None)."""
        with self._lock:
            return self._lookup(tokens)

    def _lookup(self, tokens: list[int]) -> tuple[int, bytes | None]:
        for n in sorted((n for n in self._lengths if n <= len(tokens)), reverse=True):
            key = prefix_key(self.identity, tokens[:n])
            hit = self._ram.get(key)
            if hit is not None:
                self._ram.move_to_end(key)
                self._hits[key] = self._hits.get(key, 0) + 1
                return n, hit[1]
            if self.disk and self._file(n, key).exists():
                path = self._file(n, key)
                blob = path.read_bytes()
                try:
                    header = read_header(blob)
                    if header.get("model") != self.identity or header.get("numerics") != NUMERICS_VERSION:
                        raise SnapshotError("another model or numerics version")
                except SnapshotError:
                    path.unlink(missing_ok=True)
                    self._count(n, -1)
                    continue
                os.utime(path)
                self._hits[key] = self._hits.get(key, 0) + 1
                return n, blob
        return 0, None
