"""HTTP server: OpenAI chat/completions, Anthropic messages, health and Prometheus metrics over one Engine.

All engine work runs on one worker thread (a single-thread executor: one generation at a time, requests
served FIFO). The worker turns tokens into text, applies stop strings, and posts events to the request's
asyncio queue; the request side parses reasoning/content/DSML tool calls and formats the response. A client
that goes away (stream or not) sets the job's cancel flag, which `decode(stopped=...)` checks every token.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsflash.engine.json_mode import JsonObject, Node, SchemaError, compile_schema, schema_start
from dsflash.engine.prefix_cache import PrefixCache
from dsflash.engine.sampling import Constraint, Forcing, SamplingParams, logprobs
from dsflash.engine.session import DEFAULT_CHUNK, ContextLengthError, Engine
from dsflash.engine.spec import DecodeStats, decode
from dsflash.server.dsml import (
    Collected,
    ContentDelta,
    DsmlParser,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallStart,
)
from dsflash.server.encoding import (
    DSML_ATTRIBUTES_END,
    DSML_CALLS_OPEN,
    DSML_INVOKE_OPEN,
    THINK_END,
    TOOL_CALLS_SEPARATOR,
    EncodingError,
    encode_messages,
)
from dsflash.server.images import ImageError, Images
from dsflash.split.link import BoxUnavailable
from dsflash.tokenizer import BOS_ID, EOS_ID, token_bytes

REASONING_LEVELS = {"none": None, "minimal": 10, "low": 25, "medium": 50, "high": 75, "xhigh": 100, "max": 100}


# ---------------------------------------------------------------------------------------------- errors


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", extra: dict | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.extra = extra or {}
        self.headers = headers


def _loc_name(loc: tuple) -> str:
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


# --------------------------------------------------------------------------------------------- metrics


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.count += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.prompt_tokens = self.prefill_tokens = self.generated_tokens = self.cached_tokens = 0
        self.drafted = self.accepted = 0
        self.box_reconnects: Callable[[], int] | None = None  # read from the box link, when split
        self.ttft = Histogram((0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.itl = Histogram((0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.queued = 0
        self.running = 0

    def inc(self, table: dict[str, int], key: str) -> None:
        with self.lock:
            table[key] = table.get(key, 0) + 1

    def render(self) -> str:
        with self.lock:
            lines = []

            def counter(name: str, help_: str, values: dict[str, int] | int, label: str = "") -> None:
                lines.append(f"# HELP {name} {help_}")
                lines.append(f"# TYPE {name} counter")
                if isinstance(values, dict):
                    for k, v in sorted(values.items()):
                        lines.append(f'{name}{{{label}="{k}"}} {v}')
                else:
                    lines.append(f"{name} {values}")

            def hist(name: str, help_: str, h: Histogram) -> None:
                lines.append(f"# HELP {name} {help_}")
                lines.append(f"# TYPE {name} histogram")
                for b, c in zip(h.buckets, h.counts, strict=True):
                    lines.append(f'{name}_bucket{{le="{b}"}} {c}')
                lines.append(f'{name}_bucket{{le="+Inf"}} {h.count}')
                lines.append(f"{name}_sum {h.sum}")
                lines.append(f"{name}_count {h.count}")

            counter("dsflash_requests_total", "HTTP requests by endpoint.", self.requests, "endpoint")
            counter("dsflash_errors_total", "Failed requests by kind.", self.errors, "kind")
            counter("dsflash_prompt_tokens_total", "Prompt tokens of generation requests.", self.prompt_tokens)
            counter("dsflash_prefill_tokens_total", "Prompt tokens actually prefilled (not from the cache).",
                    self.prefill_tokens)
            counter("dsflash_cached_tokens_total", "Prompt tokens resumed from the prefix cache.", self.cached_tokens)
            counter("dsflash_generated_tokens_total", "Generated tokens.", self.generated_tokens)
            counter("dsflash_draft_tokens_total", "DSpark draft tokens verified.", self.drafted)
            counter("dsflash_draft_accepted_total", "DSpark draft tokens accepted.", self.accepted)
            if self.box_reconnects is not None:
                counter("dsflash_box_reconnects_total", "Reconnections to the box.", self.box_reconnects())
            hist("dsflash_time_to_first_token_seconds", "Request arrival to first generated token.", self.ttft)
            hist("dsflash_inter_token_latency_seconds", "Time between generated tokens.", self.itl)
            lines.append("# HELP dsflash_queue_depth Generation requests waiting for the engine.")
            lines.append("# TYPE dsflash_queue_depth gauge")
            lines.append(f"dsflash_queue_depth {self.queued}")
            lines.append("# HELP dsflash_running Generation requests running on the engine.")
            lines.append("# TYPE dsflash_running gauge")
            lines.append(f"dsflash_running {self.running}")
            return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- worker


@dataclass
class Job:
    prompt: list[int]
    max_new: int
    params: SamplingParams
    stop: list[str]
    top_logprobs: int | None  # None: no logprobs
    split: int  # also snapshot the prompt at this length (before the generation-prompt tail)
    arrived: float
    cancel: threading.Event = field(default_factory=threading.Event)
    # prefill progress as llama.cpp reports it: total, cache, processed, time_ms (set by the worker thread)
    progress: dict | None = None
    images: list = field(default_factory=list)  # ImageSpan of the prompt's images
    forced_tools: tuple[str, ...] = ()  # one of these tools must be called (tool_choice required / named)
    json_mode: bool = False  # the answer is a JSON object (response_format json_object / json_schema)
    json_schema: Node | None = None  # ... following this schema
    thinking: bool = False  # with either: the constraint starts at the reasoning's end


@dataclass
class Text:
    text: str
    logprobs: list[dict]


@dataclass
class Done:
    finish: str  # stop | length | cancelled
    stop_string: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    stats: dict


@dataclass
class Failed:
    error: Exception


class StopScanner:
    """Stop strings over the text of a generation as it grows: what may be sent so far, holding back text
    that could be the start of a stop string (and a partial UTF-8 character) until later text shows what
    it is."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # the text so far (cut before the stop string, once one matched)
        self.sent = 0  # characters of it handed out

    def feed(self, text: str) -> tuple[str, str | None]:
        """`text`: all the text decoded so far (not just the newest piece: a token's bytes can complete the
        partial character that ended the text before). Returns the text that may be sent now and the stop
        string that matched, if one did; after a match the text ends before it, and there is no next feed."""
        hit = None
        for s in self.stops:  # the earliest match; at one position, the first stop string listed
            at = text.find(s, max(0, self.sent - len(s)))
            if at != -1 and (hit is None or at < hit[0]):
                hit = (at, s)
        if hit is not None:
            self.text = text[:hit[0]]
            return self.flush(), hit[1]
        self.text = text
        safe = len(text)
        if text.endswith("\ufffd"):  # a partial UTF-8 sequence: wait for its next bytes
            safe = len(text.rstrip("\ufffd"))
        for k in range(min(self.longest - 1, safe - self.sent), 0, -1):
            if any(s.startswith(text[safe - k:safe]) for s in self.stops):
                safe -= k
                break
        if safe <= self.sent:
            return "", None
        piece, self.sent = text[self.sent:safe], safe
        return piece, None

    def flush(self) -> str:
        """What is held back, sent when the generation ends (EOS, length, cancelled)."""
        piece, self.sent = self.text[self.sent:], max(self.sent, len(self.text))
        return piece


