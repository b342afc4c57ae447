"""`POST /v1/responses`: OpenAI's Responses API (what Codex-style clients speak) over the same engine.

Input items (text, messages with input_text/output_text parts, function_call and function_call_output)
become a chat conversation for the V4.1 encoding; the generated text is parsed into output items
(reasoning, message, function_call). Streaming sends the Responses event sequence: response.created,
output_item.added, content_part.added, output_text.delta ..., function_call_arguments.delta ...,
the .done events, response.completed.

Responses are kept in memory (the last `STORED` unless `store: false`) for `previous_response_id`, whose
input and output then come before the new input, and for `GET /v1/responses/{id}`; an id not kept is a
400 (`previous_response_not_found`), never a silently shorter conversation. The server's own `reasoning`
output items are accepted as input: their text is the next assistant turn's reasoning.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from pydantic import Field

from dsflash.server.dsml import (
    Collected,
    ContentDelta,
    DsmlParser,
    ToolCallArgumentsDelta,
    ToolCallStart,
    WholeCalls,
)
from dsflash.server.errors import ApiError
from dsflash.server.images import ImageError, Images
from dsflash.server.params import Sampling, offered_tools, reasoning_effort
from dsflash.server.server import Server
from dsflash.server.sse import event_stream
from dsflash.server.worker import Done, Job


class ResponsesRequest(Sampling):
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None  # text.format: text or json_object
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool = True


STORED = 256  # responses kept for previous_response_id and retrieval


def _text_of(content: Any, where: str, images: Images) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, p in enumerate(content):
            kind = p.get("type") if isinstance(p, dict) else None
            if kind == "input_image":
                try:
                    parts.append(images.add_data_url(p.get("image_url"), f"{where}[{i}].image_url"))
                except ImageError as e:
                    raise ApiError(400, str(e), e.field) from e
                continue
            if kind not in ("input_text", "output_text", "text"):
                raise ApiError(400, f"{where}[{i}].type: only text and image parts are supported", f"{where}[{i}].type")
            parts.append(str(p.get("text", "")))
        return "".join(parts)
    raise ApiError(400, f"{where}: expected a string or a list of text parts", where)


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its content's reasoning_text parts, else its summary's parts."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text", ""), str)
                                              for p in parts):
        raise ApiError(400, f"{where}.summary: expected a list of text parts", f"{where}.summary")
    return "\n\n".join(p.get("text", "") for p in parts)


def to_messages(req: ResponsesRequest, items: list[dict], images: Images) -> tuple[list[dict], list[dict] | None]:
    """Responses input items (after those of the previous response) + instructions + tools -> chat messages
    and chat-style tools. A reasoning item gives the next assistant turn its reasoning; the function calls
    after an assistant message are that turn's calls."""
    messages: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    reasoning: str | None = None

    def assistant(content: str | None) -> dict:
        nonlocal reasoning
        messages.append({"role": "assistant", "content": content})
        if reasoning is not None:
            messages[-1]["reasoning_content"], reasoning = reasoning, None
        return messages[-1]

    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            role = "system" if role == "developer" else role
            if not isinstance(role, str) or role not in ("user", "assistant", "system"):
                raise ApiError(400, f"input[{i}].role: expected user, assistant, system or developer",
                               f"input[{i}].role")
            text = _text_of(item.get("content"), f"input[{i}].content", images)
            if role == "assistant":
                assistant(text)
            else:
                messages.append({"role": role, "content": text})
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, f"input[{i}]")
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            turn = messages[-1] if messages and messages[-1]["role"] == "assistant" and reasoning is None \
                else assistant(None)
            turn.setdefault("tool_calls", []).append(call)
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
            "output_tokens": done.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": done.reasoning_tokens},
            "total_tokens": done.prompt_tokens + done.completion_tokens}


