"""`dsflash box`: the encoder half (embed, Engram, layers [0, d), layer d's cache write) served over TCP.

One compute worker takes tasks from a priority queue: a step (at most 8 rows) goes before any prefill
chunk, and a prefill advances one chunk per task, so one session's long prefill never holds up
another's decode step. Each connection has its own sessions; a malformed frame closes only the
connection that sent it.

Nothing a peer does costs the box more than `Limits` grants: connections past the cap are answered
ERROR busy, a connection that does not finish its HELLO, falls silent or stalls inside a frame is closed
after its timeout, and a connection's sessions, queued requests and context are bounded.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import itertools
import json
import logging
import queue
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from dsflash.checkpoint.manifest import verify_weights
from dsflash.checkpoint.reader import CheckpointError
from dsflash.config import load_config
from dsflash.engine import snapshot
from dsflash.engine.halves import LocalEncoder
from dsflash.engine.images import SpanKey, cache_key, span_keys
from dsflash.engine.placement import add_placement_options, checked_plan, layer_devices, tiers_from
from dsflash.engine.plan import PlacementError
from dsflash.engine.prefix_cache import PrefixCache
from dsflash.engine.progress import LayerCount
from dsflash.engine.ranks import run_ranked
from dsflash.engine.runner import Runner
from dsflash.engine.session import MAX_STEP_ROWS, default_device, engine_identity
from dsflash.model.load import load_model
from dsflash.model.parallel import Layout, Sharding
from dsflash.model.state import ROLLBACK_ROWS
from dsflash.model.tiers import RESIDENT, Tiers
from dsflash.numerics import numerics_version
from dsflash.parallel.group import Unavailable
from dsflash.split.protocol import (
    MAX_FRAME,
    VERSION,
    Frame,
    FrameType,
    ProtocolError,
    error_frame,
    field_of,
    read_frame,
    tensors_body,
    token_count,
    tokens_and_images,
)

log = logging.getLogger(__name__)

MAX_CHUNK = 1 << 16
ACCEPT_PAUSE = (0.01, 1.0)  # seconds: the first and the longest pause after a failed accept


@dataclass(frozen=True)
class Limits:
    """What one box grants its peers; each is a `dsflash box` flag."""

    max_connections: int = 64  # open connections, authenticated or not; one more is answered ERROR busy
    handshake_timeout: float = 10.0  # seconds from accept to a complete HELLO
    # an authenticated connection silent this long is closed; the back side pings every few seconds
    idle_timeout: float = 120.0
    read_timeout: float = 30.0  # once a frame has begun, the longest wait for each read of its remaining bytes
    max_sessions: int = 256  # per connection
    max_pending: int = 64  # requests queued or running, per connection
    max_context: int | None = None  # tokens per session (None: the model's max_seq_len)


class Refusal(Exception):
    """A request the box will not run: answered with an ERROR frame naming `code`; the connection stays."""

    def __init__(self, code: str, message: str, retryable: bool = False, **extra):
        super().__init__(message)
        self.code, self.retryable, self.extra = code, retryable, extra

    def frame(self, request: int) -> Frame:
        f = error_frame(request, self.code, str(self), self.retryable)
        f.meta.update(self.extra)
        return f


def _secret(token: str) -> bytes:
    # compared as bytes: hmac.compare_digest takes str only when it is ASCII
    return token.encode("utf-8", "surrogatepass")


@dataclass
class BoxSession:
    encoder: LocalEncoder
    tokens: list[int] = field(default_factory=list)
    spans: list[SpanKey] = field(default_factory=list)  # the image spans among the tokens

    def cache_key(self) -> list[int]:
        return cache_key(self.tokens, self.spans)

    def truncate(self, keep: int) -> None:
        self.encoder.rollback(keep)
        del self.tokens[keep:]
        self.spans = [sp for sp in self.spans if sp[0] + sp[1] <= keep]


class Connection:
    def __init__(self, sock: socket.socket, peer: str, max_pending: int):
        self.sock, self.peer = sock, peer
        self.opened = time.monotonic()
        self.sessions: dict[int, BoxSession] = {}
        self.send_lock = threading.Lock()
        self.alive = True
        self.pending = threading.BoundedSemaphore(max_pending)  # one unit per request queued or running

    def send(self, frame: Frame) -> None:
        if not self.alive:
            return
        try:
            with self.send_lock:
                self.sock.sendall(frame.encode())
        except OSError:
            self.alive = False


class Box:
    def __init__(self, model_path: str | Path, token: str | None = None, cache_dir: str | None = None,
                 max_frame: int = MAX_FRAME, device: str = "cpu", cuda_graphs: bool = True,
                 limits: Limits = Limits(), tiers: Tiers = RESIDENT, loaded: Callable[[int], None] | None = None,
                 ranges: Sequence[tuple[range, str]] | None = None, parallel: Sharding | None = None):
        """`ranges`: the encoder's layers over devices (model/transformer.py), else all on `device`.
        `parallel`: rank 0 of an --ep/--tp layout (engine/ranks.py) the encoder half is sharded over."""
        self.model = Runner(load_model(model_path, half="encoder", device=device, tiers=tiers, loaded=loaded,
                                       ranges=ranges, parallel=parallel), cuda_graphs and parallel is None)
        if parallel is not None:
            parallel.ready()
        self.layout = parallel.layout if parallel is not None else Layout()
        self.parallel = parallel
        self.args = self.model.args
        self.identity = engine_identity(self.model.model)
        # its backend's version: the back side keys its states by it (its own backend may be another)
        self.numerics = numerics_version(self.model.device)
        self.token = token
        self.max_frame = max_frame
        self.limits = limits
        self.max_context = limits.max_context or self.args.max_seq_len
        self._open = 0  # connections accepted and not yet closed (the cap counts these)
        self._open_lock = threading.Lock()
        self._warned: set[str] = set()
        self.cache = PrefixCache(self.identity, self.numerics, ram_bytes=256 << 20, disk_dir=cache_dir)
        self.tasks: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self.connections: set[Connection] = set()
        self.started = time.time()
        self.steps_served = 0
        threading.Thread(target=self._worker, daemon=True, name="box-worker").start()

    # ---- network side ----
    def serve(self, host: str, port: int) -> None:
        srv = socket.create_server((host, port), reuse_port=False)
        self.port = srv.getsockname()[1]
        print(f"dsflash box: serving {self.identity} on {host}:{self.port}", flush=True)
        pause = ACCEPT_PAUSE[0]
        while True:
            try:
                sock, peer = srv.accept()
            except OSError as e:
                # out of descriptors (EMFILE, ENFILE) or kernel memory: the peer waits in the listen backlog
                # while handshake and idle timeouts free descriptors; back off rather than spin or end the box
                self._warn_once(f"accept: {e.strerror}", f"accept failed ({e}); backing off")
                time.sleep(pause)
                pause = min(pause * 2, ACCEPT_PAUSE[1])
                continue
            pause = ACCEPT_PAUSE[0]
            self._admit(sock, f"{peer[0]}:{peer[1]}")

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("dsflash box: %s", message)

    def _admit(self, sock: socket.socket, peer: str) -> None:
        with self._open_lock:
            admitted = self._open < self.limits.max_connections
            self._open += admitted
        if not admitted:
            # one small frame into a fresh socket's empty send buffer: it cannot block the accept loop
            sock.setblocking(False)
            try:
                sock.send(error_frame(0, "busy", f"the box has its {self.limits.max_connections} connections open",
                                      retryable=True).encode())
            except OSError:
                pass
            sock.close()
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Connection(sock, peer, self.limits.max_pending)
        try:
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()
        except RuntimeError as e:  # no thread to spare: this peer is turned away, the box goes on
            self._warn_once("thread", f"cannot start a connection thread ({e})")
            self._close(conn)

    def _close(self, conn: Connection) -> None:
        conn.alive = False
        self.connections.discard(conn)
        conn.sessions.clear()
        try:
            conn.sock.close()
        except OSError:
            pass
        with self._open_lock:
            self._open -= 1

    def _authorised(self, token) -> bool:
        return self.token is None or isinstance(token, str) and hmac.compare_digest(_secret(token),
                                                                                   _secret(self.token))

    def _handle(self, conn: Connection) -> None:
        lim = self.limits
        try:
            hello = read_frame(conn.sock, 1 << 16, until=conn.opened + lim.handshake_timeout)
            if hello.type != FrameType.HELLO:
                raise ProtocolError("the first frame must be HELLO")
            if not self._authorised(hello.meta.get("token")):
                conn.send(error_frame(hello.request, "auth", "wrong or missing token", retryable=False))
                return
            if hello.meta.get("identity") != self.identity:
                conn.send(error_frame(hello.request, "model_mismatch",
                                      f"box serves {self.identity}, the back side has {hello.meta.get('identity')}",
                                      retryable=False))
                return
            conn.send(Frame(FrameType.WELCOME, hello.request,
                            {"identity": self.identity, "numerics": self.numerics, "protocol": VERSION,
                             "idle_timeout": lim.idle_timeout, "max_context": self.max_context}))
            self.connections.add(conn)
            while conn.alive:
                f = read_frame(conn.sock, self.max_frame, wait=lim.idle_timeout, stall=lim.read_timeout)
                try:
                    self._dispatch(conn, f)
                except Refusal as r:
                    conn.send(r.frame(f.request))
        except ProtocolError as e:
            conn.send(error_frame(0, "malformed", str(e), retryable=False))
        except TimeoutError as e:  # silent or stalled: the peer keeps no thread or descriptor past its timeout
            conn.send(error_frame(0, "timeout", str(e), retryable=True))
        except (ConnectionError, OSError):
            pass
        finally:
            self._close(conn)

    def _dispatch(self, conn: Connection, f: Frame) -> None:
        if f.type == FrameType.PING:
            conn.send(Frame(FrameType.PONG, f.request))
        elif f.type == FrameType.CLOSE:
            conn.sessions.pop(field_of(f.meta, "session", int), None)
        elif f.type == FrameType.APPEND:
            sid = field_of(f.meta, "session", int, 0)
            keep = field_of(f.meta, "keep", int, 0)
            chunk = min(field_of(f.meta, "chunk", int, 1), MAX_CHUNK)
            tail = field_of(f.meta, "tail", int, 0)
            n = token_count(f.meta, f.body)
            if not n:
                raise Refusal("empty_append", "an APPEND carries at least one token")
            self._check_context(keep + n)
            ids, images = self._payload(f)
            prio = 0 if len(ids) <= MAX_STEP_ROWS and not images else 1
            self._submit(prio, conn, f.request, ("append", sid, keep, chunk, tail, ids, images))
        elif f.type == FrameType.SYNC:
            sid = field_of(f.meta, "session", int, 0)
            self._check_context(token_count(f.meta, f.body))
            ids, images = self._payload(f)
            self._submit(1, conn, f.request, ("sync", sid, ids, images))
        else:
            raise ProtocolError(f"unexpected {f.type.name} frame")

    def _check_context(self, requested: int) -> None:
        """Before the body is parsed: a history past the limit costs the box nothing but its bytes."""
        if requested > self.max_context:
            raise Refusal("context_length", f"this request needs {requested} tokens of context; the box's limit "
                          f"is {self.max_context}", requested=requested, limit=self.max_context)

    def _payload(self, f: Frame) -> tuple[list[int], list]:
        a = self.args
        ids, images = tokens_and_images(f.meta, f.body, a.vision_patch_size, a.vision_downsample_ratio)
        self._check_tokens(ids)
        if images and self.model.model.vision is None:
            raise ProtocolError("images sent to a box whose model has no vision tower")
        return ids, images

    def _check_tokens(self, ids: list[int]) -> None:
        vocab = self.args.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ProtocolError(f"token ids outside [0, {vocab}): {bad[:5]}")

    def _submit(self, prio: int, conn: Connection, request: int, work) -> None:
        """A new request; its unit of `conn.pending` is given back when it is answered to the end."""
        if not conn.pending.acquire(blocking=False):
            raise Refusal("busy", f"this connection has {self.limits.max_pending} requests queued", retryable=True)
        self._enqueue(prio, conn, request, work)

    def _enqueue(self, prio: int, conn: Connection, request: int, work) -> None:
        self.tasks.put((prio, next(self._order), conn, request, work))

    def _open_session(self, conn: Connection, sid: int) -> None:
        if sid not in conn.sessions and len(conn.sessions) >= self.limits.max_sessions:
            raise Refusal("too_many_sessions", f"this connection has {len(conn.sessions)} sessions open, the box's "
                          "limit: close one first")

    # ---- compute side ----
    def _worker(self) -> None:
        while True:
            prio, _, conn, request, work = self.tasks.get()
            if not conn.alive:
                continue
            try:
                more = self._run(conn, request, work)
            except Refusal as r:
                more = None
                conn.send(r.frame(request))
            except Unavailable as e:  # a rank lost: retryable (the back's 503); a restart brings fresh ranks
                more = None
                conn.send(error_frame(request, "rank_unavailable", str(e), retryable=True))
            except Exception as e:  # one request's failure answers that request; the box keeps serving
                more = None
                where = traceback.extract_tb(e.__traceback__)[-1]
                conn.send(error_frame(request, type(e).__name__, f"{e} (at {where.filename}:{where.lineno})",
                                      retryable=False))
            if more is None:
                conn.pending.release()
            else:
                self._enqueue(prio, conn, request, more)

    def _run(self, conn: Connection, request: int, work):
        kind = work[0]
        if kind == "append":
            _, sid, keep, chunk, tail, ids, images = work
            s = conn.sessions.get(sid)
            if s is None:
                if keep:
                    raise ValueError(f"session {sid} is not open on this box (reconnected?): sync it first")
                self._open_session(conn, sid)
                s = conn.sessions[sid] = BoxSession(LocalEncoder(self.model))
            if keep > len(s.tokens) or len(s.tokens) - keep > ROLLBACK_ROWS:
                raise ValueError(f"session {sid} has {len(s.tokens)} tokens; cannot continue from {keep}")
            gen = s.encoder.append(ids, keep, chunk, tail, images)
            del s.tokens[keep:]
            s.spans = [sp for sp in s.spans if sp[0] + sp[1] <= keep] + span_keys(images)
            return self._next_part(conn, request, sid, s, gen, ids, chunk, 0)
        if kind == "part":
            return self._next_part(conn, request, *work[1:])
        if kind == "sync":
            return self._sync(conn, request, *work[1:])
        if kind == "sync_part":
            return self._sync_part(conn, request, *work[1:])
        raise AssertionError(kind)

    def _next_part(self, conn, request, sid, s, gen, ids, chunk, done):
        hand = next(gen)
        rows = hand.rows
        s.tokens.extend(ids[done:done + rows])
        done += rows
        last = done == len(ids)
        # layer d's cache rows cross the link as the state holds them, in the model's FP4 format (356 B per
        # token at the released shapes)
        entries, keys = hand.entries.cpu(), hand.keys.cpu()
        meta = {"session": sid, "rows": rows, "done": done, "total": len(ids), "last": last,
                "hand_start": hand.start, "n_hand": hand.streams.size(0), "n_entries": hand.entries.size(0)}
        conn.send(Frame(FrameType.PART, request, meta, tensors_body([entries, keys, hand.streams, hand.pre_mix])))
        if rows <= MAX_STEP_ROWS:
            self.steps_served += 1
        if last:
            if len(ids) > MAX_STEP_ROWS:
                self._remember(s)
            return None
        return ("part", sid, s, gen, ids, chunk, done)

    def _sync(self, conn, request, sid, ids, images):
        target = cache_key(ids, span_keys(images))  # image spans compare by content, not by token id
        s = conn.sessions.get(sid)
        if s is not None:
            have = s.cache_key()
            common = next((i for i, (a, b) in enumerate(zip(have, target, strict=False)) if a != b),
                          min(len(have), len(target)))
            if len(s.tokens) - common <= ROLLBACK_ROWS and not any(a < common < a + n for a, n, _ in s.spans):
                s.truncate(common)
            else:
                s = None
        cached = 0
        if s is None:
            self._open_session(conn, sid)
            n, blob = self.cache.lookup(target)
            s = BoxSession(LocalEncoder(self.model))
            if blob is not None:
                try:
                    states, tokens, extras = snapshot.decode(blob, self.identity, self.numerics, self.model.device)
                    spans = [tuple(r) for r in extras["image_spans"].tolist()] if "image_spans" in extras else []
                    s = BoxSession(LocalEncoder(self.model, states["encoder"]), tokens, spans)
                    cached = n
                except snapshot.SnapshotError:
                    pass
            conn.sessions[sid] = s
        rest = ids[len(s.tokens):]
        todo = [sp for sp in images if sp.start >= len(s.tokens)]
        s.spans += span_keys(todo)
        gen = s.encoder.append(rest, len(s.tokens), 8192, 0, todo) if rest else iter(())
        return self._sync_part(conn, request, sid, s, gen, rest, 0, cached)

    def _sync_part(self, conn, request, sid, s, gen, rest, done, cached):
        if done < len(rest):
            step = next(gen).rows
            s.tokens.extend(rest[done:done + step])
            return ("sync_part", sid, s, gen, rest, done + step, cached)
        if rest:
            self._remember(s)
        conn.send(Frame(FrameType.SYNCED, request, {"session": sid, "pos": len(s.tokens), "cached": cached}))
        return None

    def _remember(self, s: BoxSession) -> None:
        spans = torch.tensor(s.spans, dtype=torch.int64).view(-1, 3)
        blob = snapshot.encode({"encoder": s.encoder.state}, s.tokens, self.identity, self.numerics,
                               {"image_spans": spans})
        self.cache.put(s.cache_key(), blob)

    def health(self) -> dict:
        """`status` "down" and `ranks_lost` the reason once a rank of its --ep/--tp group is lost (answered 503:
        restart the box, which starts its ranks again; the back re-syncs its sessions from their committed
        tokens)."""
        lost = self.parallel.lost if self.parallel is not None else None
        ranks = {} if self.parallel is None else {"ranks_lost": lost}
        return {"status": "down" if lost else "ok", **ranks, "identity": self.identity, "numerics": self.numerics,
                "sessions": sum(len(c.sessions) for c in self.connections), "connections": len(self.connections),
                "handshaking": self._open - len(self.connections), "max_context": self.max_context,
                "queued_tasks": self.tasks.qsize(), "steps_served": self.steps_served,
                "uptime_s": round(time.time() - self.started, 1), "protocol": VERSION,
                "layout": {"pp": len(self.model.model.ranges), "ep": self.layout.ep, "tp": self.layout.tp}}


def serve_health(box: Box, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path != "/health":
                self.send_error(404)
                return
            health = box.health()
            body = json.dumps(health).encode()
            self.send_response(200 if health["status"] == "ok" else 503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def parse_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    return run_ranked(args, args.model, "box", lambda parallel: _run(args, parallel))


def _run(args: argparse.Namespace, parallel: Sharding | None) -> int:
    """The box on rank 0 (or alone), the encoder half sharded over `parallel` when given."""
    host, port = parse_addr(args.listen)
    if not is_loopback(host) and not args.token:
        print(f"dsflash box: listening on non-loopback {host} needs --token", file=sys.stderr)
        return 2
    limits = Limits(args.max_connections, args.handshake_timeout, args.idle_timeout, args.read_timeout,
                    args.max_sessions, args.max_pending, args.max_context)
    try:
        placed = checked_plan("box", args, args.model, "box")
        if args.verify_weights:
            verify_weights(args.model)
        loading = LayerCount(load_config(Path(args.model)).first_decoder_layer)
        box = Box(args.model, token=args.token, cache_dir=args.cache_dir, device=args.device,
                  cuda_graphs=not args.eager, limits=limits, tiers=tiers_from(args, placed), loaded=loading,
                  ranges=layer_devices(args, args.model, "box"), parallel=parallel)
        loading.close()
    except (CheckpointError, PlacementError) as e:  # damaged weights or no room: say which, serve nothing
        print(f"dsflash box: {e}", file=sys.stderr)
        return 2
    serve_health(box, host, args.health_port if args.health_port is not None else port + 1)
    box.serve(host, port)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("box", help="serve the encoder half (layers 0..d-1 and layer d's cache write) over TCP")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--listen", default="127.0.0.1:7400", help="HOST:PORT (loopback unless --token is given)")
    p.add_argument("--token", help="shared secret the back side must present")
    p.add_argument("--health-port", type=int, help="HTTP port for GET /health (default: listen port + 1)")
    p.add_argument("--cache-dir", help="directory for the box's prefix cache of encoder states")
    p.add_argument("--device", default=default_device(), help="cpu or cuda (default: cuda when present)")
    p.add_argument("--eager", action="store_true", help="run every forward eagerly (no CUDA graphs for short steps)")
    d = Limits()
    p.add_argument("--max-connections", type=int, default=d.max_connections,
                   help=f"open connections at most; one more is answered ERROR busy (default {d.max_connections})")
    p.add_argument("--handshake-timeout", type=float, default=d.handshake_timeout, metavar="S",
                   help=f"seconds a new connection has to complete its HELLO (default {d.handshake_timeout:g})")
    p.add_argument("--idle-timeout", type=float, default=d.idle_timeout, metavar="S",
                   help=f"close a connection silent this long; the back side pings (default {d.idle_timeout:g})")
    p.add_argument("--read-timeout", type=float, default=d.read_timeout, metavar="S",
                   help=f"longest wait for the rest of a frame once it began (default {d.read_timeout:g})")
    p.add_argument("--max-sessions", type=int, default=d.max_sessions,
                   help=f"sessions per connection (default {d.max_sessions})")
    p.add_argument("--max-pending", type=int, default=d.max_pending,
                   help=f"requests queued or running per connection (default {d.max_pending})")
    p.add_argument("--max-context", type=int, help="tokens per session (default: the model's max_seq_len)")
    p.add_argument("--verify-weights", action="store_true",
                   help="check every tensor against the checkpoint's model.manifest.json before loading")
    add_placement_options(p, context=False)
    p.set_defaults(func=run)