class Worker:
    def __init__(self, engine: Engine, tokenizer, cache: PrefixCache | None, dspark: int, metrics: Metrics,
                 chunk: int = DEFAULT_CHUNK, concurrency: int = 2):
        self.engine, self.tokenizer, self.cache, self.dspark = engine, tokenizer, cache, dspark
        self.metrics, self.chunk = metrics, chunk
        self._token_bytes: list[bytes | None] | None = None
        self._json_masks: dict = {}
        self._json_lock = threading.Lock()
        # two generations in flight: with a box, each machine works on one while the other finishes the next
        self.executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="dsflash-engine")

    def submit(self, job: Job, emit: Callable[[Any], None]) -> None:
        with self.metrics.lock:
            self.metrics.queued += 1
        self.executor.submit(self._run, job, emit)

    def _run(self, job: Job, emit: Callable[[Any], None]) -> None:
        with self.metrics.lock:
            self.metrics.queued -= 1
        if job.cancel.is_set():
            emit(Done("cancelled", None, len(job.prompt), 0, 0, {}))
            return
        with self.metrics.lock:
            self.metrics.running += 1
        try:
            self._generate(job, emit)
        except Exception as e:  # reported to the request, never kills the worker
            emit(Failed(e))
        finally:
            with self.metrics.lock:
                self.metrics.running -= 1

    def _prepare(self, job: Job, stats: DecodeStats):
        prompt, t0 = job.prompt, time.perf_counter()

        def progress(done: int, total: int) -> None:
            job.progress = {"total": len(prompt), "cache": stats.cached_tokens, "processed": stats.cached_tokens + done,
                            "time_ms": round((time.perf_counter() - t0) * 1000, 1)}

        session = self.engine.session()
        # also snapshot at the split, so the next turn of the conversation (whose text differs from this
        # prompt's generation-prompt tail, e.g. `<think>` vs `</think>`) resumes from there
        synced = session.sync(prompt, images=job.images, cache=self.cache, chunk=self.chunk,
                              snapshot_at=job.split if 0 < job.split < len(prompt) else None, progress=progress)
        stats.prompt_tokens, stats.cached_tokens, stats.prefill_s = len(prompt), synced.reused, synced.prefill_s
        return session, synced.logits

    def _generate(self, job: Job, emit: Callable[[Any], None]) -> None:
        stats = DecodeStats()
        session, first_logits = self._prepare(job, stats)
        try:
            self._decode(job, emit, session, first_logits, stats)
        finally:
            session.close()  # frees the box's side of a split session too; the prefix cache keeps snapshots

    def _decode(self, job: Job, emit: Callable[[Any], None], session, first_logits, stats: DecodeStats) -> None:
        m = self.metrics
        with m.lock:
            m.prompt_tokens += stats.prompt_tokens
            m.cached_tokens += stats.cached_tokens
            m.prefill_tokens += stats.prompt_tokens - stats.cached_tokens
        dspark = 0 if job.top_logprobs is not None else self.dspark  # logprobs need each token's own row
        stops = StopScanner(job.stop)
        out: list[int] = []
        emitted = 0  # tokens yielded, EOS included
        finish, stop_string = "length", None
        pending_lp: list[dict] = []
        last = None
        t_dec = time.perf_counter()
        end = set(job.params.end_ids)
        for i, tok in enumerate(decode(session, first_logits, job.max_new, job.params, end, dspark=dspark,
                                       stats=stats, stopped=job.cancel.is_set, constraint=self._constraint(job))):
            now = time.perf_counter()
            with m.lock:
                m.generated_tokens += 1
                if last is None:
                    stats.ttft_s = now - job.arrived
                    m.ttft.observe(stats.ttft_s)
                else:
                    m.itl.observe(now - last)
            last = now
            emitted += 1
            if job.top_logprobs is not None:
                row = first_logits if i == 0 else session.last_logits
                lp, best = logprobs(row, tok, job.top_logprobs)
                pending_lp.append(self._lp_entry(tok, lp, best))
            if tok in end:
                finish = "stop"
                break
            out.append(tok)
            piece, stop_string = stops.feed(self.tokenizer.decode(out, skip_special_tokens=False))
            if piece or pending_lp:
                emit(Text(piece, pending_lp))
                pending_lp = []
            if stop_string is not None:
                finish = "stop"
                break
        stats.decode_s = time.perf_counter() - t_dec
        with m.lock:
            m.drafted += stats.drafted
            m.accepted += stats.accepted
        if job.cancel.is_set():
            finish = "cancelled"
        piece = stops.flush()
        if piece or pending_lp:
            emit(Text(piece, pending_lp))
        if finish == "stop" and stop_string is None and self.cache is not None:
            try:  # the finished turn, for the conversation's next request
                self.cache.put(session.cache_key(), session.snapshot())
            except Exception:
                pass
        emit(Done(finish, stop_string, stats.prompt_tokens, stats.cached_tokens, emitted, stats.as_dict()))

    def _constraint(self, job: Job) -> Constraint | None:
        """What the answer must be (after the reasoning, when thinking): a forced tool call opens the DSML
        block with an invoke of one of the forced tools (the arguments are the model's own); JSON mode
        makes it a JSON object, following the request's schema when it has one."""
        if not job.forced_tools and not job.json_mode:
            return None
        trigger = None
        if job.thinking:
            trigger = self.tokenizer.token_to_id(THINK_END)
            if trigger is None:
                raise ValueError(f"the tokenizer has no single {THINK_END} token to start the answer's constraint")
        if job.forced_tools:
            heads = [TOOL_CALLS_SEPARATOR + DSML_CALLS_OPEN + "\n" + DSML_INVOKE_OPEN + name + DSML_ATTRIBUTES_END
                     + "\n" for name in job.forced_tools]
            return Forcing([self.tokenizer.encode(h, add_special_tokens=False).ids for h in heads], trigger)
        with self._json_lock:  # the token bytes and the masks by grammar state are made once per server
            if self._token_bytes is None:
                self._token_bytes = token_bytes(self.tokenizer)
        return JsonObject(self._token_bytes, EOS_ID, trigger, self._json_masks, job.json_schema)

    def _lp_entry(self, tok: int, lp: float, best: list[tuple[int, float]]) -> dict:
        def one(t: int, v: float) -> dict:
            s = self.tokenizer.decode([t], skip_special_tokens=False)
            return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8", "replace"))}

        return {**one(tok, lp), "top_logprobs": [one(t, v) for t, v in best]}


