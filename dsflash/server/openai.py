"""OpenAI's chat completions, text completions and model list: `n` choices, logprobs, DSML tool calls as
`tool_calls`, the reasoning as `reasoning_content`, and llama.cpp's prompt progress when streaming."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request

from dsflash.server.dsml import (
    Collected,
    ContentDelta,
    DsmlParser,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallStart,
    WholeCalls,
)
from dsflash.server.errors import ApiError
from dsflash.server.images import ImageError, Images
from dsflash.server.params import (
    ChatRequest,
    CompletionRequest,
    json_mode,
    offered_tools,
    reasoning_effort,
    sampling_params,
    stop_list,
)
from dsflash.server.server import Server
from dsflash.server.sse import choice_stream, event_stream, sse_data, total, usage
from dsflash.server.worker import Done, Job
from dsflash.tokenizer import BOS_ID


def add_routes(app: FastAPI, srv: Server) -> None:
    m = srv.metrics

    def model(name: str) -> dict:
        return {"id": name, "object": "model", "created": srv.created, "owned_by": "dsflash",
                "max_model_len": srv.engine.max_context}

    @app.get("/v1/models")
    async def models():
        m.inc(m.requests, "models")
        return {"object": "list", "data": [model(name) for name in srv.model_names]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str):
        m.inc(m.requests, "models")
        srv.check_model(name)
        return model(name)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        arrived = time.perf_counter()
        m.inc(m.requests, "chat_completions")
        srv.check_model(req.model)
        thinking, effort = reasoning_effort(req.reasoning_effort)
        kwargs = req.chat_template_kwargs or {}
        if "thinking" in kwargs:
            if not isinstance(kwargs["thinking"], bool | None):
                raise ApiError(400, "chat_template_kwargs.thinking: must be a bool", "chat_template_kwargs.thinking")
            thinking = kwargs["thinking"] if kwargs["thinking"] is not None else thinking
        images = Images()
        tools, forced = offered_tools(req.tools, req.tool_choice)
        try:
            messages = images.openai_messages(req.messages)
        except ImageError as e:
            raise ApiError(400, str(e), e.field) from e
        top = (req.top_logprobs or 0) if req.logprobs else None
        job = await srv.off_loop(srv.chat_job, req, messages, tools, forced, thinking, images, arrived,
                                 effort=effort, top_logprobs=top, stop=req.stop, fmt=req.response_format,
                                 max_tokens=req.max_completion_tokens or req.max_tokens)
        thinking = job.thinking
        jobs = job.choices(req.n)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            progress = _progress_chunk(cid, created, "chat.completion.chunk") if req.return_progress else None
            return event_stream(_chat_stream(srv, jobs, request, cid, created, thinking, include_usage), job,
                                progress)
        results = await asyncio.gather(*(srv.collect(j, request, thinking) for j in jobs))

        def choice(index: int, got: Collected, lps: list[dict], done: Done) -> dict:
            # a call still open at the end (cut by max_tokens) has no whole arguments: it is left out
            calls = {i: {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                         "function": {"name": c.name, "arguments": c.arguments}} for i, c in got.calls.items()
                     if i in got.closed}
            message: dict[str, Any] = {"role": "assistant",
                                       "content": "".join(got.content) if got.content or not calls else None}
            if thinking:
                message["reasoning_content"] = "".join(got.reasoning)
            finish = _finish(done)
            if calls:
                message["tool_calls"] = [calls[i] for i in sorted(calls)]
                finish = "tool_calls" if done.finish == "stop" else finish
                srv.remember(done, thinking, got, [c["id"] for c in message["tool_calls"]])
            return {"index": index, "message": message, "logprobs": {"content": lps} if top is not None else None,
                    "finish_reason": finish}

        return {"id": cid, "object": "chat.completion", "created": created, "model": srv.model_name,
                "choices": [choice(i, *r) for i, r in enumerate(results)],
                "usage": usage(total([r[2] for r in results])), "dsflash": results[0][2].stats}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        arrived = time.perf_counter()
        m.inc(m.requests, "completions")
        srv.check_model(req.model)
        if req.echo:
            raise ApiError(400, "echo: not supported", "echo")
        if isinstance(req.prompt, str):
            prompt = await srv.off_loop(srv.tokenize, req.prompt, "prompt")
            if not prompt or prompt[0] != BOS_ID:
                prompt = [BOS_ID] + prompt
        else:
            vocab = srv.engine.args.vocab_size
            if not req.prompt or any(not 0 <= t < vocab for t in req.prompt):
                raise ApiError(400, f"prompt: token ids must be a non-empty list in [0, {vocab})", "prompt")
            prompt = list(req.prompt)
        top = req.logprobs
        hidden = srv.worker.hidden_texts(parsed=False) if req.skip_special_tokens else set()

        def _shown(entry: dict) -> int:
            return 0 if entry["token"] in hidden else len(entry["token"])
        job = srv.job(prompt, req.max_tokens or 16, sampling_params(req), stop_list(req.stop), top, 0, arrived,
                      "prompt")
        job.skip_special, job.parsed = req.skip_special_tokens, False
        job.json_mode, job.json_schema = json_mode(getattr(req, "response_format", None), "response_format")
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        def lp_obj(lps: list[dict], offset: int = 0) -> dict | None:
            if top is None:
                return None
            offsets, at = [], offset
            for x in lps:  # where each token's text starts in the choice's text (a left-out one adds nothing)
                offsets.append(at)
                at += _shown(x)
            return {"tokens": [x["token"] for x in lps], "token_logprobs": [x["logprob"] for x in lps],
                    "top_logprobs": [{t["token"]: t["logprob"] for t in x["top_logprobs"]} for x in lps],
                    "text_offset": offsets}

        jobs = job.choices(req.n)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            def line(choices: list[dict], **extra) -> str:
                return sse_data({"id": cid, "object": "text_completion", "created": created,
                                 "model": srv.model_name, "choices": choices, **extra})

            async def choice(index: int, j: Job) -> AsyncIterator[Any]:
                at = 0  # the choice's text so far, where the next chunk's text offsets start

                def chunk(text: str, finish: str | None = None, lps=()) -> dict:
                    nonlocal at
                    obj = lp_obj(list(lps), at)
                    at += sum(_shown(x) for x in lps)
                    return {"index": index, "text": text, "logprobs": obj, "finish_reason": finish}

                async for ev in srv.events(j, request):
                    if isinstance(ev, Done):
                        yield chunk("", _finish(ev))
                        yield ev
                    elif ev.text or ev.logprobs:
                        yield chunk(ev.text, lps=ev.logprobs)

            stream = choice_stream([choice(i, j) for i, j in enumerate(jobs)], line, include_usage, m)
            progress = _progress_chunk(cid, created, "text_completion") if req.return_progress else None
            return event_stream(stream, job, progress)

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
        return {"id": cid, "object": "text_completion", "created": created, "model": srv.model_name,
                "choices": [{"index": i, "text": text, "logprobs": lp_obj(lps), "finish_reason": _finish(done)}
                            for i, (text, lps, done) in enumerate(results)],
                "usage": usage(total([r[2] for r in results])), "dsflash": results[0][2].stats}


def _finish(done: Done) -> str:
    """A choice's finish_reason: stop, length (a cancelled one, whose client went away, reads as stop)."""
    return done.finish if done.finish != "cancelled" else "stop"


