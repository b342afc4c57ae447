"""The request side of the server over one Worker: prompts from conversations, jobs checked against the
context and the vocabulary, and the worker's events as an async stream that cancels the job when the
client goes away."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from fastapi import Request

from dsflash.engine.prefix_cache import PrefixCache
from dsflash.engine.sampling import SamplingParams
from dsflash.engine.session import DEFAULT_CHUNK, ContextLengthError, Engine
from dsflash.parallel.group import Unavailable
from dsflash.server.dsml import Collected, DsmlParser
from dsflash.server.encoding import EncodingError, encode_messages
from dsflash.server.errors import ApiError
from dsflash.server.images import ImageError, Images
from dsflash.server.metrics import Metrics
from dsflash.server.params import MessagesRequest, Sampling, json_mode, sampling_params, stop_list
from dsflash.server.replay import Replays, Reply, tokenize_with
from dsflash.server.worker import Done, Failed, Job, Worker
from dsflash.split.link import BoxUnavailable
from dsflash.tokenizer import EOS_ID, token_bytes

DISCONNECT_CHECK_S = 0.25  # how often a generation looks whether its client is still there


class Server:
    def __init__(self, engine: Engine, tokenizer, cache: PrefixCache | None, model_name: str, dspark: int,
                 chunk: int = DEFAULT_CHUNK, thinking: bool = True):
        # the names requests may give (comma-separated, as --served-model-name takes them); the first is reported
        self.model_names = tuple(n.strip() for n in model_name.split(",") if n.strip()) or ("dsflash",)
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, self.model_names[0]
        self.thinking = thinking  # the default of every endpoint (app.create_app says which)
        self.metrics = Metrics()
        if engine.encoder.reconnects is not None:  # a box
            self.metrics.box_reconnects = lambda: engine.encoder.reconnects
        self.metrics.tier_stats = engine.tier_stats
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
        # beside the prefix cache's snapshots, named by the model (another model's ids are no replay of this one's)
        journal = cache.disk / f"replays-{engine.identity[:16]}.jsonl" if cache is not None and cache.disk else None
        self.replays = Replays(journal=journal)

    def remember(self, done: Done, thinking: bool, got: Collected, call_ids: Sequence[str]) -> None:
        """Keep a reply that ended with EOS after whole tool calls (`call_ids`: the ids the client got for
        them, in order) for the exact replay of its tokens when the client sends it back (replay.py)."""
        closed = sorted(got.closed)
        if done.finish != "stop" or done.stop_string is not None or not closed or done.tokens[-1:] != [EOS_ID]:
            return
        try:  # (an unforced call's arguments may be no JSON: such a reply is re-rendered, as the client sends it)
            calls = tuple((cid, got.calls[i].name, json.loads(got.calls[i].arguments))
                          for cid, i in zip(call_ids, closed, strict=True))
        except json.JSONDecodeError:
            return
        self.replays.remember(Reply(tuple(done.tokens), thinking, "".join(got.content), "".join(got.reasoning),
                                    calls))

    def check_model(self, name: str | None) -> None:
        """Refuse (404, each API's shape) a request for a model this server does not serve; none named is fine."""
        if name is not None and name not in self.model_names:
            raise ApiError(404, f"The model `{name}` does not exist: this server serves "
                                f"{', '.join(self.model_names)}", "model", "model_not_found", kind="not_found_error")

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
                 forced: tuple[tuple[str, Any], ...], thinking: bool | None, images: Images, arrived: float, *,
                 max_tokens: int | None, stop: str | list[str] | None, effort: int | None = None,
                 top_logprobs: int | None = None, fmt: Any = None, fmt_field: str = "response_format",
                 budget: int | None = None, field: str = "messages") -> Job:
        """The job of a conversation (chat completions, Anthropic messages, Responses) in OpenAI's form with
        its images marked: the encoded prompt and its image spans, `req`'s sampling, the stop strings, the
        forced tools, and the answer's format `fmt` (read as `json_mode` does, named `fmt_field`). `thinking`
        None: the server's default; `budget`: the reasoning's cap in tokens; `field`: the request's field of
        the conversation, named by a context-length error."""
        thinking = self.thinking if thinking is None else thinking
        prompt, spans = self.prompt(messages, tools, thinking, images, effort, field)
        # the generation-prompt tail `<think>`/`</think>` differs from the next turn's text; snapshot before it
        job = self.job(prompt, max_tokens, sampling_params(req), stop_list(stop), top_logprobs, len(prompt) - 1,
                       arrived, field)
        job.images, job.forced_tools, job.thinking, job.reasoning_budget = spans, forced, thinking, budget
        job.skip_special = getattr(req, "skip_special_tokens", True)
        job.json_mode, job.json_schema = json_mode(fmt, fmt_field, forced)
        return job

    def prompt(self, messages: list[dict], tools: list[dict] | None, thinking: bool, images: Images,
               effort: int | None = None, field: str = "messages") -> tuple[list[int], list]:
        """The token ids of a conversation's prompt (V4.1 encoding, sampled tool-call turns replayed as they
        were sampled) and its image spans; a prompt too long for the context in any tokenization is refused
        untokenized, naming `field`."""
        verbatim, replayed = self.replays.marked(messages)
        try:
            text = encode_messages(messages, tools, thinking, effort, verbatim=verbatim)
        except EncodingError as e:
            raise ApiError(400, str(e), str(e).split(":")[0]) from e
        self.check_size(text, field)  # the whole prompt; its pieces between images are tokenized apart
        try:
            return images.prompt(text, tokenize_with(self.tokenize, replayed), self.engine)
        except ImageError as e:
            raise ApiError(400, str(e), e.field) from e

    def job(self, prompt: list[int], max_tokens: int | None, params: SamplingParams, stop: list[str],
            top_logprobs: int | None, split: int, arrived: float, field: str = "messages") -> Job:
        """A job of `prompt`, refused when it leaves no room to generate `max_tokens` (None: up to the
        context), or when the sampling names tokens outside the vocabulary. `field`: the request's field
        of the prompt (messages, input, prompt), named by a context-length error."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="shutting_down", kind="server_error",
                           headers={"Retry-After": "5", "Connection": "close"})
        limit = self.engine.max_context
        if len(prompt) >= limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens; the prompt has "
                                f"{len(prompt)} tokens, which leaves no room to generate.",
                           field, "context_length_exceeded",
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
        job = Job(prompt, max_tokens or room, params, stop, top_logprobs, split, arrived)
        job.prompt_field = field
        return job

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
                        raise ApiError(400, str(ev.error), job.prompt_field, "context_length_exceeded")
                    if isinstance(ev.error, Unavailable):  # box or rank down: retryable; never another model's answer
                        code = "box_unavailable" if isinstance(ev.error, BoxUnavailable) else "rank_unavailable"
                        raise ApiError(503, str(ev.error), code=code, kind="server_error",
                                       headers={"Retry-After": str(ev.error.retry_after)})
                    raise ev.error
                yield ev
                if isinstance(ev, Done):
                    return
        finally:
            job.cancel.set()  # no-op after Done; stops generation if the consumer went away
