"""`dsflash box`: the encoder half (embed, Engram, layers [0, d), layer d's cache write) served over TCP.

One compute worker takes tasks from a priority queue: a step (at most 8 rows) goes before any prefill
chunk, and a prefill advances one chunk per task, so one session's long prefill never holds up
another's decode step. Each connection has its own sessions; a malformed frame closes only the
connection that sent it.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import itertools
import json
import queue
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from dsflash.engine import snapshot
from dsflash.engine.halves import LocalEncoder
from dsflash.engine.images import SpanKey, cache_key, span_keys
from dsflash.engine.prefix_cache import PrefixCache
from dsflash.engine.runner import Runner
from dsflash.engine.session import MAX_STEP_ROWS, default_device, engine_identity
from dsflash.model.load import load_model
from dsflash.model.state import ROLLBACK_ROWS
from dsflash.numerics import NUMERICS_VERSION
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
    tokens_and_images,
)

MAX_CHUNK = 1 << 16


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
    def __init__(self, sock: socket.socket, peer: str):
        self.sock, self.peer = sock, peer
        self.sessions: dict[int, BoxSession] = {}
        self.send_lock = threading.Lock()
        self.alive = True

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
                 max_frame: int = MAX_FRAME, device: str = "cpu", cuda_graphs: bool = True):
        self.model = Runner(load_model(model_path, half="encoder", device=device), cuda_graphs)
        self.args = self.model.args
        self.identity = engine_identity(self.model.model)
        self.token = token
        self.max_frame = max_frame
        self.cache = PrefixCache(self.identity, ram_bytes=256 << 20, disk_dir=cache_dir)
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
        while True:
            sock, peer = srv.accept()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Connection(sock, f"{peer[0]}:{peer[1]}")
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: Connection) -> None:
        try:
            hello = read_frame(conn.sock, 1 << 16)
            if hello.type != FrameType.HELLO:
                raise ProtocolError("the first frame must be HELLO")
            if self.token is not None and not hmac.compare_digest(str(hello.meta.get("token", "")), self.token):
                conn.send(error_frame(hello.request, "auth", "wrong or missing token", retryable=False))
                return
            if hello.meta.get("identity") != self.identity or hello.meta.get("numerics") != NUMERICS_VERSION:
                conn.send(error_frame(hello.request, "model_mismatch",
                                      f"box serves {self.identity} numerics {NUMERICS_VERSION}, the back side has "
                                      f"{hello.meta.get('identity')} numerics {hello.meta.get('numerics')}",
                                      retryable=False))
                return
            conn.send(Frame(FrameType.WELCOME, hello.request,
                            {"identity": self.identity, "numerics": NUMERICS_VERSION, "protocol": VERSION}))
            self.connections.add(conn)
            while conn.alive:
                self._dispatch(conn, read_frame(conn.sock, self.max_frame))
        except ProtocolError as e:
            conn.send(error_frame(0, "malformed", str(e), retryable=False))
        except (ConnectionError, OSError):
            pass
        finally:
            conn.alive = False
            self.connections.discard(conn)
            conn.sessions.clear()
            try:
                conn.sock.close()
            except OSError:
                pass

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
            ids, images = self._payload(f)
            prio = 0 if len(ids) <= MAX_STEP_ROWS and not images else 1
            self._enqueue(prio, conn, f.request, ("append", sid, keep, chunk, tail, ids, images))
        elif f.type == FrameType.SYNC:
            sid = field_of(f.meta, "session", int, 0)
            ids, images = self._payload(f)
            self._enqueue(1, conn, f.request, ("sync", sid, ids, images))
        else:
            raise ProtocolError(f"unexpected {f.type.name} frame")

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

    def _enqueue(self, prio: int, conn: Connection, request: int, work) -> None:
        self.tasks.put((prio, next(self._order), conn, request, work))

    # ---- compute side ----
    def _worker(self) -> None:
        while True:
            prio, _, conn, request, work = self.tasks.get()
            if not conn.alive:
                continue
            try:
                more = self._run(conn, request, work)
            except Exception as e:  # one request's failure answers that request; the box keeps serving
                where = traceback.extract_tb(e.__traceback__)[-1]
                conn.send(error_frame(request, type(e).__name__, f"{e} (at {where.filename}:{where.lineno})",
                                      retryable=False))
                continue
            if more is not None:
                self._enqueue(prio, conn, request, more)

    def _run(self, conn: Connection, request: int, work):
        kind = work[0]
        if kind == "append":
            _, sid, keep, chunk, tail, ids, images = work
            s = conn.sessions.get(sid)
            if s is None:
                if keep:
                    raise ValueError(f"session {sid} is not open on this box (reconnected?): sync it first")
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
            n, blob = self.cache.lookup(target)
            s = BoxSession(LocalEncoder(self.model))
            if blob is not None:
                try:
                    states, tokens, extras = snapshot.decode(blob, self.identity, self.model.device)
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
        blob = snapshot.encode({"encoder": s.encoder.state}, s.tokens, self.identity, {"image_spans": spans})
        self.cache.put(s.cache_key(), blob)

    def health(self) -> dict:
        return {"status": "ok", "identity": self.identity, "numerics": NUMERICS_VERSION,
                "sessions": sum(len(c.sessions) for c in self.connections), "connections": len(self.connections),
                "queued_tasks": self.tasks.qsize(), "steps_served": self.steps_served,
                "uptime_s": round(time.time() - self.started, 1), "protocol": VERSION}


def serve_health(box: Box, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path != "/health":
                self.send_error(404)
                return
            body = json.dumps(box.health()).encode()
            self.send_response(200)
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
    host, port = parse_addr(args.listen)
    if not is_loopback(host) and not args.token:
        print(f"dsflash box: listening on non-loopback {host} needs --token", file=sys.stderr)
        return 2
    box = Box(args.model, token=args.token, cache_dir=args.cache_dir, device=args.device,
              cuda_graphs=not args.eager)
    serve_health(box, host, args.health_port if args.health_port is not None else port + 1)
    box.serve(host, port)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("box", help="serve the encoder half (layers 0..d-1 and layer d's cache write) over TCP")
    p.add_argument("--model", required=True)
    p.add_argument("--listen", default="127.0.0.1:7400", help="HOST:PORT (loopback unless --token is given)")
    p.add_argument("--token", help="shared secret the back side must present")
    p.add_argument("--health-port", type=int, help="HTTP port for GET /health (default: listen port + 1)")
    p.add_argument("--cache-dir", help="directory for the box's prefix cache of encoder states")
    p.add_argument("--device", default=default_device(), help="cpu or cuda (default: cuda when present)")
    p.add_argument("--eager", action="store_true", help="run every forward eagerly (no CUDA graphs for short steps)")
    p.set_defaults(func=run)