# ---------------------------------------------------------------------------------------------- models


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)  # vLLM's extension
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions: generation ends at EOS (unless ignore_eos) or at any of stop_token_ids, neither of
    # which may come before min_tokens tokens
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)  # choice i samples with seed + i
    return_progress: bool = False  # llama.cpp's prompt_progress chunks while prefilling (streaming only)


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    reasoning_effort: str | int | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class AnthropicThinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class MessagesRequest(_Body):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    max_tokens: int = Field(ge=1)
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    thinking: AnthropicThinking | None = None


# ----------------------------------------------------------------------------------------------- app


def _now() -> int:
    return int(time.time())


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > 4:
        raise ApiError(400, "stop: at most 4 stop strings", "stop")
    if any(not s for s in stops):
        raise ApiError(400, "stop: stop strings must be non-empty", "stop")
    return stops


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    try:
        return tuple(sorted((int(k), float(v)) for k, v in (bias or {}).items()))
    except ValueError as e:
        raise ApiError(400, "logit_bias: keys must be token ids", "logit_bias") from e


def _end_ids(req) -> tuple[int, ...]:
    ids = set(getattr(req, "stop_token_ids", None) or ())
    if not getattr(req, "ignore_eos", False):
        ids.add(EOS_ID)
    if any(i < 0 for i in ids):
        raise ApiError(400, "stop_token_ids: must be token ids", "stop_token_ids")
    return tuple(sorted(ids))


