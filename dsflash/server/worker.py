"""The decode worker: generations run on a small thread pool (two in flight, served FIFO), each turning
tokens into text, applying stop strings, and posting events (Text, then Done or Failed) through the
request's `emit`. A client that goes away sets the job's cancel flag, which `decode(stopped=...)` checks
every token."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from dsflash.engine.json_mode import JsonObject, Node, Vocab
from dsflash.engine.prefix_cache import PrefixCache
from dsflash.engine.sampling import AfterReasoning, Constraint, SamplingParams, logprobs
from dsflash.engine.session import DEFAULT_CHUNK, Engine
from dsflash.engine.spec import DecodeStats, decode
from dsflash.engine.tool_call import Syntax, ToolCall
from dsflash.server.encoding import (
    DSML_ATTRIBUTES_END,
    DSML_CALLS_CLOSE,
    DSML_CALLS_OPEN,
    DSML_INVOKE_CLOSE,
    DSML_INVOKE_OPEN,
    DSML_PARAMETER_CLOSE,
    DSML_PARAMETER_OPEN,
    THINK_END,
    TOOL_CALLS_SEPARATOR,
)
from dsflash.server.metrics import Metrics
from dsflash.tokenizer import EOS_ID, token_bytes
from dsflash.tokens import ASSISTANT, BOS, DSML, EOS, PAD, SYSTEM, THINK_START, USER

# one call as `render_tool_calls` writes it: what a forced call's grammar follows
DSML_SYNTAX = Syntax(head=TOOL_CALLS_SEPARATOR + DSML_CALLS_OPEN + "\n" + DSML_INVOKE_OPEN,
                     name_end=DSML_ATTRIBUTES_END + "\n", param_open=DSML_PARAMETER_OPEN, flag='" string="',
                     attr_end=DSML_ATTRIBUTES_END, param_close=DSML_PARAMETER_CLOSE, between="\n",
                     invoke_end="\n" + DSML_INVOKE_CLOSE + "\n" + DSML_CALLS_CLOSE)


PROGRESS_S = 0.5  # prefill progress about this often


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
    # one of these tools (name, parameters schema) must be called (tool_choice required / named)
    forced_tools: tuple[tuple[str, Node], ...] = ()
    json_mode: bool = False  # the answer is a JSON object (response_format json_object / json_schema)
    json_schema: Node | None = None  # ... following this schema
    thinking: bool = False  # with either: the constraint starts at the reasoning's end
    reasoning_budget: int | None = None  # thinking: `</think>` is forced after this many reasoning tokens
    prompt_field: str = "messages"  # the request's field of the prompt, for errors about it
    # the text leaves out the special tokens (BOS, EOS, PAD, the role markers, `<think>`; vLLM's default),
    # and `</think>` too unless a parser reads the text (which needs it, and the DSML marker)
    skip_special: bool = True
    parsed: bool = True

    def choices(self, n: int) -> list[Job]:
        """This job and its n - 1 siblings (seed + i; greedy ones give the same text, as in vLLM)."""
        return [self] + [replace(self, params=replace(self.params, seed=self.params.seed + i),
                                 cancel=threading.Event(), progress=None) for i in range(1, n)]


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
    tokens: list[int] = field(default_factory=list)  # the generated ids, the end token included
    reasoning_tokens: int = 0  # of completion_tokens, those before the reasoning's end


@dataclass
class Failed:
    error: Exception


class _Cancelled(Exception):
    """Raised from a prefill's progress callback to end the prefill of a cancelled job."""


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
        # rows of a prefill's encoder passes, each followed by a progress event: about PROGRESS_S of work at the
        # last prefill's speed (the bits do not depend on it)
        self.pass_rows = max(16, chunk // 16)
        hidden = {tokenizer.token_to_id(t) for t in (BOS, EOS, PAD, SYSTEM, USER, ASSISTANT, THINK_START)} - {None}
        self._hidden = {True: hidden, False: hidden | {tokenizer.token_to_id(THINK_END)}}  # by Job.parsed
        self._vocabs: dict[str, Vocab] = {}  # token bytes for JSON mode ("json") and forced calls ("dsml")
        self._json_masks: dict = {}
        self._json_lock = threading.Lock()
        # two generations in flight: with a box, each machine works on one while the other finishes the next
        self.concurrency = concurrency
        self.executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="dsflash-engine")
        self.live: dict[int, Job] = {}  # queued or running, by id, for a shutdown to cancel (under metrics.lock)

    def submit(self, job: Job, emit: Callable[[Any], None]) -> None:
        with self.metrics.lock:
            self.metrics.queued += 1
            self.live[id(job)] = job
        self.executor.submit(self._run, job, emit)

    def busy(self) -> bool:
        """Whether any job is queued or running."""
        with self.metrics.lock:
            return bool(self.live)

    def cancel_all(self) -> int:
        """Cancel every queued and running job (each ends with its Done "cancelled"); returns how many."""
        with self.metrics.lock:
            jobs = list(self.live.values())
        for job in jobs:
            job.cancel.set()
        return len(jobs)

    def _run(self, job: Job, emit: Callable[[Any], None]) -> None:
        with self.metrics.lock:
            self.metrics.queued -= 1
        try:
            if job.cancel.is_set():
                self._done(emit, Done("cancelled", None, len(job.prompt), 0, 0, {}))
                return
            with self.metrics.lock:
                self.metrics.running += 1
            try:
                self._generate(job, emit)
            except _Cancelled:  # during the prefill
                self._done(emit, Done("cancelled", None, len(job.prompt), 0, 0, {}))
            except Exception as e:  # reported to the request, never kills the worker
                emit(Failed(e))
            finally:
                with self.metrics.lock:
                    self.metrics.running -= 1
        finally:
            with self.metrics.lock:
                self.live.pop(id(job), None)

    def _done(self, emit: Callable[[Any], None], done: Done) -> None:
        self.metrics.inc(self.metrics.finished, done.finish)
        emit(done)

    def _sync(self, job: Job, session, stats: DecodeStats):
        prompt, t0 = job.prompt, time.perf_counter()

        def progress(done: int, total: int) -> None:  # a new dict each time: the stream sends each one once
            if job.cancel.is_set():  # a client gone or a shutdown: the rest of a long prefill is not wanted
                raise _Cancelled
            cache = len(prompt) - total  # kept or resumed: not prefilled
            job.progress = {"total": len(prompt), "cache": cache, "processed": cache + done,
                            "time_ms": round((time.perf_counter() - t0) * 1000, 1)}  # one clock per job: monotone

        # also snapshot at the split, so the next turn of the conversation (whose text differs from this
        # prompt's generation-prompt tail, e.g. `<think>` vs `</think>`) resumes from there
        synced = session.sync(prompt, images=job.images, cache=self.cache, chunk=self.chunk,
                              snapshot_at=job.split if 0 < job.split < len(prompt) else None, progress=progress,
                              pass_rows=self.pass_rows)
        stats.prompt_tokens, stats.cached_tokens, stats.prefill_s = len(prompt), synced.reused, synced.prefill_s
        if synced.prefill_s > 0.05:
            rate = (len(prompt) - synced.reused) / synced.prefill_s
            self.pass_rows = int(min(max(16, rate * PROGRESS_S), self.chunk))
        return synced.logits

    def _generate(self, job: Job, emit: Callable[[Any], None]) -> None:
        stats = DecodeStats()
        session = self.engine.session()
        try:
            first_logits = self._sync(job, session, stats)
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
        ended: list[int] = []  # the end token, when one ended the generation
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
                ended = [tok]
                break
            out.append(tok)
            shown = [t for t in out if t not in self._hidden[job.parsed]] if job.skip_special else out
            piece, stop_string = stops.feed(self.tokenizer.decode(shown, skip_special_tokens=False))
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
        self._done(emit, Done(finish, stop_string, stats.prompt_tokens, stats.cached_tokens, emitted, stats.as_dict(),
                              out + ended, self._reasoning_tokens(job, out)))

    def hidden_texts(self, parsed: bool) -> set[str]:
        """The text of the tokens left out of a job's text (see Job.skip_special)."""
        return {self.tokenizer.id_to_token(t) for t in self._hidden[parsed] if t is not None}

    def _reasoning_tokens(self, job: Job, out: list[int]) -> int:
        """How many of the generated tokens are reasoning: those before `</think>` (thinking mode)."""
        if not job.thinking:
            return 0
        end = self.tokenizer.token_to_id(THINK_END)
        return out.index(end) if end in out else len(out)

    def _constraint(self, job: Job) -> Constraint | None:
        """What the answer must be (after the reasoning, when thinking): a forced tool call is one DSML invoke
        of a forced tool with arguments of its schema; JSON mode makes it a JSON object, following the
        request's schema when it has one. Thinking with a reasoning budget forces the reasoning's end."""
        inner: Constraint | None = None
        if job.forced_tools:
            inner = ToolCall(self._vocab("dsml"), EOS_ID, DSML_SYNTAX, list(job.forced_tools),
                             lambda text: self.tokenizer.encode(text, add_special_tokens=False).ids)
        elif job.json_mode:
            inner = JsonObject(self._vocab("json"), EOS_ID, self._json_masks, job.json_schema)
        if not job.thinking or (inner is None and job.reasoning_budget is None):
            return inner
        trigger = self.tokenizer.token_to_id(THINK_END)
        if trigger is None:
            raise ValueError(f"the tokenizer has no single {THINK_END} token to end the reasoning")
        return AfterReasoning(trigger, inner, job.reasoning_budget)

    def _vocab(self, kind: str) -> Vocab:
        """The token bytes and their tables, made once per server: DSML's marker has bytes for forced calls."""
        with self._json_lock:
            if kind not in self._vocabs:
                self._vocabs[kind] = Vocab(token_bytes(self.tokenizer, (DSML,) if kind == "dsml" else ()))
            return self._vocabs[kind]

    def _lp_entry(self, tok: int, lp: float, best: list[tuple[int, float]]) -> dict:
        def one(t: int, v: float) -> dict:
            s = self.tokenizer.decode([t], skip_special_tokens=False)
            return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8", "replace"))}

        return {**one(tok, lp), "top_logprobs": [one(t, v) for t, v in best]}
