"""`dsflash serve` end to end: a real uvicorn process on loopback over the tiny built-in checkpoint, driven by
the `openai` and `anthropic` client packages and raw httpx."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsflash.engine.json_mode import START, compile_schema, feed, schema_start
from dsflash.tokenizer import EOS_ID
from tests.conftest import end_process, free_port, read_metrics, serve_app, start_server

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[1]
NO_THINK = {"chat_template_kwargs": {"thinking": False}}

@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[Path, Path]:
    from dsflash.checkpoint.builtin import seeded_checkpoint

    tmp = tmp_path_factory.mktemp("serve")
    return tmp, seeded_checkpoint(tmp)  # tiny-a weights (make_checkpoint) + build_tiny_tokenizer's tokenizer.json


@pytest.fixture(scope="module")
def prompt_tokens(served):
    """The token count of a chat request's prompt without thinking: the V4.1 chat encoding of its messages
    and tools, through the served checkpoint's tokenizer."""
    from dsflash.server.encoding import encode_messages
    from dsflash.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(served[1])
    return lambda messages, tools=None: len(
        tokenizer.encode(encode_messages(messages, tools, thinking=False), add_special_tokens=False).ids)


@pytest.fixture(scope="module")
def server(served):
    tmp, ckpt = served
    # a small context so the context-length error is cheap to provoke; 16-row chunks for progress
    proc, base = serve_app(ckpt, tmp, 1024, "tiny", 16)
    yield base
    end_process(proc)


def test_models_and_health(server, oai):
    assert httpx.get(server + "/health").json()["status"] == "ok"
    assert [m.id for m in oai.models.list().data] == ["tiny"]


def test_chat_stream_matches_non_stream_and_caches(server, oai, prompt_tokens):
    messages = [{"role": "user", "content": "Hello there"}]
    before = read_metrics(server)
    full = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                       extra_body=NO_THINK)
    choice = full.choices[0]
    # greedy on the seeded tiny checkpoint: no EOS among the first 6 tokens, so cut by max_tokens
    assert (choice.finish_reason, full.usage.completion_tokens) == ("length", 6)
    assert full.usage.prompt_tokens == prompt_tokens(messages)

    chunks = list(oai.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body=NO_THINK))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # same prompt again

    follow = messages + [{"role": "assistant", "content": choice.message.content},
                         {"role": "user", "content": "and then?"}]
    second = oai.chat.completions.create(model="tiny", messages=follow, max_tokens=3, temperature=0,
                                         extra_body=NO_THINK)
    assert second.usage.prompt_tokens_details.cached_tokens >= full.usage.prompt_tokens

    after = read_metrics(server)
    assert after['dsflash_requests_total{endpoint="chat_completions"}'] >= \
        before.get('dsflash_requests_total{endpoint="chat_completions"}', 0) + 3
    assert after["dsflash_generated_tokens_total"] > before["dsflash_generated_tokens_total"]
    assert after["dsflash_cached_tokens_total"] > before["dsflash_cached_tokens_total"]
    assert after["dsflash_time_to_first_token_seconds_count"] >= before["dsflash_time_to_first_token_seconds_count"] + 3


def test_chat_thinking_logprobs_and_stop(oai):
    r = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                    temperature=0.8, seed=3, logprobs=True, top_logprobs=2,
                                    reasoning_effort="low")
    msg = r.choices[0].message
    assert isinstance(msg.model_extra.get("reasoning_content"), str)  # thinking mode on by default
    lps = r.choices[0].logprobs.content
    assert len(lps) == r.usage.completion_tokens and all(len(x.top_logprobs) == 2 for x in lps)
    again = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                        temperature=0.8, seed=3, reasoning_effort="low")
    assert again.choices[0].message.model_extra["reasoning_content"] == msg.model_extra["reasoning_content"]


def test_logit_bias_forces_a_token(oai):
    r = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                    temperature=0, logit_bias={"300": 100}, logprobs=True)
    tokens = [x.token for x in r.choices[0].logprobs.content]
    assert len(tokens) == 4 and len(set(tokens)) == 1