def output_items(got: Collected, msg_id: str, call_ids: dict[int, tuple[str, str]]) -> list[dict]:
    """Responses output items of a parsed reply: reasoning, the message, the function calls."""
    out = []
    if got.reasoning:
        text = "".join(got.reasoning)
        out.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex[:24]}",
                    "summary": [{"type": "summary_text", "text": text}],
                    "content": [{"type": "reasoning_text", "text": text}]})
    if got.content or not got.closed:
        out.append({"type": "message", "id": msg_id, "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": "".join(got.content), "annotations": []}]})
    for i in sorted(got.closed):  # a call cut by max_output_tokens has no whole arguments: left out
        item_id, call_id = call_ids.get(i) or (f"fc_{uuid.uuid4().hex[:24]}", f"call_{uuid.uuid4().hex[:24]}")
        out.append({"type": "function_call", "id": item_id, "call_id": call_id, "name": got.calls[i].name,
                    "arguments": got.calls[i].arguments, "status": "completed"})
    return out


def _echo(req: ResponsesRequest) -> dict:
    """The request's parameters as the Responses object repeats them (OpenAI's defaults where not sent)."""
    return {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens or req.max_tokens,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p, "tools": req.tools or [],
            "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls,
            "reasoning": req.reasoning or {"effort": None, "summary": None},
            "text": req.text or {"format": {"type": "text"}}, "previous_response_id": req.previous_response_id,
            "store": req.store, "metadata": req.metadata or {}, "truncation": "disabled"}


