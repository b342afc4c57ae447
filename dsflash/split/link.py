"""The back side's connection to a box, and the encoder session that runs there.

One TCP connection carries every session; a reader thread routes reply frames by request id, so
several requests are in flight at once (the box pipelines them). When the connection drops or the box
restarts, the next call reconnects with bounded backoff, re-synchronises each session from its
committed tokens (the box resumes from its own prefix cache or re-prefills them) and repeats the
request: a box step is bit-identical to a prefill of the same rows, so the text goes on unchanged.
If the box stays away past the deadline the caller gets BoxUnavailable, a retryable error.
"""

from __future__ import annotations

import itertools
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from dsflash.config import ModelArgs
from dsflash.engine.halves import HandOff
from dsflash.engine.session import Engine
from dsflash.engine.snapshot import SnapshotError
from dsflash.model.state import SequenceState
from dsflash.numerics import NUMERICS_VERSION
from dsflash.numerics.packing import ENTRY, INDEX_KEY, packed_width
from dsflash.split.protocol import (
    MAX_FRAME,
    VERSION,
    Frame,
    FrameType,
    body_tensors,
    images_body,
    read_frame,
    tokens_body,
)


class BoxUnavailable(RuntimeError):
    """The box could not be reached within the deadline. Retryable: the request may succeed later."""

    retry_after = 5


class BoxRefused(RuntimeError):
    """The box refused the connection or a request for a reason a retry cannot fix (wrong token,
    another model, a malformed request)."""


class _Lost(Exception):
    pass