def test_end_tokens_min_tokens_and_ignore_eos(oai):
    eos = {str(EOS_ID): 100}
    kw = dict(model="tiny", prompt="def sum", max_tokens=6, temperature=0)
    r = oai.completions.create(**kw, logit_bias=eos)
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", 1)
    r = oai.completions.create(**kw, logit_bias=eos, extra_body={"min_tokens": 3})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", 4)
    r = oai.completions.create(**kw, logit_bias=eos, extra_body={"ignore_eos": True})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 6)
    r = oai.completions.create(**kw, logit_bias={"300": 100}, extra_body={"stop_token_ids": [300]})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens, r.choices[0].text) == ("stop", 1, "")


@pytest.mark.slow  # ~8 s on 2 cores
def test_n_choices(oai, server):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0.9, seed=1,
              extra_body=NO_THINK)
    one = oai.chat.completions.create(**kw)
    three = oai.chat.completions.create(**kw, n=3)
    texts = [c.message.content for c in three.choices]
    assert [c.index for c in three.choices] == [0, 1, 2] and texts[0] == one.choices[0].message.content
    assert len(set(texts)) > 1  # seeds 1, 2, 3
    assert three.usage.completion_tokens == sum(
        oai.chat.completions.create(**{**kw, "seed": 1 + i}).usage.completion_tokens for i in range(3))
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    greedy = oai.completions.create(model="tiny", prompt="def", max_tokens=4, temperature=0, n=2)
    assert len(greedy.choices) == 2 and greedy.choices[0].text == greedy.choices[1].text
    # streamed: the choices' chunks interleave, each with its index; the same texts, the usage summed once
    chunks = list(oai.chat.completions.create(**kw, n=3, stream=True, stream_options={"include_usage": True}))
    streamed, finished = ["", "", ""], set()
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert streamed == texts and finished == {0, 1, 2}
    assert [c.usage for c in chunks if c.usage] == [three.usage]
    pieces, plain = ["", ""], oai.completions.create(model="tiny", prompt="def", max_tokens=4, temperature=0.9,
                                                     seed=5, n=2)
    for c in oai.completions.create(model="tiny", prompt="def", max_tokens=4, temperature=0.9, seed=5, n=2,
                                    stream=True):
        for ch in c.choices:
            pieces[ch.index] += ch.text
    assert pieces == [c.text for c in plain.choices]


def test_completions(oai):
    r = oai.completions.create(model="tiny", prompt="def sum", max_tokens=5, temperature=0)
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 5)  # greedy: no EOS in 5 tokens
    text = r.choices[0].text
    stream = "".join(c.choices[0].text for c in oai.completions.create(
        model="tiny", prompt="def sum", max_tokens=5, temperature=0, stream=True) if c.choices)
    assert stream == text
    if len(text) > 2:  # a stop string cuts the text before it
        stop = text[1:3]
        cut = oai.completions.create(model="tiny", prompt="def sum", max_tokens=5, temperature=0, stop=[stop])
        assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"
    plain = oai.completions.create(model="tiny", prompt="def sum", max_tokens=32, temperature=0).choices[0].text
    penalised = dict(model="tiny", prompt="def sum", max_tokens=32, temperature=0, presence_penalty=2,
                     frequency_penalty=2, extra_body={"repetition_penalty": 3.0})
    first = oai.completions.create(**penalised).choices[0].text
    assert first != plain and oai.completions.create(**penalised).choices[0].text == first


def test_anthropic_messages(claude):
    kw = dict(model="tiny", max_tokens=5, extra_body={"temperature": 0}, system="Be brief.",
              messages=[{"role": "user", "content": "Hello"}])
    msg = claude.messages.create(**kw)
    assert msg.role == "assistant" and msg.stop_reason == "max_tokens"  # greedy: no EOS in 5 tokens
    assert msg.usage.output_tokens == 5
    text = "".join(b.text for b in msg.content if b.type == "text")

    with claude.messages.stream(**kw) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert "".join(b.text for b in final.content if b.type == "text") == text
    assert final.stop_reason == msg.stop_reason
    assert final.usage.cache_read_input_tokens > 0  # the same prompt, from the prefix cache


