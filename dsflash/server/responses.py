"""`POST /v1/responses`: OpenAI's Responses API (what Codex-style clients speak) over the same engine.

Input items (text, messages with input_text/output_text parts, function_call and function_call_output)
become a chat conversation for the V4.1 encoding; the generated text is parsed into output items
(reasoning, message, function_call). Streaming sends the Responses event sequence: response.created,
output_item.added, content_part.added, output_text.delta ..., function_call_arguments.delta ...,
the .done events, response.completed.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from dsflash.server.app import (
    ApiError,
    Done,
    Server,
    _reasoning_effort,
    _Sampling,
    _sampling,
    _stop_list,
    with_keepalive,
)
from dsflash.server.dsml import ContentDelta, DsmlParser, ReasoningDelta, ToolCallArgumentsDelta, ToolCallStart
from dsflash.server.encoding import EncodingError, encode_messages


class ResponsesRequest(_Sampling):
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    reasoning: dict[str, Any] | None = None


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text"):
                raise ApiError(400, f"{where}[{i}].type: only text parts are supported", f"{where}[{i}].type")
            parts.append(str(p.get("text", "")))
        return "".join(parts)
    raise ApiError(400, f"{where}: expected a string or a list of text parts", where)


def to_messages(req: ResponsesRequest) -> tuple[list[dict], list[dict] | None]:
    """Responses input + instructions + tools -> chat messages and chat-style tools."""
    messages: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("user", "assistant", "system"):
                raise ApiError(400, f"input[{i}].role: expected user, assistant, system or developer",
                               f"input[{i}].role")
            messages.append({"role": role, "content": _text_of(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise ApiError(400, f"input[{i}].type: unsupported item type {kind!r}", f"input[{i}].type")
    tools = None
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if t.get("type") != "function" or not isinstance(t.get("name"), str):
                raise ApiError(400, f"tools[{i}]: only function tools with a name are supported", f"tools[{i}]")
            tools.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                           if k in t}})
    return messages, tools


def _usage(done: Done) -> dict:
    return {"input_tokens": done.prompt_tokens, "input_tokens_details": {"cached_tokens": done.cached_tokens},
            "output_tokens": done.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": done.prompt_tokens + done.completion_tokens}


class _Output:
    """Accumulates parser events into Responses output items."""

    def __init__(self) -> None:
        self.reasoning, self.text = [], []
        self.calls: dict[int, dict] = {}
        self.msg_id = f"msg_{uuid.uuid4().hex[:24]}"

    def items(self) -> list[dict]:
        out = []
        if self.reasoning:
            out.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex[:24]}",
                        "summary": [{"type": "summary_text", "text": "".join(self.reasoning)}]})
        if self.text or not self.calls:
            out.append({"type": "message", "id": self.msg_id, "status": "completed", "role": "assistant",
                        "content": [{"type": "output_text", "text": "".join(self.text), "annotations": []}]})
        out += [self.calls[i] for i in sorted(self.calls)]
        return out


def add_routes(app: FastAPI, srv: Server, model_name: str) -> None:
    m = srv.metrics

    def response_object(rid: str, created: float, status: str, output: list, done: Done | None) -> dict:
        obj = {"id": rid, "object": "response", "created_at": created, "status": status, "model": model_name,
               "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
               "incomplete_details": None, "error": None}
        if done is not None:
            obj["usage"] = _usage(done)
            if done.finish == "length":
                obj["status"], obj["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        return obj

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, request: Request):
        arrived = time.perf_counter()
        m.inc(m.requests, "responses")
        thinking, effort = _reasoning_effort((req.reasoning or {}).get("effort"))
        thinking = bool(req.reasoning) if thinking is None else thinking
        messages, tools = to_messages(req)
        try:
            text = encode_messages(messages, tools, thinking, effort)
        except EncodingError as e:
            raise ApiError(400, str(e), str(e).split(":")[0]) from e
        prompt = srv.tokenize(text)
        job = srv.job(prompt, req.max_output_tokens or req.max_tokens, _sampling(req), _stop_list(req.stop), None,
                      len(prompt) - 1, arrived)
        rid, created = f"resp_{uuid.uuid4().hex}", time.time()
        if req.stream:
            return StreamingResponse(with_keepalive(stream(job, request, rid, created, thinking), job, None),
                                     media_type="text/event-stream")
        out, parser, done = _Output(), DsmlParser(thinking), None
        async for ev in srv.events(job, request):
            evs = parser.finish() if isinstance(ev, Done) else parser.feed(ev.text)
            done = ev if isinstance(ev, Done) else done
            for e in evs:
                if isinstance(e, ContentDelta):
                    out.text.append(e.text)
                elif isinstance(e, ReasoningDelta):
                    out.reasoning.append(e.text)
                elif isinstance(e, ToolCallStart):
                    out.calls[e.index] = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}",
                                          "call_id": f"call_{uuid.uuid4().hex[:24]}", "name": e.name,
                                          "arguments": "", "status": "completed"}
                elif isinstance(e, ToolCallArgumentsDelta):
                    out.calls[e.index]["arguments"] += e.text
        return response_object(rid, created, "completed", out.items(), done)

    async def stream(job, request: Request, rid: str, created: float, thinking: bool) -> AsyncIterator[str]:
        seq = 0

        def event(kind: str, **data) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **data})}\n\n"

        out, parser = _Output(), DsmlParser(thinking)
        message_open, index_of = False, {}
        yield event("response.created", response=response_object(rid, created, "in_progress", [], None))
        try:
            async for ev in srv.events(job, request):
                evs = parser.finish() if isinstance(ev, Done) else parser.feed(ev.text)
                for e in evs:
                    if isinstance(e, ReasoningDelta):
                        out.reasoning.append(e.text)
                    elif isinstance(e, ContentDelta):
                        if not message_open:
                            message_open = True
                            index_of["msg"] = len(index_of)
                            item = {"type": "message", "id": out.msg_id, "status": "in_progress", "role": "assistant",
                                    "content": []}
                            yield event("response.output_item.added", output_index=index_of["msg"], item=item)
                            yield event("response.content_part.added", item_id=out.msg_id,
                                        output_index=index_of["msg"], content_index=0,
                                        part={"type": "output_text", "text": "", "annotations": []})
                        out.text.append(e.text)
                        yield event("response.output_text.delta", item_id=out.msg_id, output_index=index_of["msg"],
                                    content_index=0, delta=e.text)
                    elif isinstance(e, ToolCallStart):
                        call = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}",
                                "call_id": f"call_{uuid.uuid4().hex[:24]}", "name": e.name, "arguments": "",
                                "status": "in_progress"}
                        out.calls[e.index] = call
                        index_of[("call", e.index)] = len(index_of)
                        yield event("response.output_item.added", output_index=index_of[("call", e.index)], item=call)
                    elif isinstance(e, ToolCallArgumentsDelta):
                        out.calls[e.index]["arguments"] += e.text
                        yield event("response.function_call_arguments.delta", item_id=out.calls[e.index]["id"],
                                    output_index=index_of[("call", e.index)], delta=e.text)
                if isinstance(ev, Done):
                    text = "".join(out.text)
                    if message_open:
                        i = index_of["msg"]
                        part = {"type": "output_text", "text": text, "annotations": []}
                        yield event("response.output_text.done", item_id=out.msg_id, output_index=i, content_index=0,
                                    text=text)
                        yield event("response.content_part.done", item_id=out.msg_id, output_index=i,
                                    content_index=0, part=part)
                        yield event("response.output_item.done", output_index=i,
                                    item={"type": "message", "id": out.msg_id, "status": "completed",
                                          "role": "assistant", "content": [part]})
                    for k, call in out.calls.items():
                        call["status"] = "completed"
                        yield event("response.function_call_arguments.done", item_id=call["id"],
                                    output_index=index_of[("call", k)], arguments=call["arguments"])
                        yield event("response.output_item.done", output_index=index_of[("call", k)], item=call)
                    yield event("response.completed",
                                response=response_object(rid, created, "completed", out.items(), ev))
        except ApiError as e:
            yield event("error", code=e.code, message=e.message, param=e.param)
        except Exception as e:  # reported in the stream; the server keeps serving
            yield event("error", code="server_error", message=f"{type(e).__name__}: {e}", param=None)