class BoxLink:
    def __init__(self, addr: str, identity: str, token: str | None = None, deadline: float = 60.0,
                 connect_timeout: float = 5.0):
        host, _, port = addr.rpartition(":")
        self.addr = (host.strip("[]"), int(port))
        self.identity, self.token = identity, token
        self.deadline, self.connect_timeout = deadline, connect_timeout
        self.epoch = 0  # bumped on every new connection: sessions opened before must re-sync
        self.reconnects = 0
        self._sock: socket.socket | None = None
        self._replies: dict[int, queue.Queue] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()

    @property
    def connected(self) -> bool:
        return self._sock is not None

    # ---- connection ----
    def _connect_once(self) -> None:
        sock = socket.create_connection(self.addr, timeout=self.connect_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = {"protocol": VERSION, "identity": self.identity, "numerics": NUMERICS_VERSION,
                 "token": self.token or ""}
        sock.sendall(Frame(FrameType.HELLO, 0, hello).encode())
        reply = read_frame(sock, 1 << 16)
        if reply.type == FrameType.ERROR:
            sock.close()
            raise BoxRefused(f"box refused the connection: {reply.meta.get('message')}")
        if reply.type != FrameType.WELCOME or reply.meta.get("identity") != self.identity:
            sock.close()
            raise BoxRefused(f"box serves another model: {reply.meta}")
        sock.settimeout(None)
        self._sock = sock
        self.epoch += 1
        threading.Thread(target=self._reader, args=(sock,), daemon=True).start()

    def ensure(self) -> int:
        """Connect if needed (bounded backoff up to the deadline); returns the connection epoch."""
        with self._lock:
            if self._sock is not None:
                return self.epoch
            t0, delay = time.monotonic(), 0.05
            while True:
                try:
                    self._connect_once()
                    if self.epoch > 1:
                        self.reconnects += 1
                    return self.epoch
                except (OSError, ConnectionError) as e:
                    if time.monotonic() - t0 + delay > self.deadline:
                        raise BoxUnavailable(f"box {self.addr[0]}:{self.addr[1]} unreachable for "
                                             f"{self.deadline:.0f} s ({e})") from e
                    time.sleep(delay)
                    delay = min(delay * 2, 2.0)

    def _reader(self, sock: socket.socket) -> None:
        try:
            while True:
                f = read_frame(sock, MAX_FRAME)
                q = self._replies.get(f.request)
                if q is not None:
                    q.put(f)
        except Exception:  # any read failure ends this connection; waiting callers are told
            pass
        with self._lock:
            if self._sock is sock:
                self._sock = None
        for q in list(self._replies.values()):
            q.put(None)
        try:
            sock.close()
        except OSError:
            pass

    def request(self, frame: Frame) -> queue.Queue:
        req = next(self._ids)
        frame.request = req
        q: queue.Queue = queue.Queue()
        self._replies[req] = q
        sock = self._sock
        try:
            if sock is None:
                raise OSError("not connected")
            with self._send_lock:
                sock.sendall(frame.encode())
        except OSError as e:
            self._replies.pop(req, None)
            with self._lock:
                if self._sock is sock:
                    self._sock = None
            raise _Lost() from e
        return q

    def replies(self, q: queue.Queue, last: FrameType) -> Iterator[Frame]:
        """Frames answering one request, up to a frame of type `last` or one whose meta says last."""
        try:
            while True:
                f = q.get()
                if f is None:
                    raise _Lost()
                if f.type == FrameType.ERROR:
                    raise BoxRefused(f"box error {f.meta.get('code')}: {f.meta.get('message')}")
                yield f
                if f.meta.get("last") if f.type == FrameType.PART else f.type == last:
                    return
        finally:
            for k, v in list(self._replies.items()):
                if v is q:
                    self._replies.pop(k, None)

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            except OSError:
                pass


class RemoteEncoder:
    """An EncoderSession whose state lives on the box; `tokens` is the committed history it can be
    rebuilt from."""

    _ids = itertools.count(1)

    def __init__(self, link: BoxLink, args: ModelArgs):
        self.link, self.args = link, args
        self.sid = next(self._ids)
        self.tokens: list[int] = []
        self.images: list = []  # ImageSpan of the tokens sent, pixels kept to rebuild the box's side
        self._epoch = 0  # the connection epoch the box-side session belongs to

    @property
    def pos(self) -> int:
        return len(self.tokens)

    def rollback(self, keep: int) -> None:
        del self.tokens[keep:]  # the box rolls back with the next append, which carries `keep`
        self.images = [s for s in self.images if s.start + s.length <= keep]

    def _frame(self, kind: FrameType, meta: dict, tokens: list[int], images: list) -> Frame:
        if not images:
            return Frame(kind, 0, meta, tokens_body(tokens))
        image_meta, pixels = images_body(images)
        return Frame(kind, 0, {**meta, "images": image_meta, "n_tokens": len(tokens)}, tokens_body(tokens) + pixels)

    def _sync(self) -> None:
        frame = self._frame(FrameType.SYNC, {"session": self.sid}, self.tokens, self.images)
        for _ in self.link.replies(self.link.request(frame), FrameType.SYNCED):
            pass

    def _parse(self, f: Frame) -> tuple[HandOff, int]:
        a, m = self.args, f.meta
        ne, nh = int(m["n_entries"]), int(m["n_hand"])
        specs = [((ne, packed_width(a.head_dim, ENTRY[0])), torch.uint8),
                 ((ne, packed_width(a.index_head_dim, INDEX_KEY[0])), torch.uint8)]
        entries, keys, streams, pre = body_tensors(f.body, specs + [
            ((nh, a.hc_mult, a.dim), torch.bfloat16), ((nh, a.hc_mult), torch.float32)])
        return HandOff(int(m["hand_start"]), streams, pre, entries, keys, int(m["rows"])), int(m["rows"])

    def append(self, ids: list[int], keep: int, chunk: int, tail: int, images: Sequence = ()) -> Iterator[HandOff]:
        self.rollback(keep)
        end = keep + len(ids)
        t0 = None
        while len(self.tokens) < end:
            try:
                epoch = self.link.ensure()
                if epoch != self._epoch:
                    if self.tokens:
                        self._sync()
                    self._epoch = epoch
                rest = ids[len(self.tokens) - keep:]
                pending = sorted((s for s in images if s.start >= len(self.tokens)), key=lambda s: s.start)
                meta = {"session": self.sid, "keep": len(self.tokens), "chunk": chunk, "tail": tail}
                q = self.link.request(self._frame(FrameType.APPEND, meta, rest, pending))
                for f in self.link.replies(q, FrameType.PART):  # PART frames until the one marked last
                    hand, rows = self._parse(f)
                    self.tokens.extend(rest[:rows])
                    rest = rest[rows:]
                    done = [s for s in pending if s.start + s.length <= len(self.tokens)]
                    self.images += done
                    pending = pending[len(done):]
                    yield hand
            except _Lost:
                # the box went away mid-request: reconnect and re-sync from the committed tokens
                t0 = t0 or time.monotonic()
                if time.monotonic() - t0 > self.link.deadline:
                    raise BoxUnavailable(f"box lost for {self.link.deadline:.0f} s") from None
                self._epoch = 0
                time.sleep(0.05)

    def restore(self, tokens: list[int]) -> None:
        """Adopt a committed history (a resumed snapshot); the box is synced on the next append."""
        self.tokens, self._epoch = list(tokens), 0

    def saved_state(self) -> None:
        return None  # the box keeps its own state: a resumed session re-syncs it from the tokens

    def close(self) -> None:
        try:
            if self._epoch == self.link.epoch:
                self.link.request(Frame(FrameType.CLOSE, 0, {"session": self.sid}))
        except _Lost:
            pass


class BoxHalf:
    """The encoder half on a box: its sessions share one BoxLink."""

    def __init__(self, link: BoxLink, args: ModelArgs):
        self.link, self.args = link, args

    @property
    def reconnects(self) -> int:
        return self.link.reconnects

    def open(self) -> RemoteEncoder:
        return RemoteEncoder(self.link, self.args)

    def resume(self, tokens: list[int], state: SequenceState | None, has_images: bool) -> RemoteEncoder:
        if has_images:
            # the box would need the images' pixels to rebuild its side; a snapshot holds only their digests
            raise SnapshotError("a session with images cannot be resumed through a box")
        encoder = self.open()
        encoder.restore(tokens)
        return encoder


def box_half(addr: str, token: str | None = None, deadline: float = 60.0) -> Callable[[Engine], BoxHalf]:
    """For `Engine.load(..., encoder=box_half(...))`: the box at HOST:PORT, checked against the engine's
    identity."""
    return lambda engine: BoxHalf(BoxLink(addr, engine.identity, token, deadline), engine.args)
