"""HTTP server: OpenAI chat/completions, Anthropic messages, the Responses API, health and Prometheus
metrics over one Engine.

Generations run on the decode worker (`worker.py`: turns tokens into text, applies stop strings, posts
events to the request); the request side (`server.py`) builds jobs and streams the worker's events; each
API dialect (`openai.py`, `anthropic.py`, `responses.py`) parses reasoning/content/DSML tool calls and
formats its own responses. A client that goes away (stream or not) sets the job's cancel flag, which
`decode(stopped=...)` checks every token. Before any of that, `limits.py` bounds what a request may take
(body size and read time, generation requests in flight) and, with a key, `ApiKeyGuard` checks it.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsflash.engine.prefix_cache import PrefixCache
from dsflash.engine.session import DEFAULT_CHUNK, Engine
from dsflash.server import MAX_BODY, MAX_QUEUE, REQUEST_TIMEOUT_S, anthropic, openai, responses
from dsflash.server.errors import ApiError, error_response, loc_name
from dsflash.server.limits import RequestLimits
from dsflash.server.metrics import Metrics
from dsflash.server.server import Server

OPEN_PATHS = frozenset({"/health", "/metrics"})  # for probes and scrapers, without the API key


class ApiKeyGuard:
    """ASGI middleware: requests without the key get `refuse(path)`, on every path but OPEN_PATHS (the API,
    and /docs and /openapi.json, which describe it). Plain ASGI rather than BaseHTTPMiddleware, so
    streamed responses and disconnect detection pass through untouched."""

    def __init__(self, app, key: str, refuse: Callable[[str], JSONResponse]):
        self.app, self.key, self.refuse = app, key.encode(), refuse

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = dict(scope["headers"])
            bearer = headers.get(b"authorization", b"")
            given = bearer[7:] if bearer[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
            if not hmac.compare_digest(given, self.key):
                await self.refuse(scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine: Engine, tokenizer, cache: PrefixCache | None = None, model_name: str = "deepseek-v4.1-flash",
               dspark: int = 0, prefix_cache: bool = True, chunk: int = DEFAULT_CHUNK,
               api_key: str | None = None, thinking: bool = True, max_body: int = MAX_BODY,
               request_timeout: float = REQUEST_TIMEOUT_S, max_queue: int = MAX_QUEUE) -> FastAPI:
    """The HTTP app. Without `cache`, a RAM-only prefix cache is made (unless `prefix_cache` is False).
    `chunk`: prefill chunk size (the prefix-cache snapshot grid and the progress granularity).
    `api_key`: when set, every request needs it as `Authorization: Bearer KEY` (OpenAI clients) or
    `x-api-key: KEY` (Anthropic clients); /health and /metrics stay open for probes. `thinking`: whether a
    request that does not say reasons (every endpoint alike; `dsflash serve` takes it from the checkpoint:
    off for a model that never learnt to, see checkpoint.manifest.thinks). `max_body`: the largest request
    body in bytes (413 past it); `request_timeout`: seconds for a body to arrive (408 past it); `max_queue`:
    generation requests that may wait beyond the running ones (503 and Retry-After past it)."""
    if cache is None and prefix_cache:
        cache = engine.prefix_cache()
    srv = Server(engine, tokenizer, cache, model_name, dspark, chunk, thinking)
    app = FastAPI(title="dsflash", version="0.1")
    app.state.server = srv
    m = srv.metrics

    def refuse_limit(err: ApiError, path: str) -> JSONResponse:
        m.inc(m.errors, err.code)
        return error_response(err, path)

    app.add_middleware(RequestLimits, max_body=max_body, body_timeout=request_timeout,
                       max_inflight=srv.worker.concurrency + max_queue, refuse=refuse_limit)
    if api_key:  # added last, so it runs first: no body is read for a request without the key
        def refuse(path: str) -> JSONResponse:
            m.inc(m.errors, "invalid_api_key")
            return error_response(ApiError(401, "missing or incorrect API key", code="invalid_api_key",
                                           kind="authentication_error"), path)

        app.add_middleware(ApiKeyGuard, key=api_key, refuse=refuse)
    _error_handlers(app, m)

    @app.get("/health")
    async def health():
        out = {"status": "ok", "model": model_name, "queued": m.queued, "running": m.running}
        if engine.parallel is not None:  # --ep/--tp: a lost rank answers every request 503 until a restart
            layout = engine.parallel.layout
            out["layout"] = {"pp": len(engine.parallel.stages), "ep": layout.ep, "tp": layout.tp}
            out["ranks_lost"] = engine.parallel.lost
            if engine.parallel.lost:
                out["status"] = "down"
                return JSONResponse(out, status_code=503)
        link = getattr(engine.encoder, "link", None)  # a box half holds its link; the local half has none
        if link is not None:
            out["box"] = {"address": f"{link.addr[0]}:{link.addr[1]}", "connected": link.connected,
                          "reconnects": link.reconnects}
            if not link.connected:  # requests get 503 meanwhile: a load balancer should look elsewhere
                out["status"] = "degraded"
                return JSONResponse(out, status_code=503)
        return out

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(m.render(), media_type="text/plain; version=0.0.4")

    for dialect in (openai, anthropic, responses):
        dialect.add_routes(app, srv)
    return app


def _error_handlers(app: FastAPI, m: Metrics) -> None:
    """Every failure as an error body of the request's dialect, counted by kind."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
        name = loc_name(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            msg, name = f"body: malformed JSON ({first.get('ctx', {}).get('error', first.get('msg'))})", "body"
        else:
            msg = f"{name or 'body'}: {first.get('msg')}"
        m.inc(m.errors, "invalid_request")
        return error_response(ApiError(400, msg, name or "body"), request.url.path)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        m.inc(m.errors, exc.code or ("invalid_request" if exc.status < 500 else "internal"))
        return error_response(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        m.inc(m.errors, f"http_{exc.status_code}")
        err = ApiError(exc.status_code, str(exc.detail), kind="not_found_error" if exc.status_code == 404
                       else "invalid_request_error")
        return error_response(err, request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        m.inc(m.errors, "internal")
        err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")
        return error_response(err, request.url.path)
