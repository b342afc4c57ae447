"""Server-sent events: the stream response with keepalives and prefill progress, the merging of n choice
streams, and the OpenAI `data:` lines with their usage."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi.responses import StreamingResponse

from dsflash.server.errors import ApiError
from dsflash.server.metrics import Metrics
from dsflash.server.worker import Done, Job

KEEPALIVE_S = 5.0


async def with_keepalive(events: AsyncIterator[str], job: Job, progress_event: Callable[[dict], str] | None
                         ) -> AsyncIterator[str]:
    """An SSE stream with a comment line every KEEPALIVE_S while nothing else is sent (a long prefill),
    and, when the request asked for it, the prefill progress as it changes."""
    it = events.__aiter__()
    pending = asyncio.ensure_future(it.__anext__())
    last_sent, last_progress = time.monotonic(), None
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=0.25)
            if not done:
                if progress_event is not None and job.progress is not None and job.progress is not last_progress:
                    last_progress = job.progress
                    last_sent = time.monotonic()
                    yield progress_event(last_progress)
                elif time.monotonic() - last_sent >= KEEPALIVE_S:
                    last_sent = time.monotonic()
                    yield ": keepalive\n\n"
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            if progress_event is not None and job.progress is not None and job.progress is not last_progress:
                last_progress = job.progress  # the last update before the first token, too
                yield progress_event(last_progress)
            last_sent = time.monotonic()
            yield item
            pending = asyncio.ensure_future(it.__anext__())
    finally:
        pending.cancel()


def event_stream(events: AsyncIterator[str], job: Job, progress_event: Callable[[dict], str] | None = None
                 ) -> StreamingResponse:
    """The SSE response of `events`, with keepalives (and the prefill progress of `job` when asked)."""
    return StreamingResponse(with_keepalive(events, job, progress_event), media_type="text/event-stream")


class _Raised:
    def __init__(self, error: BaseException):
        self.error = error


async def merged(streams: list[AsyncIterator[Any]]) -> AsyncIterator[Any]:
    """The items of several async streams as they come (each stream's own order kept); the first error
    of any stream is raised and the others are cancelled."""
    queue: asyncio.Queue = asyncio.Queue()
    finished = object()

    async def pump(stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put(item)
        except Exception as e:  # handed to the consumer, raised there
            await queue.put(_Raised(e))
        finally:
            await queue.put(finished)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is finished:
                running -= 1
            elif isinstance(item, _Raised):
                raise item.error
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


async def choice_stream(choices: list[AsyncIterator[Any]], sse: Callable[..., str], include_usage: bool,
                        metrics: Metrics) -> AsyncIterator[str]:
    """The SSE lines of n choices: each choice's chunk dicts as they come (`sse([chunk])`), the usage of all
    of them when asked, one error event if any fails, then [DONE]. A choice stream ends with its Done."""
    dones: list[Done] = []
    try:
        async for item in merged(choices):
            if isinstance(item, Done):
                dones.append(item)
            else:
                yield sse([item])
        if include_usage:
            yield sse([], usage=usage(total(dones)))
    except ApiError as e:
        metrics.inc(metrics.errors, e.code or "invalid_request")
        yield sse_data({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}})
    except Exception as e:
        metrics.inc(metrics.errors, "internal")
        yield sse_data({"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error"}})
    yield "data: [DONE]\n\n"


def total(dones: list[Done]) -> Done:
    """One Done for the usage of n choices: the prompt once, the completions summed."""
    return replace(dones[0], completion_tokens=sum(d.completion_tokens for d in dones),
                   reasoning_tokens=sum(d.reasoning_tokens for d in dones))


def sse_data(obj: Any) -> str:
    """One `data:` event of JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(done: Done) -> dict:
    """OpenAI's usage object of a generation."""
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": done.reasoning_tokens}}