def json_mode(fmt: Any, field: str, forced_tools: tuple[str, ...] = ()) -> tuple[bool, Node | None]:
    """What a response format (OpenAI's response_format, the Responses API's text.format) asks for: (a JSON
    object?, the schema it follows). A schema outside the supported subset is refused, not ignored, and so
    is JSON output together with a forced tool call (the answer cannot be both)."""
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if kind in (None, "text"):
        return False, None
    if kind not in ("json_object", "json_schema"):
        raise ApiError(400, f"{field}: unknown type {kind!r}; one of text, json_object, json_schema", field)
    if forced_tools:
        raise ApiError(400, f"{field}: {kind} and a forced tool call exclude each other", field)
    node = None
    if kind == "json_schema":
        spec = fmt.get("json_schema", fmt)  # chat nests it under json_schema, Responses does not
        schema = spec.get("schema") if isinstance(spec, dict) else None
        try:
            node = compile_schema(schema, f"{field}.schema")
            schema_start(node)
        except SchemaError as e:
            raise ApiError(400, str(e), field) from e
    return True, node


def _sampling(req, default_temperature: float = 1.0) -> SamplingParams:
    temperature = default_temperature if req.temperature is None else req.temperature
    seed = req.seed if getattr(req, "seed", None) is not None else secrets.randbits(63)
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    try:
        return SamplingParams(temperature, req.top_p if req.top_p is not None else 1.0, top_k,
                              getattr(req, "min_p", None) or 0.0, seed,
                              getattr(req, "presence_penalty", None) or 0.0,
                              getattr(req, "frequency_penalty", None) or 0.0,
                              getattr(req, "repetition_penalty", None) or 1.0,
                              _logit_bias(getattr(req, "logit_bias", None)), getattr(req, "min_tokens", 0),
                              _end_ids(req))
    except ValueError as e:
        raise ApiError(400, str(e), str(e).split(" ")[0]) from e


def _reasoning_effort(value: str | int | None) -> tuple[bool | None, int | None]:
    """(thinking override, effort) from OpenAI's reasoning_effort (named level or int 1..100)."""
    if value is None:
        return None, None
    if isinstance(value, int):
        if not 1 <= value <= 100:
            raise ApiError(400, "reasoning_effort: must be an integer in [1, 100] or a level name",
                           "reasoning_effort")
        return None, value
    if value not in REASONING_LEVELS:
        raise ApiError(400, f"reasoning_effort: unknown level {value!r}; one of {sorted(REASONING_LEVELS)}",
                       "reasoning_effort")
    effort = REASONING_LEVELS[value]
    return (False, None) if effort is None else (None, effort)


def offered_tools(tools: list[dict] | None, tool_choice: Any) -> tuple[list[dict] | None, tuple[str, ...]]:
    """The tools put in the prompt under `tool_choice` (OpenAI, Responses or Anthropic spelling, tools in
    OpenAI's form) and the names of those of which one must be called: auto → all tools, nothing forced;
    none → no tools; required / any → all, one of them forced; a named tool → all, that one forced."""
    kind = tool_choice.get("type") if isinstance(tool_choice, dict) else tool_choice
    if kind in (None, "auto"):
        return tools, ()
    if kind == "none":
        return None, ()
    # (malformed tools are refused by encode_messages, which renders them next)
    names = tuple(t["function"].get("name") for t in tools or () if isinstance(t, dict)
                  and isinstance(t.get("function"), dict))
    if kind in ("required", "any"):
        if not names:
            raise ApiError(400, f"tool_choice: {kind!r} needs at least one tool", "tool_choice")
        return tools, names
    if kind in ("function", "tool") and isinstance(tool_choice, dict):
        name = tool_choice.get("name") or (tool_choice.get("function") or {}).get("name")
        if name not in names:
            raise ApiError(400, f"tool_choice: no tool named {name!r} among the tools", "tool_choice")
        return tools, (name,)
    raise ApiError(400, f"tool_choice: {tool_choice!r} is not auto, none, required/any or a named tool",
                   "tool_choice")