def add_routes(app: FastAPI, srv: Server) -> None:
    m = srv.metrics
    stored: OrderedDict[str, tuple[list[dict], dict]] = OrderedDict()  # id -> (input items, response)

    def response_object(rid: str, created: float, status: str, output: list, done: Done | None, echo: dict) -> dict:
        obj = {"id": rid, "object": "response", "created_at": created, "status": status, "model": srv.model_name,
               "output": output, "incomplete_details": None, "error": None, **echo}
        if done is not None:
            obj["usage"] = _usage(done)
            if done.finish == "length":
                obj["status"], obj["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        return obj

    def finished(req: ResponsesRequest, items: list[dict], obj: dict, done: Done, thinking: bool,
                 got: Collected) -> dict:
        """Keep a finished response (for previous_response_id and retrieval) and its calls (for replay)."""
        srv.remember(done, thinking, got, [o["call_id"] for o in obj["output"] if o["type"] == "function_call"])
        if req.store:
            stored[obj["id"]] = (items, obj)
            while len(stored) > STORED:
                stored.popitem(last=False)
        return obj

    @app.get("/v1/responses/{rid}")
    async def retrieve(rid: str):
        m.inc(m.requests, "responses_retrieve")
        if rid not in stored:
            raise ApiError(404, f"No response with id '{rid}' is stored here (the server keeps the last {STORED} "
                                "in memory)", "response_id", "not_found")
        return stored[rid][1]

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, request: Request):
        arrived = time.perf_counter()
        m.inc(m.requests, "responses")
        srv.check_model(req.model)
        thinking, effort = reasoning_effort((req.reasoning or {}).get("effort"), "reasoning.effort")
        images = Images()
        items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else list(req.input)
        if req.previous_response_id is not None:
            if req.previous_response_id not in stored:
                raise ApiError(400, f"previous_response_id: no response '{req.previous_response_id}' is stored here "
                                    f"(the server keeps the last {STORED} in memory, and none sent with store: false)",
                               "previous_response_id", "previous_response_not_found")
            before, prev = stored[req.previous_response_id]
            items = before + prev["output"] + items
        messages, tools = to_messages(req, items, images)
        tools, forced = offered_tools(tools, req.tool_choice, "parameters")
        job = await srv.off_loop(srv.chat_job, req, messages, tools, forced, thinking, images, arrived,
                                 effort=effort, max_tokens=req.max_output_tokens or req.max_tokens, stop=req.stop,
                                 fmt=(req.text or {}).get("format"), fmt_field="text.format", field="input")
        thinking = job.thinking
        rid, created, echo = f"resp_{uuid.uuid4().hex}", time.time(), _echo(req)
        if req.stream:
            return event_stream(stream(job, request, rid, created, thinking, req, items, echo), job)
        got, _, done = await srv.collect(job, request, thinking)
        obj = response_object(rid, created, "completed", output_items(got, f"msg_{uuid.uuid4().hex[:24]}", {}), done,
                              echo)
        return finished(req, items, obj, done, thinking, got)

    async def stream(job: Job, request: Request, rid: str, created: float, thinking: bool, req: ResponsesRequest,
                     items: list[dict], echo: dict) -> AsyncIterator[str]:
        seq = 0

        def event(kind: str, **data) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **data})}\n\n"

        got, parser, whole = Collected(), DsmlParser(thinking), WholeCalls()
        msg_id, call_ids, order = f"msg_{uuid.uuid4().hex[:24]}", {}, {}  # order: output index by item
        yield event("response.created", response=response_object(rid, created, "in_progress", [], None, echo))
        try:
            async for ev in srv.events(job, request):
                evs = parser.finish() if isinstance(ev, Done) else parser.feed(ev.text)
                got.add(evs)
                evs = whole(evs)  # a call is sent once it is whole, or never
                for e in evs:
                    if isinstance(e, ContentDelta):
                        if "msg" not in order:
                            order["msg"] = len(order)
                            yield event("response.output_item.added", output_index=order["msg"],
                                        item={"type": "message", "id": msg_id, "status": "in_progress",
                                              "role": "assistant", "content": []})
                            yield event("response.content_part.added", item_id=msg_id, output_index=order["msg"],
                                        content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                        yield event("response.output_text.delta", item_id=msg_id, output_index=order["msg"],
                                    content_index=0, delta=e.text)
                    elif isinstance(e, ToolCallStart):
                        call_ids[e.index] = (f"fc_{uuid.uuid4().hex[:24]}", f"call_{uuid.uuid4().hex[:24]}")
                        order[e.index] = len(order)
                        yield event("response.output_item.added", output_index=order[e.index],
                                    item={"type": "function_call", "id": call_ids[e.index][0],
                                          "call_id": call_ids[e.index][1], "name": e.name, "arguments": "",
                                          "status": "in_progress"})
                    elif isinstance(e, ToolCallArgumentsDelta):
                        yield event("response.function_call_arguments.delta", item_id=call_ids[e.index][0],
                                    output_index=order[e.index], delta=e.text)
                if isinstance(ev, Done):
                    out = output_items(got, msg_id, call_ids)
                    by_id = {item["id"]: item for item in out}
                    if "msg" in order:
                        i, text = order["msg"], "".join(got.content)
                        part = {"type": "output_text", "text": text, "annotations": []}
                        yield event("response.output_text.done", item_id=msg_id, output_index=i, content_index=0,
                                    text=text)
                        yield event("response.content_part.done", item_id=msg_id, output_index=i, content_index=0,
                                    part=part)
                        yield event("response.output_item.done", output_index=i, item=by_id[msg_id])
                    for k, (item_id, _) in call_ids.items():
                        if k not in got.closed:  # cut by max_output_tokens: the item stays incomplete
                            continue
                        yield event("response.function_call_arguments.done", item_id=item_id, output_index=order[k],
                                    arguments=got.calls[k].arguments)
                        yield event("response.output_item.done", output_index=order[k], item=by_id[item_id])
                    obj = finished(req, items, response_object(rid, created, "completed", out, ev, echo), ev, thinking,
                                   got)
                    yield event("response.completed", response=obj)
        except ApiError as e:
            yield event("error", code=e.code, message=e.message, param=e.param)
        except Exception as e:  # reported in the stream; the server keeps serving
            yield event("error", code="server_error", message=f"{type(e).__name__}: {e}", param=None)