@pytest.mark.parametrize("body, param", [
    ("{not json", "body"),
    ("[1, 2]", "body"),
    ('{"messages": []}', "messages"),
    ('{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "max_tokens"),
    ('{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature"),
    ('{"messages": [{"role": "user", "content": "x"}], "presence_penalty": 2.5}', "presence_penalty"),
    ('{"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0}', "repetition_penalty"),
    ('{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"a": 1}}', "logit_bias"),
    ('{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 101}}', "logit_bias"),
    ('{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"99999": 1}}', "logit_bias"),
    ('{"messages": [{"role": "user", "content": "x"}], "stop_token_ids": [99999]}', "stop_token_ids"),
    ('{"messages": [{"role": "user", "content": "x"}], "min_tokens": -1}', "min_tokens"),
    ('{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}',
     "response_format"),
    ('{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": '
     '{"name": "s", "schema": {"type": "object", "properties": {"a": {"type": "string", "format": "date"}}}}}}',
     "response_format"),
    ('{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}', "response_format"),
    ('{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}, "tools": '
     '[{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}', "response_format"),
    ('{"messages": [{"role": "wizard", "content": "x"}]}', "messages[0].role"),
    ('{"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": []}}',
     "stream_options.include_usage"),
])
def test_bad_chat_requests_are_400(server, body, param):
    r = httpx.post(server + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and param in err["message"]


def test_context_length_and_anthropic_errors(server, oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 1500}],
                                    max_tokens=4)
    err = e.value.body
    assert err["code"] == "context_length_exceeded" and err["prompt_tokens"] > err["max_context"] == 1024
    r = httpx.post(server + "/v1/messages", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    m = read_metrics(server)
    assert m['dsflash_errors_total{kind="context_length_exceeded"}'] >= 1
    assert m['dsflash_errors_total{kind="invalid_request"}'] >= 1


def test_stream_disconnect_stops_generation(server):
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 100, "stream": True,
            "temperature": 0, **NO_THINK}
    before = read_metrics(server)["dsflash_generated_tokens_total"]
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                break  # close the connection after the first content
    deadline = time.time() + 20
    while read_metrics(server)["dsflash_running"] and time.time() < deadline:
        time.sleep(0.1)
    assert read_metrics(server)["dsflash_running"] == 0
    assert read_metrics(server)["dsflash_generated_tokens_total"] - before < 60


def test_tool_calls_formatting_in_process():
    """Tool calls from DSML output, streamed and whole, with a scripted worker: streamed, a call is sent once it
    is whole (its start, then all its arguments), never in pieces a cut-off could leave invalid."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from dsflash.server.app import create_app
    from dsflash.server.encoding import ToolCall, render_assistant_completion
    from dsflash.server.worker import Done, Text
    from dsflash.tokenizer import build_tiny_tokenizer

    completion = render_assistant_completion("Let me look.", [ToolCall("get_weather", '{"city": "Paris", "days": 2}')],
                                             reasoning=None)

    class ScriptedWorker:
        def submit(self, job, emit):
            for i in range(0, len(completion), 7):
                emit(Text(completion[i:i + 7], []))
            emit(Done("stop", None, len(job.prompt), 0, 12, {}))

    engine = SimpleNamespace(max_context=4096, args=SimpleNamespace(vocab_size=512),
                             encoder=SimpleNamespace(reconnects=None),  # a local encoder half: no box
                             tier_stats=dict)  # every weight resident
    app = create_app(engine, build_tiny_tokenizer(512), prefix_cache=False, model_name="tiny",
                     thinking=False)  # the scripted replies hold no reasoning
    app.state.server.worker = ScriptedWorker()
    client = TestClient(app)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": tools, **NO_THINK}
    r = client.post("/v1/chat/completions", json=body).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look."
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}

    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    args = "".join(d["tool_calls"][0]["function"].get("arguments", "") for d in deltas if "tool_calls" in d)
    assert json.loads(args) == {"city": "Paris", "days": 2}
    assert [("id" in d["tool_calls"][0], bool(d["tool_calls"][0]["function"].get("arguments")))
            for d in deltas if "tool_calls" in d] == [(True, False), (False, True)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"

    anth = {"max_tokens": 10, "messages": [{"role": "user", "content": "weather?"}],
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]}
    m = client.post("/v1/messages", json=anth).json()
    assert m["stop_reason"] == "tool_use" and m["content"][-1]["input"] == {"city": "Paris", "days": 2}

    resp_body = {"input": "weather?", "tools": [{"type": "function", "name": "get_weather",
                                                  "parameters": {"type": "object"}}]}
    out = client.post("/v1/responses", json=resp_body).json()["output"]
    assert [o["type"] for o in out] == ["message", "function_call"]
    assert json.loads(out[1]["arguments"]) == {"city": "Paris", "days": 2}
    with client.stream("POST", "/v1/responses", json={**resp_body, "stream": True}) as s:
        events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    pieces = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(pieces) == 1 and json.loads(pieces[0]) == {"city": "Paris", "days": 2}  # sent once whole
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["output"][1]["name"] == "get_weather"


_SCALARS = (st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
            | st.text(max_size=20))
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4) |
                     st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "bogus", 3]),
                                  "content": _JSON | st.text(max_size=30)})
_FIELDS = {
    "/v1/chat/completions": {"messages": st.lists(_MESSAGE, max_size=3) | _JSON, "temperature": _JSON,
                             "top_p": _JSON, "top_k": _JSON, "seed": _JSON, "stop": _JSON, "stream": _JSON,
                             "logprobs": _JSON, "top_logprobs": _JSON, "tools": _JSON, "reasoning_effort": _JSON,
                             "stream_options": _JSON, "max_tokens": st.integers(-2, 2) | _JSON},
    "/v1/completions": {"prompt": _JSON | st.text(max_size=30), "temperature": _JSON, "stream": _JSON,
                        "max_tokens": st.integers(-2, 2) | _JSON, "stop": _JSON},
    "/v1/messages": {"messages": st.lists(_MESSAGE, max_size=3) | _JSON, "system": _JSON, "stream": _JSON,
                     "max_tokens": st.integers(-2, 2) | _JSON, "thinking": _JSON, "tools": _JSON},
    "/v1/responses": {"input": st.lists(_JSON, max_size=3) | _JSON | st.text(max_size=20), "instructions": _JSON,
                      "stream": _JSON, "max_output_tokens": st.integers(-2, 2) | _JSON, "tools": _JSON,
                      "reasoning": _JSON},
}


@st.composite
def _request(draw):
    path = draw(st.sampled_from(sorted(_FIELDS)))
    fields = _FIELDS[path]
    keys = draw(st.lists(st.sampled_from(sorted(fields)), unique=True))
    body = {k: draw(fields[k]) for k in keys}
    body.setdefault("max_tokens", 1)  # valid bodies generate; keep them short
    if path == "/v1/responses":
        body.setdefault("max_output_tokens", 1)
    if draw(st.booleans()):
        body.update(draw(st.dictionaries(st.text(max_size=6), _JSON, max_size=2)))
    return path, body


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(req=_request())
def test_fuzzed_request_bodies_never_give_5xx(server, req):
    path, body = req
    r = httpx.post(server + path, json=body, timeout=60)
    assert r.status_code < 500, (path, body, r.text)
    if body.get("stream") is True and r.status_code == 200:
        assert "data:" in r.text or "event:" in r.text


def test_server_healthy_after_fuzzing(server):
    assert httpx.get(server + "/health").json()["status"] == "ok"


def test_tool_call_round_trip_through_the_real_model(oai, claude, prompt_tokens):
    """A conversation carrying a tool definition, the assistant's call and the tool's result is encoded
    (DSML) and answered by the real model through both client libraries."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    ]
    r = oai.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=3, temperature=0,
                                    extra_body=NO_THINK)
    # 3 greedy tokens: neither EOS nor a whole DSML call fits, so cut by max_tokens
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 3)
    assert r.usage.prompt_tokens == prompt_tokens(messages, tools)
    m = claude.messages.create(model="tiny", max_tokens=3, tools=[{
        "name": "get_weather", "description": "Weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "tu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1", "content": "21 C"}]}],
        extra_body={"temperature": 0})
    assert (m.stop_reason, m.usage.output_tokens) == ("max_tokens", 3)
    # the same conversation in OpenAI form (tool_use -> tool_calls, tool_result -> a tool message, the tool's
    # keys in the order the conversion writes them), thinking off
    as_openai = [messages[0], {**messages[1], "tool_calls": [{**messages[1]["tool_calls"][0], "id": "tu_1"}]},
                 {"role": "tool", "tool_call_id": "tu_1", "content": "21 C"}]
    fn = tools[0]["function"]
    as_openai_tools = [{"type": "function", "function": {"name": fn["name"], "parameters": fn["parameters"],
                                                         "description": fn["description"]}}]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == prompt_tokens(as_openai, as_openai_tools)
    assert m.usage.input_tokens >= 1  # the last prompt token is always computed (its logits give the first)


@pytest.mark.slow  # ~5 s on 2 cores; the default run keeps the tool-call round trip
def test_tool_choice(oai, claude, server):
    """none keeps the tools out of the prompt; required/any and a named tool force a call (the DSML block
    and the invoke of a forced tool are forced tokens; the arguments are the model's), in every API and
    streamed or not; a forced tool that is not offered is refused."""
    def tool(name):
        return {"type": "function", "function": {"name": name, "description": "a tool",
                                                 "parameters": {"type": "object", "properties": {}}}}

    tools = [tool("get_weather"), tool("get_time")]
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=1, temperature=0,
              extra_body=NO_THINK)
    bare = oai.chat.completions.create(**kw).usage.prompt_tokens
    assert oai.chat.completions.create(**kw, tools=tools, tool_choice="none").usage.prompt_tokens == bare
    assert oai.chat.completions.create(**kw, tools=tools, tool_choice="auto").usage.prompt_tokens > bare + 20
    kw["max_tokens"] = 40
    named = {"type": "function", "function": {"name": "get_time"}}
    calls = oai.chat.completions.create(**kw, tools=tools, tool_choice=named).choices[0].message.tool_calls
    assert [c.function.name for c in calls][:1] == ["get_time"]
    streamed = [d.function.name for c in oai.chat.completions.create(**kw, tools=tools, tool_choice=named, stream=True)
                for ch in c.choices for d in ch.delta.tool_calls or () if d.function and d.function.name]
    assert streamed[:1] == ["get_time"]
    calls = oai.chat.completions.create(**kw, tools=tools, tool_choice="required").choices[0].message.tool_calls
    assert calls and calls[0].function.name in ("get_weather", "get_time")
    msg = claude.messages.create(model="tiny", max_tokens=40, messages=[{"role": "user", "content": "Hi"}],
                                 tools=[{"name": "get_time", "input_schema": {"type": "object"}}],
                                 tool_choice={"type": "tool", "name": "get_time"}, extra_body={"temperature": 0})
    assert [b.name for b in msg.content if b.type == "tool_use"][:1] == ["get_time"]
    out = oai.responses.create(model="tiny", input="Hi", max_output_tokens=40, temperature=0,
                               tools=[{"type": "function", "name": "get_time", "parameters": {"type": "object"}}],
                               tool_choice={"type": "function", "name": "get_time"})
    assert [o.name for o in out.output if o.type == "function_call"][:1] == ["get_time"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "tools": tools}
    for choice in ({"type": "function", "function": {"name": "nope"}}, "sometimes"):
        r = httpx.post(server + "/v1/chat/completions", json={**chat, "tool_choice": choice}, timeout=60)
        assert r.status_code == 400 and "tool_choice" in r.text, r.text
    r = httpx.post(server + "/v1/chat/completions", json={**chat, "tools": [], "tool_choice": "required"}, timeout=60)
    assert r.status_code == 400 and "tool_choice" in r.text, r.text


@pytest.mark.slow  # ~16 s on 2 cores; tests/test_json_mode.py covers the decoding in the default set
def test_json_mode(oai, server):
    """response_format json_object (chat, completions) and text.format json_object (Responses): the answer
    is a JSON object text, whole once the model ends it, cut by max_tokens otherwise."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Reply in JSON"}], max_tokens=30,
              temperature=0.9, seed=3, response_format={"type": "json_object"})
    texts = [oai.chat.completions.create(**kw, extra_body=NO_THINK).choices[0].message.content,
             "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
                 **kw, stream=True, extra_body=NO_THINK) if c.choices),
             oai.completions.create(model="tiny", prompt="JSON:", max_tokens=30, temperature=0.9, seed=3,
                                    extra_body={"response_format": {"type": "json_object"}}).choices[0].text,
             oai.responses.create(model="tiny", input="Reply in JSON", max_output_tokens=30, temperature=0.9,
                                  text={"format": {"type": "json_object"}}, extra_body={"seed": 3}).output_text]
    assert texts[0] == texts[1]
    for text in texts:
        state = feed(START, text.encode())
        assert state is not None and text.lstrip().startswith("{"), text
    # structured outputs: the answer follows the schema (chat nests it under json_schema, Responses not)
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                               "days": {"type": "integer"}}, "required": ["city", "days"]}
    node = compile_schema(schema)
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": schema, "strict": True}}
    chat = oai.chat.completions.create(**{**kw, "max_tokens": 40, "response_format": fmt}, extra_body=NO_THINK)
    out = oai.responses.create(model="tiny", input="Plan a trip", max_output_tokens=40, temperature=0.9,
                               text={"format": {"type": "json_schema", "name": "trip", "schema": schema}})
    for text in (chat.choices[0].message.content, out.output_text):
        assert feed(schema_start(node), text.encode()) is not None, text
        if chat.choices[0].finish_reason == "stop" and text == chat.choices[0].message.content:
            assert json.loads(text)["city"] in ("Paris", "Rome")
    # with thinking, the constraint waits for the reasoning's end (this random model rarely gets there): the
    # request runs through the triggered path without error
    r = oai.chat.completions.create(**{**kw, "max_tokens": 8}, extra_body={"chat_template_kwargs": {"thinking": True}})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 8)  # still in the reasoning


def test_streamed_prefill_progress(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "tell me a story " * 8}], "max_tokens": 2,
            "stream": True, "return_progress": True, **NO_THINK}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    assert progress, chunks[:3]
    assert progress[-1]["processed"] == progress[-1]["total"] and progress[-1]["total"] > 16, progress
    assert all(a["processed"] <= b["processed"] for a, b in zip(progress, progress[1:], strict=False))


def test_responses_api_streaming_and_not(oai):
    kwargs = {"model": "tiny", "input": "Say something", "max_output_tokens": 5, "temperature": 0}
    r = oai.responses.create(**kwargs)
    # greedy: no EOS in 5 tokens, so the response is incomplete for max_output_tokens
    assert r.object == "response" and r.usage.input_tokens > 0 and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 5
    events = list(oai.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == r.output_text
    # a function call and its output in the input are encoded and answered
    follow = oai.responses.create(model="tiny", max_output_tokens=3, temperature=0, tools=[
        {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}], input=[
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    assert follow.usage.input_tokens > r.usage.input_tokens
    bad = httpx.post(str(oai.base_url) + "responses", json={"model": "tiny", "input": [{"type": "image"}]})
    assert bad.status_code == 400 and "input[0].type" in bad.text


def test_chat_client_holds_a_conversation(server):
    script = "Hello there\nAnd again\n/exit\n"
    r = subprocess.run([sys.executable, "-m", "dsflash.cli", "chat", "--url", server, "--max-tokens", "3",
                        "--temperature", "0"], input=script, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\n") >= 2 and "error" not in r.stderr


def test_images_to_a_model_without_vision_are_400(server):
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}], **NO_THINK}
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "no vision tower" in r.text


def test_api_key_through_dsflash_serve(tmp_path):
    """`dsflash serve --api-key`: both client libraries with the key work, without it get 401; probes
    stay open."""
    from dsflash.checkpoint.builtin import seeded_checkpoint

    port = free_port()
    proc = start_server(["-m", "dsflash.cli", "serve", "--model", str(seeded_checkpoint(tmp_path)), "--port",
                         str(port), "--api-key", "k3y", "--log-level", "warning",
                         "--served-model-name", "tiny"], port)
    base = f"http://127.0.0.1:{port}"
    try:
        ask = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
        client = openai.OpenAI(base_url=base + "/v1", api_key="k3y")
        assert client.chat.completions.create(**ask).choices
        assert [c for c in client.chat.completions.create(**ask, stream=True)]  # streams pass the guard
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).chat.completions.create(**ask)
        assert anthropic.Anthropic(base_url=base, api_key="k3y").messages.create(**ask).usage.output_tokens == 1
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(**ask)
        assert httpx.get(base + "/v1/models").status_code == 401
        assert httpx.get(base + "/health").status_code == 200
    finally:
        proc.terminate()
        proc.wait(10)