def _anthropic_to_openai(req: MessagesRequest, images: Images) -> tuple[list[dict], list[dict] | None]:
    messages: list[dict] = []
    if req.system is not None:
        if isinstance(req.system, str):
            system = req.system
        else:
            system = "\n\n".join(b.get("text", "") for b in req.system if b.get("type") == "text")
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        role, content = m.get("role"), m.get("content")
        where = f"messages[{i}]"
        if role not in ("user", "assistant"):
            raise ApiError(400, f"{where}.role: must be 'user' or 'assistant', got {role!r}", f"{where}.role")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ApiError(400, f"{where}.content: must be a string or a list of content blocks", f"{where}.content")
        texts, reasoning, calls, results = [], [], [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            bw = f"{where}.content[{j}]"
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "image" and role == "user":
                source = block.get("source") if isinstance(block.get("source"), dict) else {}
                if source.get("type") != "base64":
                    raise ApiError(400, f"{bw}.source.type: only base64 images are accepted", f"{bw}.source.type")
                try:
                    texts.append(images.add_base64(source.get("data"), f"{bw}.source.data"))
                except ImageError as e:
                    raise ApiError(400, str(e), e.field) from e
            elif kind == "thinking" and role == "assistant":
                reasoning.append(str(block.get("thinking", "")))
            elif kind == "redacted_thinking":
                continue
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block.get("name"), "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "tool_result" and role == "user":
                c = block.get("content", "")
                if isinstance(c, list):
                    c = "\n\n".join(x.get("text", "") for x in c if isinstance(x, dict) and x.get("type") == "text")
                results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": c})
            else:
                raise ApiError(400, f"{bw}.type: unsupported content block {kind!r} for role {role}", f"{bw}.type")
        if role == "user":
            messages.extend(results)
            if texts or not results:
                messages.append({"role": "user", "content": "\n\n".join(texts)})
        else:
            msg: dict[str, Any] = {"role": "assistant", "content": "\n\n".join(texts)}
            if reasoning:
                msg["reasoning_content"] = "\n\n".join(reasoning)
            if calls:
                msg["tool_calls"] = calls
            messages.append(msg)
    tools = None
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if not isinstance(t.get("name"), str):
                raise ApiError(400, f"tools[{i}].name: must be a string", f"tools[{i}].name")
            fn = {"name": t["name"], "parameters": t.get("input_schema", {"type": "object"})}
            if t.get("description"):
                fn["description"] = t["description"]
            tools.append({"type": "function", "function": fn})
    return messages, tools


class Server:
    def __init__(self, engine: Engine, tokenizer, cache: PrefixCache | None, model_name: str, dspark: int,
                 chunk: int = DEFAULT_CHUNK):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.metrics = Metrics()
        if engine.encoder.reconnects is not None:  # a box
            self.metrics.box_reconnects = lambda: engine.encoder.reconnects
        self.worker = Worker(engine, tokenizer, cache, dspark, self.metrics, chunk)
        self.created = _now()

    # ------------------------------------------------------------------ prompt building

    def prompt_ids(self, text: str, images: Images) -> tuple[list[int], list]:
        """Token ids of an encoded conversation and its image spans."""
        try:
            return images.prompt(text, self.tokenize, self.engine)
        except ImageError as e:
            raise ApiError(400, str(e), e.field) from e

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def job(self, prompt: list[int], max_tokens: int | None, params: SamplingParams, stop: list[str],
            top_logprobs: int | None, split: int, arrived: float) -> Job:
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
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(queue.get(), timeout=0.5)
                except TimeoutError:
                    if await request.is_disconnected():
                        job.cancel.set()
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


def _openai_error(e: ApiError) -> JSONResponse:
    body = {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code, **e.extra}}
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def _anthropic_error(e: ApiError) -> JSONResponse:
    kind = ("authentication_error" if e.status == 401 else "invalid_request_error" if e.status < 500
            else "overloaded_error" if e.status == 503 else "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": e.message}}, status_code=e.status,
                        headers=e.headers)


def _usage(done: Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


def _progress_chunk(cid: str, created: int, kind: str) -> Callable[[dict], str]:
    return lambda p: _sse({"id": cid, "object": kind, "created": created, "choices": [], "prompt_progress": p})


def _choices(job: Job, n: int) -> list[Job]:
    """`job` and its n - 1 siblings (seed + i; greedy ones give the same text, as in vLLM)."""
    return [job] + [replace(job, params=replace(job.params, seed=job.params.seed + i), cancel=threading.Event(),
                            progress=None) for i in range(1, n)]


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
            yield sse([], usage=_usage(_total(dones)))
    except ApiError as e:
        metrics.inc(metrics.errors, e.code or "invalid_request")
        yield _sse({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}})
    except Exception as e:
        metrics.inc(metrics.errors, "internal")
        yield _sse({"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error"}})
    yield "data: [DONE]\n\n"


