"""The back side's connection to a box, and the encoder session that runs there.

One TCP connection carries every session; a reader thread routes reply frames by request id, so
several requests are in flight at once (the box pipelines them). When the connection drops or the box
restarts, the next call reconnects with bounded backoff, re-synchronises each session from its
committed tokens (the box resumes from its own prefix cache or re-prefills them) and repeats the
request: a box step is bit-identical to a prefill of the same rows, so the text goes on unchanged.
A hung box counts as gone: the link PINGs it every few seconds and drops a connection on which nothing
arrives for its liveness window. If the box stays away past the deadline (counted from when it was last
heard) the caller gets BoxUnavailable, a retryable error.
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
from dsflash.engine.session import ContextLengthError, Engine
from dsflash.engine.snapshot import SnapshotError
from dsflash.model.state import SequenceState
from dsflash.numerics import numerics_version
from dsflash.numerics.packing import ENTRY, INDEX_KEY, packed_width
from dsflash.parallel.group import Unavailable
from dsflash.split.protocol import (
    MAX_FRAME,
    VERSION,
    Frame,
    FrameType,
    ProtocolError,
    body_tensors,
    images_body,
    read_frame,
    tokens_body,
)


class BoxUnavailable(Unavailable):
    """The box could not be reached within the deadline. Retryable: the request may succeed later."""


class BoxRefused(RuntimeError):
    """The box refused the connection or a request for a reason a retry cannot fix (wrong token,
    another model, a malformed request)."""


class _Lost(Exception):
    pass


KEEPER_RETRY = 2.0  # seconds between background reconnection attempts once the box is known to be away


def _error(meta: dict) -> Exception:
    """What an ERROR frame answering a request stands for."""
    code, message = meta.get("code"), meta.get("message")
    if code == "context_length":  # as the one-process engine says it, so the server answers 400 either way
        return ContextLengthError(meta.get("requested"), meta.get("limit"))
    if meta.get("retryable"):  # busy, or a rank of the box's group lost: the request may succeed later
        return BoxUnavailable(f"box unavailable ({code}): {message}")
    return BoxRefused(f"box error {code}: {message}")


class BoxLink:
    def __init__(self, addr: str, identity: str, numerics: str, token: str | None = None, deadline: float = 60.0,
                 connect_timeout: float = 5.0):
        """`identity`: the back side's model identity (Engine.identity), which the box compares with its own;
        `numerics`: the version of the back side's backend, told to the box. The box may compute on another
        backend: its version, from its first answer, is `box_numerics`, and a box that answers with another one
        later (restarted on other hardware) is refused, so that no session continues on other arithmetic."""
        host, _, port = addr.rpartition(":")
        self.addr = (host.strip("[]"), int(port))
        self.identity, self.numerics, self.token = identity, numerics, token
        self.box_numerics: str | None = None
        self.deadline, self.connect_timeout = deadline, connect_timeout
        # a connected box silent this long counts as lost (hung, or cut off). It answers PINGs from its reader
        # thread, so a long prefill chunk on its worker keeps it talking. Half the deadline at most: a hang is
        # noticed, and given up on, within about the deadline
        self.liveness = max(1.0, min(deadline / 2, 20.0))
        self.epoch = 0  # bumped on every new connection: sessions opened before must re-sync
        self.reconnects = 0
        self._sock: socket.socket | None = None
        self._replies: dict[int, tuple[queue.Queue, socket.socket]] = {}  # request id -> (its queue, its connection)
        self._ids = itertools.count(1)
        self._cv = threading.Condition()  # guards the connection state below
        self._send_lock = threading.Lock()
        self._connecting = False  # one caller at a time tries to connect; the others wait for its outcome
        self._tries = 0  # connection attempts finished
        self._down_since: float | None = None  # while the box is away: when it was last heard
        self._why = ""  # the last failed attempt's error
        self._ping_every = self.liveness / 4
        self._closed = False
        threading.Thread(target=self._keep, daemon=True, name=f"box-link-{port}").start()

    @property
    def connected(self) -> bool:
        """Whether the box is reachable now: a connection is up and the box answers on it (one silent past
        `liveness` is dropped); while it is away the link reconnects in the background."""
        return self._sock is not None

    # ---- connection ----
    def _connect_once(self, timeout: float) -> None:
        sock = socket.create_connection(self.addr, timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = {"protocol": VERSION, "identity": self.identity, "numerics": self.numerics,
                     "token": self.token or ""}
            sock.sendall(Frame(FrameType.HELLO, 0, hello).encode())
            reply = read_frame(sock, 1 << 16)
        except ProtocolError as e:
            sock.close()
            raise BoxRefused(f"box {self.addr[0]}:{self.addr[1]} does not speak this link protocol: {e}") from e
        except BaseException:
            sock.close()
            raise
        if reply.type == FrameType.ERROR:
            sock.close()
            if reply.meta.get("retryable"):  # at its connection cap: try again within the deadline
                raise ConnectionError(f"box busy: {reply.meta.get('message')}")
            raise BoxRefused(f"box refused the connection: {reply.meta.get('message')}")
        if reply.type != FrameType.WELCOME or reply.meta.get("identity") != self.identity:
            sock.close()
            raise BoxRefused(f"box serves another model: {reply.meta}")
        box_numerics = str(reply.meta.get("numerics"))
        if self.box_numerics not in (None, box_numerics):
            sock.close()
            raise BoxRefused(f"box now computes numerics {box_numerics}, this back side's sessions were computed with "
                             f"the box's numerics {self.box_numerics}: restart the back side")
        idle = reply.meta.get("idle_timeout")
        ping_every = min(self.liveness, idle if isinstance(idle, int | float) and idle > 0 else self.liveness) / 4
        sock.settimeout(self.liveness)  # every later read and send on it
        with self._cv:
            self.box_numerics = box_numerics
            self._sock, self._ping_every = sock, ping_every
            self._down_since = None
            self.epoch += 1
            if self.epoch > 1:
                self.reconnects += 1
        threading.Thread(target=self._reader, args=(sock,), daemon=True).start()

    def ensure(self) -> int:
        """The connection epoch, connecting first when needed. While the box is away one caller at a time
        tries to connect, outside the lock, and the others wait for that attempt (no one holds the lock
        across a back-off sleep). Everyone gives up once the outage, counted from when the box was last
        heard, is `deadline` old: a dead box costs each request about one deadline at most, and one
        attempt once it is known dead."""
        delay = 0.05
        while True:
            with self._cv:
                tries = self._tries
                self._cv.wait_for(lambda: not self._connecting)
                if self._closed:
                    raise BoxUnavailable("the link to the box is closed")
                if self._sock is not None:
                    return self.epoch
                now = time.monotonic()
                if self._down_since is None:
                    self._down_since = now
                give_up = self._down_since + self.deadline
                if now >= give_up and self._tries != tries:
                    raise self._unavailable()  # another caller's attempt just failed: too late for one more
                self._connecting = True
            failed = None
            try:
                # past the deadline, one short attempt: the box may be back
                self._connect_once(min(self.connect_timeout, max(give_up - now, 1.0)))
            except (OSError, ConnectionError) as e:
                failed = e
            finally:
                with self._cv:
                    self._connecting = False
                    self._tries += 1
                    if failed is not None:
                        self._why = str(failed)
                    self._cv.notify_all()
            if failed is None:
                continue
            left = give_up - time.monotonic()
            if left <= 0:
                raise self._unavailable() from failed
            time.sleep(min(delay, left))  # the last attempt falls at the deadline, not a back-off step before it
            delay = min(delay * 2, 2.0)

    def _unavailable(self) -> BoxUnavailable:
        return BoxUnavailable(f"box {self.addr[0]}:{self.addr[1]} unreachable for {self.deadline:.0f} s ({self._why})")

    def _keep(self) -> None:
        """PING the box while connected: it closes a connection silent for its idle timeout, and its PONGs
        keep the reader's liveness window open while nothing else is said. While it is away, reconnect in
        the background, so `connected` turns true again without waiting for a request."""
        while not self._closed:
            sock = self._sock
            if sock is None:
                try:
                    self.ensure()
                except Exception:  # away, refused, or closed: try again later; requests see their own errors
                    time.sleep(KEEPER_RETRY)
                continue
            self.tell(Frame(FrameType.PING, 0))
            time.sleep(self._ping_every)

    def _reader(self, sock: socket.socket) -> None:
        heard = None
        try:
            while True:
                f = read_frame(sock, MAX_FRAME)
                entry = self._replies.get(f.request)
                if entry is not None and entry[1] is sock:
                    entry[0].put(f)
        except TimeoutError:  # no byte, not even a PONG, for `liveness` seconds: hung or cut off
            heard = time.monotonic() - self.liveness
        except Exception:  # any other read failure ends this connection too
            pass
        self._drop(sock, heard)

    def _drop(self, sock: socket.socket, heard: float | None = None) -> None:
        """End a connection: the callers waiting on it are told, and the outage dates from `heard`, when
        the box was last heard (now, when it closed the connection)."""
        with self._cv:
            if self._sock is sock:
                self._sock = None
                self._down_since = heard if heard is not None else time.monotonic()
            for q, on in list(self._replies.values()):
                if on is sock:
                    q.put(None)
        try:
            sock.close()
        except OSError:
            pass

    def _send(self, sock: socket.socket, frame: Frame) -> None:
        with self._send_lock:
            sock.sendall(frame.encode())

    def request(self, frame: Frame) -> queue.Queue:
        req = next(self._ids)
        frame.request = req
        q: queue.Queue = queue.Queue()
        with self._cv:  # registered only on the live connection, so its end always reaches this queue
            sock = self._sock
            if sock is not None:
                self._replies[req] = (q, sock)
        if sock is None:
            raise _Lost()
        try:
            self._send(sock, frame)
        except OSError as e:
            self._replies.pop(req, None)
            self._drop(sock)
            raise _Lost() from e
        return q

    def tell(self, frame: Frame) -> None:
        """Send a frame that gets no reply to wait for (CLOSE, PING); a lost connection is left to the next
        request."""
        sock = self._sock
        if sock is not None:
            try:
                self._send(sock, frame)
            except OSError:
                self._drop(sock)

    def replies(self, q: queue.Queue, last: FrameType) -> Iterator[Frame]:
        """Frames answering one request, up to a frame of type `last` or one whose meta says last."""
        try:
            while True:
                f = q.get()
                if f is None:
                    raise _Lost()
                if f.type == FrameType.ERROR:
                    raise _error(f.meta)
                yield f
                if f.meta.get("last") if f.type == FrameType.PART else f.type == last:
                    return
        finally:
            for k, (v, _) in list(self._replies.items()):
                if v is q:
                    self._replies.pop(k, None)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            sock = self._sock
            self._cv.notify_all()
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._drop(sock)


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
        if self._epoch == self.link.epoch:
            self.link.tell(Frame(FrameType.CLOSE, 0, {"session": self.sid}))


class BoxHalf:
    """The encoder half on a box: its sessions share one BoxLink."""

    pool = None  # its state lives on the box

    def __init__(self, link: BoxLink, args: ModelArgs):
        self.link, self.args = link, args

    @property
    def reconnects(self) -> int:
        return self.link.reconnects

    @property
    def numerics(self) -> str:
        """The box's numerics version, connecting first if it has not answered yet (BoxUnavailable while it is
        away)."""
        if self.link.box_numerics is None:
            self.link.ensure()
        return self.link.box_numerics

    @property
    def available(self) -> bool:
        """Whether the box is reachable now (for a health check: False while it is away or hung)."""
        return self.link.connected

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
    checkpoint; it may compute on another backend than the engine's decoder half (Engine.numerics keys the
    back side's states by both)."""
    return lambda engine: BoxHalf(BoxLink(addr, engine.identity, numerics_version(engine.decoder.device), token,
                                          deadline), engine.args)
