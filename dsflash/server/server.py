"""The request side of the server over one Worker: prompts from conversations, jobs checked against the
context and the vocabulary, and the worker's events as an async stream that cancels the job when the
client goes away."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from fastapi import Request

from dsflash.engine.prefix_cache import PrefixCache
from dsflash.engine.sampling import SamplingParams
from dsflash.engine.session import DEFAULT_CHUNK, ContextLengthError, Engine
from dsflash.server.dsml import Collected, DsmlParser
from dsflash.server.encoding import EncodingError, encode_messages
from dsflash.server.errors import ApiError
from dsflash.server.images import ImageError, Images
from dsflash.server.metrics import Metrics
from dsflash.server.params import MessagesRequest, Sampling, json_mode, sampling_params, stop_list
from dsflash.server.worker import Done, Failed, Job, Worker
from dsflash.split.link import BoxUnavailable
from dsflash.tokenizer import token_bytes

DISCONNECT_CHECK_S = 0.25  # how often a generation looks whether its client is still there


class Server:
    def __init__(self, engine: Engine, tokenizer, cache: PrefixCache | None, model_name: str, dspark: int,
                 chunk: int = DEFAULT_CHUNK):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.metrics = Metrics()
        if engine.encoder.reconnects is not None:  # a box
            self.metrics.box_reconnects = lambda: engine.encoder.reconnects
        self.worker = Worker(engine, tokenizer, cache, dspark, self.metrics, chunk)
        self.created = int(time.time())
        self.draining = False  # set by a shutdown: new generations are refused
        # no token covers more bytes of text than the longest, so a longer text than the context times that
        # cannot fit, and is refused before it is tokenized (tokenizing 50 MB took minutes and 9 GB); a
        # normalizer could lengthen the text, so then there is no such bound
        self.max_text_bytes = None if tokenizer.normalizer is not None else engine.max_context * max(
            [len(b) for b in token_bytes(tokenizer) if b is not None]
            + [len(t.content.encode()) for t in tokenizer.get_added_tokens_decoder().values()])
        # prompts are built and tokenized here, off the event loop, so /health and other clients get answers
        # meanwhile
        self.prep = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dsflash-prep")

    async def off_loop(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """`fn(*args, **kwargs)` on the prompt-building threads."""
        return await asyncio.get_running_loop().run_in_executor(self.prep, partial(fn, *args, **kwargs))

    def tokenize(self, text: str, field: str = "messages") -> list[int]:
        """`text`'s tokens (checked by `check_size` first)."""
        self.check_size(text, field)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def check_size(self, text: str, field: str) -> None:
        """Refuse, untokenized, a text too long for the context in any tokenization."""
        size = len(text.encode("utf-8"))
        if self.max_text_bytes is not None and size > self.max_text_bytes:
            limit = self.engine.max_context
            raise ApiError(400, f"This model's maximum context length is {limit} tokens; the {field} text has "
                                f"{size} bytes, more than {limit} tokens can hold ({self.max_text_bytes} bytes).",
                           field, "context_length_exceeded", extra={"text_bytes": size, "max_context": limit})

    async def drain(self, timeout: float) -> None:
        """A shutdown: refuse new generations, give the running ones `timeout` seconds, then cancel the rest
        (streams end with their finish reason, the others answer with what they have)."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.worker.busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.worker.cancel_all()

    def chat_job(self, req: Sampling | MessagesRequest, messages: list[dict], tools: list[dict] | None,
                 forced: tuple[str, ...], thinking: bool, images: Images, arrived: float, *,
                 max_tokens: int | None, stop: str | list[str] | None, effort: int | None = None,
                 top_logprobs: int | None = None, fmt: Any = None, fmt_field: str = "response_format") -> Job:
        """The job of a conversation (chat completions, Anthropic messages, Responses) in OpenAI's form with
        its images marked: the encoded prompt and its image spans, `req`'s sampling, the stop strings, the
        forced tools, and the answer's format `fmt` (read as `json_mode` does, named `fmt_field`)."""
        try:
            text = encode_messages(messages, tools, thinking, effort)
        except EncodingError as e:
            raise ApiError(400, str(e), str(e).split(":")[0]) from e
        self.check_size(text, "messages")  # the whole prompt; its pieces between images are tokenized apart
        try:
            prompt, spans = images.prompt(text, self.tokenize, self.engine)
        except ImageError as e:
            raise ApiError(400, str(e), e.field) from e
        # the generation-prompt tail `<think>`/`</think>` differs from the next turn's text; snapshot before it
        job = self.job(prompt, max_tokens, sampling_params(req), stop_list(stop), top_logprobs, len(prompt) - 1,
                       arrived)
        job.images, job.forced_tools, job.thinking = spans, forced, thinking
        job.json_mode, job.json_schema = json_mode(fmt, fmt_field, forced)
        return job

    def job(self, prompt: list[int], max_tokens: int | None, params: SamplingParams, stop: list[str],
            top_logprobs: int | None, split: int, arrived: float) -> Job:
        """A job of `prompt`, refused when it leaves no room to generate `max_tokens` (None: up to the
        context), or when the sampling names tokens outside the vocabulary."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="shutting_down", kind="server_error",
                           headers={"Retry-After": "5", "Connection": "close"})
        limit = self.engine.max_context
        if len(prompt) >= limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens; the prompt has "
                                f"{len(prompt)} tokens, which leaves no room to generate.",
                           "messages", "context_length_exceeded",
                           extra={"prompt_tokens": len(prompt), "max_context": limit})
        vocab = self.engine.args.vocab_size
        if any(t >= vocab for t, _ in params.logit_bias):
            raise ApiError(400, f"logit_bias: token ids must be below the vocabulary size {vocab}", "logit_bias")
        if any(t >= vocab for t in params.end_ids):
            raise ApiError(400, f"stop_token_ids: token ids must be below the vocabulary size {vocab}",
                           "stop_token_ids")
        room = limit - len(prompt)
        if max_tokens is not None and max_tokens > room:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens; the request asks for "
                                f"{len(prompt) + max_tokens} ({len(prompt)} in the prompt, {max_tokens} to generate).",
                           "max_tokens", "context_length_exceeded",
                           extra={"prompt_tokens": len(prompt), "max_tokens": max_tokens, "max_context": limit})
        return Job(prompt, max_tokens or room, params, stop, top_logprobs, split, arrived)

    async def collect(self, job: Job, request: Request, thinking: bool) -> tuple[Collected, list[dict], Done]:
        """Run `job` to the end: the parsed reply, the logprob entries, and the Done event."""
        parser, got, lps, done = DsmlParser(thinking), Collected(), [], None
        async for ev in self.events(job, request):
            if isinstance(ev, Done):
                done = ev
                got.add(parser.finish())
            else:
                lps.extend(ev.logprobs)
                got.add(parser.feed(ev.text))
        return got, lps, done

    async def events(self, job: Job, request: Request) -> AsyncIterator[Any]:
        """Run `job` on the worker; yield its Text events, then Done. Cancels on client disconnect."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self.worker.submit(job, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev))
        check = time.monotonic() + DISCONNECT_CHECK_S
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(queue.get(), timeout=DISCONNECT_CHECK_S)
                except TimeoutError:
                    ev = None
                # on a clock, not only when no token came: a non-streamed request has nothing else that
                # would notice its client leaving while tokens flow
                if time.monotonic() >= check:
                    check = time.monotonic() + DISCONNECT_CHECK_S
                    if await request.is_disconnected():
                        job.cancel.set()
                if ev is None:
                    continue
                if isinstance(ev, Failed):
                    if isinstance(ev.error, ContextLengthError):
                        raise ApiError(400, str(ev.error), "messages", "context_length_exceeded")
                    if isinstance(ev.error, BoxUnavailable):  # retryable; never another model's answer
                        raise ApiError(503, str(ev.error), code="box_unavailable", kind="server_error",
                                       headers={"Retry-After": str(BoxUnavailable.retry_after)})
                    raise ev.error
                yield ev
                if isinstance(ev, Done):
                    return
        finally:
            job.cancel.set()  # no-op after Done; stops generation if the consumer went away
