"""Prefix cache: session snapshots keyed by (model identity, numerics version, token prefix).

RAM holds the most recently used snapshots up to a byte budget; a disk directory (optional) holds
more, evicted by hits and age. A request resumes from the longest cached prefix of its tokens.

The disk is best effort: a write that fails (a full disk, an I/O error) is logged once and costs only that
entry's disk copy, never the request; a file that is truncated, corrupt or from another model/numerics is
deleted when read and treated as a miss; a writer's temporary file left by a dead process is removed at
start; files the cache did not name are left alone.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from dsflash.engine.snapshot import SnapshotError, check

log = logging.getLogger(__name__)

# the cache's own file names: "<prefix length>-<key>.dsnap", and "<...>.<writer pid>.tmp" while one is written
# (earlier builds wrote "<...>.tmp", no pid: always stale now)
SNAPSHOT_NAME = re.compile(r"(\d+)-([0-9a-f]{40})\.dsnap")
TEMP_NAME = re.compile(r"\d+-[0-9a-f]{40}(?:\.(\d+))?\.tmp")


def prefix_key(identity: str, tokens: list[int]) -> str:
    h = hashlib.sha256(identity.encode())
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.hexdigest()[:40]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


class PrefixCache:
    def __init__(self, identity: str, numerics: str | Callable[[], str], ram_bytes: int = 1 << 30,
                 disk_dir: str | Path | None = None, disk_bytes: int = 20 << 30):
        """`identity` and `numerics`: the engine's (Engine.identity, Engine.numerics) whose snapshots it keeps;
        numerics may be a function, asked at each use (a split's includes the box's, known once it answered)."""
        self.identity, self._numerics = identity, numerics
        self.ram_bytes, self.disk_bytes = ram_bytes, disk_bytes
        self._ram: OrderedDict[str, tuple[int, bytes]] = OrderedDict()
        self._lengths: dict[int, int] = {}  # prefix length -> number of entries with it
        self.disk = Path(disk_dir) if disk_dir else None
        self._hits: dict[str, int] = {}
        self._warned: set[str] = set()
        self._lock = threading.RLock()  # the server runs two generations at once
        if self.disk:
            self.disk.mkdir(parents=True, exist_ok=True)
            for f in self.disk.iterdir():
                temp = TEMP_NAME.fullmatch(f.name)
                if temp and not (temp[1] and _alive(int(temp[1]))):
                    self._unlink(f)
            for _, n, _ in self._disk_files():
                self._count(n, +1)

    @property
    def numerics(self) -> str:
        return self._numerics() if callable(self._numerics) else self._numerics

    @property
    def _keyed(self) -> str:
        """What an entry's key is made of besides its tokens: the model identity and the numerics version."""
        return f"{self.identity}|{self.numerics}"

    def _count(self, n: int, delta: int) -> None:
        self._lengths[n] = self._lengths.get(n, 0) + delta
        if self._lengths[n] <= 0:
            del self._lengths[n]

    def _file(self, n: int, key: str) -> Path:
        return self.disk / f"{n}-{key}.dsnap"

    def _disk_files(self) -> list[tuple[Path, int, str]]:
        """(path, prefix length, key) of each snapshot file on disk."""
        return [(f, int(m[1]), m[2]) for f in self.disk.glob("*.dsnap") if (m := SNAPSHOT_NAME.fullmatch(f.name))]

    def _warn_once(self, what: str, e: OSError) -> None:
        kind = f"{what}:{e.errno}"
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("prefix cache: cannot %s in %s (%s); the cache goes on without it", what, self.disk, e)

    def _unlink(self, path: Path) -> bool:
        try:
            path.unlink()
        except FileNotFoundError:  # another process sharing the directory was first
            return False
        except OSError as e:
            self._warn_once("delete files", e)
            return False
        return True

    def _remove(self, path: Path, n: int) -> None:
        if self._unlink(path):
            self._count(n, -1)

    def put(self, tokens: list[int], blob: bytes) -> None:
        with self._lock:
            self._put(tokens, blob)

    def _put(self, tokens: list[int], blob: bytes) -> None:
        key, n = prefix_key(self._keyed, tokens), len(tokens)
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
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")  # each writer its own: directories may be shared
        try:
            if path.exists():
                return
            tmp.write_bytes(blob)
            os.replace(tmp, path)  # readers never see a half-written snapshot
        except OSError as e:  # a full or failing disk: this entry has no disk copy, the request goes on
            self._warn_once("write snapshots", e)
            self._unlink(tmp)
            return
        self._count(n, +1)
        self._evict_disk()

    def _evict_disk(self) -> None:
        files = []
        try:
            found = self._disk_files()
        except OSError as e:
            self._warn_once("list snapshots", e)
            return
        for f, n, key in found:
            try:
                st = f.stat()
            except OSError:  # gone meanwhile
                continue
            files.append((f, n, key, st.st_size, st.st_mtime))
        total = sum(size for *_, size, _ in files)
        now = time.time()

        def score(entry) -> float:
            _, _, key, _, mtime = entry
            return (self._hits.get(key, 0) + 1) / (1 + (now - mtime) / 3600)

        for f, n, _, size, _ in sorted(files, key=score):
            if total <= self.disk_bytes:
                break
            total -= size
            self._remove(f, n)

    def lookup(self, tokens: list[int]) -> tuple[int, bytes | None]:
        """(length, snapshot) of the longest cached prefix of `tokens`, or (0, None)."""
        with self._lock:
            return self._lookup(tokens)

    def _lookup(self, tokens: list[int]) -> tuple[int, bytes | None]:
        keyed = self._keyed
        for n in sorted((n for n in self._lengths if n <= len(tokens)), reverse=True):
            key = prefix_key(keyed, tokens[:n])
            hit = self._ram.get(key)
            if hit is not None:
                self._ram.move_to_end(key)
                self._hits[key] = self._hits.get(key, 0) + 1
                return n, hit[1]
            blob = self._read_disk(n, key) if self.disk else None
            if blob is not None:
                self._hits[key] = self._hits.get(key, 0) + 1
                return n, blob
        return 0, None

    def _read_disk(self, n: int, key: str) -> bytes | None:
        """The snapshot file of (n, key), checked whole (a damaged or foreign one is deleted), else None."""
        path = self._file(n, key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:  # not cached at this length
            return None
        except OSError as e:
            self._warn_once("read snapshots", e)
            return None
        try:
            check(blob, self.identity, self.numerics)
        except SnapshotError as e:
            log.warning("prefix cache: deleting %s: %s", path.name, e)
            self._remove(path, n)
            return None
        try:
            os.utime(path)  # its age counts from its last use
        except OSError:
            pass
        return blob
