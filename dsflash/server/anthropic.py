"""Anthropic's messages API: content blocks (text, image, thinking, tool_use, tool_result) become an
OpenAI-form conversation for the V4.1 encoding; the reply goes back as text, thinking and tool_use blocks,
or as Anthropic's stream of content-block events."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request

from dsflash.server.dsml import (
    Collected,
    ContentDelta,
    DsmlParser,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    WholeCalls,
)
from dsflash.server.errors import ApiError
from dsflash.server.images import ImageError, Images
from dsflash.server.params import CountTokensRequest, MessagesRequest, anthropic_thinking, offered_tools
from dsflash.server.server import Server
from dsflash.server.sse import event_stream
from dsflash.server.worker import Done, Job


def add_routes(app: FastAPI, srv: Server) -> None:
    m = srv.metrics
    add_count_tokens(app, srv)

    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request):
        arrived = time.perf_counter()
        m.inc(m.requests, "messages")
        srv.check_model(req.model)
        images = Images()
        msgs, tools = _anthropic_to_openai(req, images)
        tools, forced = offered_tools(tools, req.tool_choice, "input_schema")
        thinking, budget = anthropic_thinking(req)
        job = await srv.off_loop(srv.chat_job, req, msgs, tools, forced, thinking, images, arrived,
                                 max_tokens=req.max_tokens, stop=req.stop_sequences, budget=budget)
        thinking = job.thinking
        mid = f"msg_{uuid.uuid4().hex[:24]}"
        if req.stream:
            return event_stream(_messages_stream(srv, job, request, mid, thinking), job)
        parser = DsmlParser(thinking)
        blocks: list[dict] = []
        args: dict[int, list[str]] = {}
        closed: set[int] = set()
        done = None

        def block(kind: str) -> dict:
            if not blocks or blocks[-1]["type"] != kind or kind == "tool_use":
                blocks.append({"type": kind, **({"thinking": "", "signature": ""} if kind == "thinking" else
                                                {"text": ""} if kind == "text" else {})})
            return blocks[-1]

        got = Collected()
        async for ev in srv.events(job, request):
            if isinstance(ev, Done):
                done = ev
                evs = parser.finish()
            else:
                evs = parser.feed(ev.text)
            got.add(evs)
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
                elif isinstance(e, ToolCallEnd):
                    closed.add(e.index)
        # a call still open at the end (cut by max_tokens) has no whole input: it is left out
        blocks = [b for b in blocks if b["type"] != "tool_use" or b["_index"] in closed]
        has_calls = False
        srv.remember(done, thinking, got, [b["id"] for b in blocks if b["type"] == "tool_use"])
        for b in blocks:
            if b["type"] == "tool_use":
                has_calls = True
                raw = "".join(args.pop(b.pop("_index"), []))
                try:
                    b["input"] = json.loads(raw) if raw else {}
                except json.JSONDecodeError:
                    b["input"] = {"_raw": raw}
        return {"id": mid, "type": "message", "role": "assistant", "model": srv.model_name, "content": blocks,
                "stop_reason": _stop_reason(done, has_calls), "stop_sequence": done.stop_string,
                "usage": _usage(done)}


def add_count_tokens(app: FastAPI, srv: Server) -> None:
    @app.post("/v1/messages/count_tokens")
    async def count_tokens(req: CountTokensRequest):
        """The prompt's token count of a messages request (the prompt `/v1/messages` would run)."""
        srv.metrics.inc(srv.metrics.requests, "count_tokens")
        srv.check_model(req.model)
        images = Images()
        msgs, tools = _anthropic_to_openai(req, images)
        tools, _ = offered_tools(tools, req.tool_choice, "input_schema")
        thinking = None if req.thinking is None else req.thinking.type != "disabled"
        prompt, _ = await srv.off_loop(srv.prompt, msgs, tools, srv.thinking if thinking is None else thinking, images)
        return {"input_tokens": len(prompt)}


def _stop_reason(done: Done, calls: bool) -> str:
    if done.stop_string is not None:
        return "stop_sequence"
    if done.finish == "length":
        return "max_tokens"
    return "tool_use" if calls else "end_turn"


def _usage(done: Done) -> dict:
    return {"input_tokens": done.prompt_tokens - done.cached_tokens, "output_tokens": done.completion_tokens,
            "cache_read_input_tokens": done.cached_tokens, "cache_creation_input_tokens": 0}


async def _messages_stream(srv: Server, job: Job, request: Request, mid: str, thinking: bool) -> AsyncIterator[str]:
    def event(name: str, data: dict) -> str:
        return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"

    yield event("message_start", {"message": {
        "id": mid, "type": "message", "role": "assistant", "model": srv.model_name, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": len(job.prompt), "output_tokens": 0}}})
    yield event("ping", {})
    parser, got, call_ids, whole = DsmlParser(thinking), Collected(), [], WholeCalls()
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
            got.add(evs)
            evs = whole(evs)  # a call is sent once it is whole, or never
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
                    call_ids.append(f"toolu_{uuid.uuid4().hex[:24]}")
                    for s in open_block("tool_use", {"type": "tool_use", "id": call_ids[-1], "name": e.name,
                                                     "input": {}}):
                        yield s
                elif isinstance(e, ToolCallArgumentsDelta):
                    yield event("content_block_delta", {"index": index, "delta": {"type": "input_json_delta",
                                                                                  "partial_json": e.text}})
            if isinstance(ev, Done):
                srv.remember(ev, thinking, got, [call_ids[i] for i in sorted(got.closed)])
                if open_kind is not None:
                    yield event("content_block_stop", {"index": index})
                u = _usage(ev)
                yield event("message_delta", {"delta": {"stop_reason": _stop_reason(ev, has_calls),
                                                        "stop_sequence": ev.stop_string}, "usage": u})
                yield event("message_stop", {})
    except ApiError as e:
        srv.metrics.inc(srv.metrics.errors, e.code or "invalid_request")
        yield event("error", {"error": {"type": "invalid_request_error", "message": e.message}})
    except Exception as e:
        srv.metrics.inc(srv.metrics.errors, "internal")
        yield event("error", {"error": {"type": "api_error", "message": f"{type(e).__name__}: {e}"}})


def _anthropic_to_openai(req: MessagesRequest, images: Images) -> tuple[list[dict], list[dict] | None]:
    messages: list[dict] = []
    if req.system is not None:
        if isinstance(req.system, str):
            system = req.system
        else:
            for i, b in enumerate(req.system):
                if b.get("type") == "text" and not isinstance(b.get("text"), str):
                    raise ApiError(400, f"system[{i}].text: must be a string", f"system[{i}].text")
            system = "\n\n".join(b["text"] for b in req.system if b.get("type") == "text")
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
