"""What one HTTP request may take, and a shutdown with a bound: the request body's size and read time and
the number of generation requests in flight (an ASGI middleware, before the app parses anything), a
deadline on a request's headers (uvicorn's h11 protocol), and a SIGTERM that ends running generations
cleanly after a grace period (uvicorn's server)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable
from functools import partial

import h11
import uvicorn
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from dsflash.server.errors import ApiError

# the paths whose requests become generations, and so wait for the engine
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"})
FLUSH_S = 3.0  # after a shutdown's cancel: for the ended generations to send their last events
RETRY_AFTER_S = 2  # what a client refused for a full queue is told to wait


def size_text(n: int) -> str:
    for unit, size in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


class RequestLimits:
    """ASGI middleware: a generation request past `max_inflight` in flight gets 503 with Retry-After
    before its body is read; a body over `max_body` bytes gets 413 (from its Content-Length, before any
    of it is read, or as soon as the bytes received pass the limit); a body not received within
    `body_timeout` seconds gets 408. The app then reads the body from memory."""

    def __init__(self, app, max_body: int, body_timeout: float, max_inflight: int,
                 refuse: Callable[[ApiError, str], JSONResponse]):
        self.app, self.max_body, self.body_timeout, self.max_inflight = app, max_body, body_timeout, max_inflight
        self.refuse = refuse
        self.inflight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        generation = scope["method"] == "POST" and path in GENERATION_PATHS
        if generation and self.inflight >= self.max_inflight:
            await self._refuse(scope, receive, send, ApiError(
                503, f"the server is busy: {self.max_inflight} generation requests in flight (--max-queue); "
                     f"retry later", code="queue_full", kind="server_error",
                headers={"Retry-After": str(RETRY_AFTER_S)}))
            return
        too_big = ApiError(413, f"body: larger than the server's limit of {size_text(self.max_body)} (--max-body)",
                           "body", "body_too_large", extra={"max_body": self.max_body})
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body:
            await self._refuse(scope, receive, send, too_big)
            return
        chunks, size, deadline = [], 0, time.monotonic() + self.body_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                await self._refuse(scope, receive, send, ApiError(
                    408, f"body: not received within {self.body_timeout:g} s (--request-timeout)", "body",
                    "request_timeout"))
                return
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if size > self.max_body:
                await self._refuse(scope, receive, send, too_big)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
        chunks.clear()

        async def replay():
            # the body once; then the connection's own messages (its disconnect, which generations watch)
            return body.pop() if body else await receive()

        if not generation:
            await self.app(scope, replay, send)
            return
        self.inflight += 1
        try:
            await self.app(scope, replay, send)
        finally:
            self.inflight -= 1

    async def _refuse(self, scope, receive, send, error: ApiError) -> None:
        # the unread rest of the body is not wanted: the connection closes after the answer
        error.headers = {**(error.headers or {}), "Connection": "close"}
        await self.refuse(error, scope["path"])(scope, receive, send)


class HeaderDeadlineH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers, counted from the connection's
    opening or the previous response: uvicorn's own keep-alive timer stops at the first byte received, so
    a client sending a header byte now and then held its connection forever."""

    def __init__(self, *args, header_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self.header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the headers are in
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm()  # the next request's headers

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self.header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _headers_late(self) -> None:
        self.header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.info("closing a connection whose request headers took over %g s", self.header_timeout)
            self.transport.close()


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose shutdown first runs `drain` (stop taking generations, give the running ones
    their grace period, cancel the rest), then waits at most FLUSH_S for the responses to finish."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]):
        super().__init__(config)
        self.drain = drain

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:  # no new connections while draining
            server.close()
        await self.drain()
        await super().shutdown(sockets)


def serve(app, host: str, port: int, log_level: str, request_timeout: float, shutdown_timeout: float) -> None:
    """Serve `app` (of `create_app`) until SIGTERM or Ctrl-C, then shut down within about
    `shutdown_timeout` + FLUSH_S seconds. A request's headers, and then its body, each get
    `request_timeout` seconds."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=FLUSH_S,
                            http=partial(HeaderDeadlineH11, header_timeout=request_timeout))
    server = DrainingServer(config, lambda: app.state.server.drain(shutdown_timeout))
    # uvicorn raises the signal again once it has shut down, to end the process the signal's way; the
    # shutdown was clean, so the process ends with status 0 instead
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
