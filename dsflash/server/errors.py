"""Request errors and their bodies: OpenAI's error object, or Anthropic's on the Anthropic paths."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", extra: dict | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.extra = extra or {}
        self.headers = headers


def loc_name(loc: tuple) -> str:
    """A validation error's location as a field path: ("body", "messages", 0, "role") -> messages[0].role."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def error_response(e: ApiError, path: str) -> JSONResponse:
    """`e` in the dialect of the request's `path`: Anthropic's body under /v1/messages, OpenAI's elsewhere."""
    return _anthropic_error(e) if path.startswith("/v1/messages") else _openai_error(e)


def _openai_error(e: ApiError) -> JSONResponse:
    body = {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code, **e.extra}}
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def _anthropic_error(e: ApiError) -> JSONResponse:
    kind = ("authentication_error" if e.status == 401 else "not_found_error" if e.status == 404
            else "invalid_request_error" if e.status < 500
            else "overloaded_error" if e.status == 503 else "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": e.message}}, status_code=e.status,
                        headers=e.headers)