def _total(dones: list[Done]) -> Done:
    """One Done for the usage of n choices: the prompt once, the completions summed."""
    return replace(dones[0], completion_tokens=sum(d.completion_tokens for d in dones))


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class ApiKeyGuard:
    """ASGI middleware: /v1 requests without the key get `refuse(path)`. Plain ASGI rather than
    BaseHTTPMiddleware, so streamed responses and disconnect detection pass through untouched."""

    def __init__(self, app, key: str, refuse: Callable[[str], JSONResponse]):
        self.app, self.key, self.refuse = app, key.encode(), refuse

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = dict(scope["headers"])
            bearer = headers.get(b"authorization", b"")
            given = bearer[7:] if bearer[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
            if not hmac.compare_digest(given, self.key):
                await self.refuse(scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine: Engine, tokenizer, cache: PrefixCache | None = None, model_name: str = "deepseek-v4.1-flash",
               dspark: int = 0, prefix_cache: bool = True, chunk: int = DEFAULT_CHUNK,
               api_key: str | None = None) -> FastAPI:
    """The HTTP app. Without `cache`, a RAM-only prefix cache is made (unless `prefix_cache` is False).
    `chunk`: prefill chunk size (the prefix-cache snapshot grid and the progress granularity).
    `api_key`: when set, every /v1 request needs it as `Authorization: Bearer KEY` (OpenAI clients) or
    `x-api-key: KEY` (Anthropic clients); /health and /metrics stay open for probes."""
    if cache is None and prefix_cache:
        cache = PrefixCache(engine.identity)
    srv = Server(engine, tokenizer, cache, model_name, dspark, chunk)
    app = FastAPI(title="dsflash", version="0.1")
    app.state.server = srv
    m = srv.metrics

    def anthropic_path(request: Request) -> bool:
        return request.url.path.startswith("/v1/messages")

    if api_key:
        def refuse(path: str) -> JSONResponse:
            m.inc(m.errors, "invalid_api_key")
            err = ApiError(401, "missing or incorrect API key", code="invalid_api_key", kind="authentication_error")
            return _anthropic_error(err) if path.startswith("/v1/messages") else _openai_error(err)

        app.add_middleware(ApiKeyGuard, key=api_key, refuse=refuse)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
        name = _loc_name(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            msg, name = f"body: malformed JSON ({first.get('ctx', {}).get('error', first.get('msg'))})", "body"
        else:
            msg = f"{name or 'body'}: {first.get('msg')}"
        m.inc(m.errors, "invalid_request")
        err = ApiError(400, msg, name or "body")
        return _anthropic_error(err) if anthropic_path(request) else _openai_error(err)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        m.inc(m.errors, exc.code or ("invalid_request" if exc.status < 500 else "internal"))
        return _anthropic_error(exc) if anthropic_path(request) else _openai_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        m.inc(m.errors, f"http_{exc.status_code}")
        err = ApiError(exc.status_code, str(exc.detail), kind="not_found_error" if exc.status_code == 404
                       else "invalid_request_error")
        return _anthropic_error(err) if anthropic_path(request) else _openai_error(err)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        m.inc(m.errors, "internal")
        err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")
        return _anthropic_error(err) if anthropic_path(request) else _openai_error(err)

    @app.get("/health")
    async def health():
        out = {"status": "ok", "model": model_name, "queued": m.queued, "running": m.running}
        link = getattr(engine, "link", None)
        if link is not None:
            out["box"] = {"address": f"{link.addr[0]}:{link.addr[1]}", "connected": link.connected,
                          "reconnects": link.reconnects}
        return out

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(m.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        m.inc(m.requests, "models")
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": srv.created,
                                            "owned_by": "dsflash", "max_model_len": engine.max_context}]}

    # ------------------------------------------------------------------ chat completions

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        arrived = time.perf_counter()
        m.inc(m.requests, "chat_completions")
        thinking, effort = _reasoning_effort(req.reasoning_effort)
        kwargs = req.chat_template_kwargs or {}
        if "thinking" in kwargs:
            if not isinstance(kwargs["thinking"], bool | None):
                raise ApiError(400, "chat_template_kwargs.thinking: must be a bool", "chat_template_kwargs.thinking")
            thinking = kwargs["thinking"] if kwargs["thinking"] is not None else thinking
        thinking = True if thinking is None else thinking
        images = Images()
        tools, forced = offered_tools(req.tools, req.tool_choice)
        try:
            text = encode_messages(images.openai_messages(req.messages), tools, thinking, effort)
        except EncodingError as e:
            raise ApiError(400, str(e), str(e).split(":")[0]) from e
        except ImageError as e:
            raise ApiError(400, str(e), e.field) from e
        prompt, spans = srv.prompt_ids(text, images)
        # the generation-prompt tail `<think>`/`</think>` differs from the next turn's text; snapshot before it
        split = len(prompt) - 1
        top = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens or req.max_tokens
        job = srv.job(prompt, max_tokens, _sampling(req), _stop_list(req.stop), top, split, arrived)
        job.images, job.forced_tools, job.thinking = spans, forced, thinking
        job.json_mode, job.json_schema = json_mode(req.response_format, "response_format", forced)
        jobs = _choices(job, req.n)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = _now()
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            progress = _progress_chunk(cid, created, "chat.completion.chunk") if req.return_progress else None
            return StreamingResponse(with_keepalive(_chat_stream(jobs, request, cid, created, thinking, include_usage),
                                                    job, progress), media_type="text/event-stream")
        results = await asyncio.gather(*(srv.collect(j, request, thinking) for j in jobs))

        def choice(index: int, got: Collected, lps: list[dict], done: Done) -> dict:
            calls = {i: {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                         "function": {"name": c.name, "arguments": c.arguments}} for i, c in got.calls.items()}
            message: dict[str, Any] = {"role": "assistant",
                                       "content": "".join(got.content) if got.content or not calls else None}
            if thinking:
                message["reasoning_content"] = "".join(got.reasoning)
            finish = done.finish if done.finish != "cancelled" else "stop"
            if calls:
                message["tool_calls"] = [calls[i] for i in sorted(calls)]
                finish = "tool_calls" if done.finish == "stop" else finish
            return {"index": index, "message": message, "logprobs": {"content": lps} if top is not None else None,
                    "finish_reason": finish}

        return {"id": cid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [choice(i, *r) for i, r in enumerate(results)],
                "usage": _usage(_total([r[2] for r in results])), "dsflash": results[0][2].stats}

    async def _chat_stream(jobs: list[Job], request: Request, cid: str, created: int, thinking: bool,
                           include_usage: bool) -> AsyncIterator[str]:
        """The chunks of every choice as they come (each with its index), then the summed usage."""
        def sse(choices: list[dict], **extra) -> str:
            return _sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                         "choices": choices, **extra})

        choices = [_chat_choice(i, j, request, thinking) for i, j in enumerate(jobs)]
        async for line in choice_stream(choices, sse, include_usage, m):
            yield line

    async def _chat_choice(index: int, job: Job, request: Request, thinking: bool) -> AsyncIterator[Any]:
        """One choice's chunk dicts (role first, finish reason last), then its Done."""
        def chunk(delta: dict, finish: str | None = None, lps: list | None = None) -> dict:
            return {"index": index, "delta": delta, "logprobs": {"content": lps} if lps else None,
                    "finish_reason": finish}

        parser = DsmlParser(thinking)
        any_calls = False
        yield chunk({"role": "assistant", "content": ""})
        async for ev in srv.events(job, request):
            if isinstance(ev, Done):
                evs, lps = parser.finish(), []
            else:
                evs, lps = parser.feed(ev.text), ev.logprobs
            for e in evs:
                if isinstance(e, ContentDelta):
                    yield chunk({"content": e.text}, lps=lps)
                elif isinstance(e, ReasoningDelta):
                    yield chunk({"reasoning_content": e.text}, lps=lps)
                elif isinstance(e, ToolCallStart):
                    any_calls = True
                    yield chunk({"tool_calls": [{"index": e.index, "id": f"call_{uuid.uuid4().hex[:24]}",
                                                 "type": "function",
                                                 "function": {"name": e.name, "arguments": ""}}]}, lps=lps)
                elif isinstance(e, ToolCallArgumentsDelta):
                    yield chunk({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]}, lps=lps)
                else:
                    continue
                lps = []
            if lps:
                yield chunk({}, lps=lps)
            if isinstance(ev, Done):
                finish = ev.finish if ev.finish != "cancelled" else "stop"
                if any_calls and ev.finish == "stop":
                    finish = "tool_calls"
                yield chunk({}, finish)
                yield ev

    # ------------------------------------------------------------------ text completions

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        arrived = time.perf_counter()
        m.inc(m.requests, "completions")
        if req.echo:
            raise ApiError(400, "echo: not supported", "echo")
        if isinstance(req.prompt, str):
            prompt = srv.tokenize(req.prompt)
            if not prompt or prompt[0] != BOS_ID:
                prompt = [BOS_ID] + prompt
        else:
            vocab = engine.args.vocab_size
            if not req.prompt or any(not 0 <= t < vocab for t in req.prompt):
                raise ApiError(400, f"prompt: token ids must be a non-empty list in [0, {vocab})", "prompt")
            prompt = list(req.prompt)
        top = req.logprobs
        job = srv.job(prompt, req.max_tokens or 16, _sampling(req), _stop_list(req.stop), top, 0, arrived)
        job.json_mode, job.json_schema = json_mode(getattr(req, "response_format", None), "response_format")
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = _now()

        def lp_obj(lps: list[dict]) -> dict | None:
            if top is None:
                return None
            return {"tokens": [x["token"] for x in lps], "token_logprobs": [x["logprob"] for x in lps],
                    "top_logprobs": [{t["token"]: t["logprob"] for t in x["top_logprobs"]} for x in lps]}

        jobs = _choices(job, req.n)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            def sse(choices: list[dict], **extra) -> str:
                return _sse({"id": cid, "object": "text_completion", "created": created, "model": model_name,
                             "choices": choices, **extra})

            async def choice(index: int, j: Job) -> AsyncIterator[Any]:
                def chunk(text: str, finish: str | None = None, lps=()) -> dict:
                    return {"index": index, "text": text, "logprobs": lp_obj(list(lps)), "finish_reason": finish}

                async for ev in srv.events(j, request):
                    if isinstance(ev, Done):
                        yield chunk("", ev.finish if ev.finish != "cancelled" else "stop")
                        yield ev
                    elif ev.text or ev.logprobs:
                        yield chunk(ev.text, lps=ev.logprobs)

            stream = choice_stream([choice(i, j) for i, j in enumerate(jobs)], sse, include_usage, m)
            progress = _progress_chunk(cid, created, "text_completion") if req.return_progress else None
            return StreamingResponse(with_keepalive(stream, job, progress), media_type="text/event-stream")
        async def run(j: Job) -> tuple[str, list[dict], Done]:
            texts, lps, done = [], [], None
            async for ev in srv.events(j, request):
                if isinstance(ev, Done):
                    done = ev
                else:
                    texts.append(ev.text)
                    lps.extend(ev.logprobs)
            return "".join(texts), lps, done

        results = await asyncio.gather(*(run(j) for j in jobs))
        return {"id": cid, "object": "text_completion", "created": created, "model": model_name,
                "choices": [{"index": i, "text": text, "logprobs": lp_obj(lps),
                             "finish_reason": done.finish if done.finish != "cancelled" else "stop"}
                            for i, (text, lps, done) in enumerate(results)],
                "usage": _usage(_total([r[2] for r in results])), "dsflash": results[0][2].stats}

    # ------------------------------------------------------------------ anthropic messages

    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request):
        arrived = time.perf_counter()
        m.inc(m.requests, "messages")
        images = Images()
        msgs, tools = _anthropic_to_openai(req, images)
        tools, forced = offered_tools(tools, req.tool_choice)
        thinking = req.thinking is not None and req.thinking.type != "disabled"
        try:
            text = encode_messages(msgs, tools, thinking)
        except EncodingError as e:
            raise ApiError(400, str(e), str(e).split(":")[0]) from e
        prompt, spans = srv.prompt_ids(text, images)
        job = srv.job(prompt, req.max_tokens, _sampling(req), _stop_list(req.stop_sequences), None,
                      len(prompt) - 1, arrived)
        job.images, job.forced_tools, job.thinking = spans, forced, thinking
        mid = f"msg_{uuid.uuid4().hex[:24]}"

        def stop_reason(done: Done, calls: bool) -> str:
            if done.stop_string is not None:
                return "stop_sequence"
            if done.finish == "length":
                return "max_tokens"
            return "tool_use" if calls else "end_turn"

        def usage(done: Done) -> dict:
            return {"input_tokens": done.prompt_tokens - done.cached_tokens, "output_tokens": done.completion_tokens,
                    "cache_read_input_tokens": done.cached_tokens, "cache_creation_input_tokens": 0}

        if req.stream:
            return StreamingResponse(with_keepalive(_messages_stream(job, request, mid, thinking, stop_reason, usage),
                                                    job, None), media_type="text/event-stream")
        parser = DsmlParser(thinking)
        blocks: list[dict] = []
        args: dict[int, list[str]] = {}
        done = None

        def block(kind: str) -> dict:
            if not blocks or blocks[-1]["type"] != kind or kind == "tool_use":
                blocks.append({"type": kind, **({"thinking": "", "signature": ""} if kind == "thinking" else
                                                {"text": ""} if kind == "text" else {})})
            return blocks[-1]

        async for ev in srv.events(job, request):
            if isinstance(ev, Done):
                done = ev
                evs = parser.finish()
            else:
                evs = parser.feed(ev.text)
            for e in evs:
                if isinstance(e, ContentDelta):
                    block("text")["text"] += e.text
                elif isinstance(e, ReasoningDelta):
                    block("thinking")["thinking"] += e.text
                elif isinstance(e, ToolCallStart):
                    b = block("tool_use")
                    b.update(id=f"toolu_{uuid.uuid4().hex[:24]}", name=e.name, input={})
                    args[e.index] = []
                    b["_index"] = e.index
                elif isinstance(e, ToolCallArgumentsDelta):
                    args[e.index].append(e.text)
        has_calls = False
        for b in blocks:
            if b["type"] == "tool_use":
                has_calls = True
                raw = "".join(args.pop(b.pop("_index"), []))
                try:
                    b["input"] = json.loads(raw) if raw else {}
                except json.JSONDecodeError:
                    b["input"] = {"_raw": raw}
        return {"id": mid, "type": "message", "role": "assistant", "model": model_name, "content": blocks,
                "stop_reason": stop_reason(done, has_calls), "stop_sequence": done.stop_string,
                "usage": usage(done)}

    async def _messages_stream(job: Job, request: Request, mid: str, thinking: bool, stop_reason, usage
                               ) -> AsyncIterator[str]:
        def event(name: str, data: dict) -> str:
            return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"

        yield event("message_start", {"message": {
            "id": mid, "type": "message", "role": "assistant", "model": model_name, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": len(job.prompt), "output_tokens": 0}}})
        yield event("ping", {})
        parser = DsmlParser(thinking)
        index, open_kind, has_calls = -1, None, False

        def open_block(kind: str, start: dict) -> list[str]:
            nonlocal index, open_kind
            out = []
            if open_kind is not None:
                out.append(event("content_block_stop", {"index": index}))
            index += 1
            open_kind = kind
            out.append(event("content_block_start", {"index": index, "content_block": start}))
            return out

        try:
            async for ev in srv.events(job, request):
                evs = parser.finish() if isinstance(ev, Done) else parser.feed(ev.text)
                for e in evs:
                    if isinstance(e, ContentDelta):
                        if open_kind != "text":
                            for s in open_block("text", {"type": "text", "text": ""}):
                                yield s
                        yield event("content_block_delta", {"index": index,
                                                            "delta": {"type": "text_delta", "text": e.text}})
                    elif isinstance(e, ReasoningDelta):
                        if open_kind != "thinking":
                            for s in open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                                yield s
                        yield event("content_block_delta", {"index": index,
                                                            "delta": {"type": "thinking_delta", "thinking": e.text}})
                    elif isinstance(e, ToolCallStart):
                        has_calls = True
                        for s in open_block("tool_use", {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}",
                                                         "name": e.name, "input": {}}):
                            yield s
                    elif isinstance(e, ToolCallArgumentsDelta):
                        yield event("content_block_delta", {"index": index, "delta": {"type": "input_json_delta",
                                                                                      "partial_json": e.text}})
                if isinstance(ev, Done):
                    if open_kind is not None:
                        yield event("content_block_stop", {"index": index})
                    u = usage(ev)
                    yield event("message_delta", {"delta": {"stop_reason": stop_reason(ev, has_calls),
                                                            "stop_sequence": ev.stop_string}, "usage": u})
                    yield event("message_stop", {})
        except ApiError as e:
            m.inc(m.errors, e.code or "invalid_request")
            yield event("error", {"error": {"type": "invalid_request_error", "message": e.message}})
        except Exception as e:
            m.inc(m.errors, "internal")
            yield event("error", {"error": {"type": "api_error", "message": f"{type(e).__name__}: {e}"}})

    from dsflash.server.responses import add_routes  # the Responses API builds on the pieces above

    add_routes(app, srv, model_name)
    return app