def _progress_chunk(cid: str, created: int, kind: str) -> Callable[[dict], str]:
    return lambda p: sse_data({"id": cid, "object": kind, "created": created, "choices": [], "prompt_progress": p})


async def _chat_stream(srv: Server, jobs: list[Job], request: Request, cid: str, created: int, thinking: bool,
                       include_usage: bool) -> AsyncIterator[str]:
    """The chunks of every choice as they come (each with its index), then the summed usage."""
    def line(choices: list[dict], **extra) -> str:
        return sse_data({"id": cid, "object": "chat.completion.chunk", "created": created, "model": srv.model_name,
                         "choices": choices, **extra})

    choices = [_chat_choice(srv, i, j, request, thinking) for i, j in enumerate(jobs)]
    async for chunk in choice_stream(choices, line, include_usage, srv.metrics):
        yield chunk


async def _chat_choice(srv: Server, index: int, job: Job, request: Request, thinking: bool) -> AsyncIterator[Any]:
    """One choice's chunk dicts (role first, finish reason last), then its Done."""
    def chunk(delta: dict, finish: str | None = None, lps: list | None = None) -> dict:
        return {"index": index, "delta": delta, "logprobs": {"content": lps} if lps else None,
                "finish_reason": finish}

    parser, got, call_ids, whole = DsmlParser(thinking), Collected(), {}, WholeCalls()
    yield chunk({"role": "assistant", "content": ""})
    async for ev in srv.events(job, request):
        if isinstance(ev, Done):
            evs, lps = parser.finish(), []
        else:
            evs, lps = parser.feed(ev.text), ev.logprobs
        got.add(evs)
        evs = whole(evs)  # a call is sent once it is whole, or never
        for e in evs:
            if isinstance(e, ContentDelta):
                yield chunk({"content": e.text}, lps=lps)
            elif isinstance(e, ReasoningDelta):
                yield chunk({"reasoning_content": e.text}, lps=lps)
            elif isinstance(e, ToolCallStart):
                call_ids[e.index] = f"call_{uuid.uuid4().hex[:24]}"
                yield chunk({"tool_calls": [{"index": e.index, "id": call_ids[e.index],
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
            finish = _finish(ev)
            if call_ids and ev.finish == "stop":
                finish = "tool_calls"
                srv.remember(ev, thinking, got, [call_ids[i] for i in sorted(got.closed)])
            yield chunk({}, finish)
            yield ev
