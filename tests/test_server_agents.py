"""What agents lean on, through a real server process and the `openai` / `anthropic` clients: forced tool
calls held to the tool's schema, the exact replay of sampled tool calls (prefix-cache hits turn after turn),
Responses' `previous_response_id` and reasoning items, thinking defaults and budgets, usage details, model
names, token counts and prefill progress."""

from __future__ import annotations

import json

import pytest

from tests.conftest import end_process, serve_app

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

NO_THINK = {"chat_template_kwargs": {"thinking": False}}
# a forced call of this tool ends within a few dozen tokens even from random weights: an enum and a boolean
SCHEMA = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}, "hourly": {"type": "boolean"}},
          "required": ["unit", "hourly"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from dsflash.checkpoint.builtin import seeded_checkpoint

    tmp = tmp_path_factory.mktemp("agents")
    proc, base = serve_app(seeded_checkpoint(tmp), tmp, 4096, "tiny,tiny-alias", 16)
    yield base
    end_process(proc)


def _args_ok(args: dict) -> bool:
    return args.get("unit") in ("C", "F") and isinstance(args.get("hourly"), bool) and set(args) == {"unit", "hourly"}


@pytest.mark.slow
def test_forced_calls_follow_the_schema_and_round_trip(oai, claude):
    """A forced call's arguments are JSON of the tool's schema on all three APIs, and the reply sent back
    (with the tool's result) is accepted; a call cut by max_tokens is no call at all."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    ask = [{"role": "user", "content": "Weather?"}]
    kw = dict(model="tiny", tools=tools, temperature=0.7, seed=1, extra_body=NO_THINK)
    r = oai.chat.completions.create(messages=ask, tool_choice="required", max_tokens=100, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and _args_ok(json.loads(call.function.arguments))
    back = ask + [choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    assert oai.chat.completions.create(messages=back, max_tokens=2, **kw).choices
    named = {"type": "function", "function": {"name": "get_weather"}}
    cut = oai.chat.completions.create(messages=ask, tool_choice=named, max_tokens=12, **kw).choices[0]
    assert (cut.finish_reason, cut.message.tool_calls) == ("length", None)

    a_tools = [{"name": "get_weather", "input_schema": SCHEMA}]
    msg = claude.messages.create(model="tiny", max_tokens=100, messages=ask, tools=a_tools, tool_choice={"type": "any"},
                                 extra_body={"temperature": 0.7})
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(uses) == 1 and _args_ok(uses[0].input), msg
    again = claude.messages.create(model="tiny", max_tokens=2, tools=a_tools, messages=ask + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny"}]}])
    assert again.usage.output_tokens >= 1
    cut = claude.messages.create(model="tiny", max_tokens=12, messages=ask, tools=a_tools,
                                 tool_choice={"type": "tool", "name": "get_weather"})
    assert cut.stop_reason == "max_tokens" and not [b for b in cut.content if b.type == "tool_use"]

    r_tools = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
    out = oai.responses.create(model="tiny", input="Weather?", tools=r_tools, tool_choice="required",
                               max_output_tokens=100, temperature=0.7)
    calls = [o for o in out.output if o.type == "function_call"]
    assert out.status == "completed" and len(calls) == 1 and _args_ok(json.loads(calls[0].arguments)), out
    follow = oai.responses.create(model="tiny", tools=r_tools, max_output_tokens=2, input=[
        {"role": "user", "content": "Weather?"}, calls[0].model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert follow.usage.input_tokens > out.usage.input_tokens
    cut = oai.responses.create(model="tiny", input="Weather?", tools=r_tools, tool_choice="required",
                               max_output_tokens=12)
    assert cut.status == "incomplete" and not [o for o in cut.output if o.type == "function_call"]


@pytest.mark.slow
def test_streamed_forced_calls_are_whole_or_absent(oai, claude):
    """Streamed, a forced call arrives whole (its arguments the non-streamed reply's, JSON of the schema) or,
    cut by max_tokens, not at all: no tool-call delta, tool_use block or function_call item is sent for it,
    on all three APIs."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    ask = [{"role": "user", "content": "Weather?"}]
    kw = dict(model="tiny", tools=tools, temperature=0.7, seed=1, extra_body=NO_THINK, tool_choice="required")
    for max_tokens in (100, 12):
        plain = oai.chat.completions.create(messages=ask, max_tokens=max_tokens, **kw).choices[0]
        deltas = [c for c in oai.chat.completions.create(messages=ask, max_tokens=max_tokens, stream=True, **kw)
                  if c.choices and c.choices[0].delta.tool_calls]
        if plain.message.tool_calls is None:  # cut: nothing of the call was streamed
            assert deltas == [] and max_tokens == 12
        else:
            args = "".join(d.choices[0].delta.tool_calls[0].function.arguments or "" for d in deltas)
            assert args == plain.message.tool_calls[0].function.arguments and _args_ok(json.loads(args))

    a_tools = [{"name": "get_weather", "input_schema": SCHEMA}]
    with claude.messages.stream(model="tiny", max_tokens=12, messages=ask, tools=a_tools,
                                tool_choice={"type": "any"}) as stream:
        events = list(stream)
    assert not [e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use"]
    r_tools = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
    events = list(oai.responses.create(model="tiny", input="Weather?", tools=r_tools, tool_choice="required",
                                       max_output_tokens=12, stream=True))
    assert not [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]


def test_forced_call_with_a_schema_outside_the_subset_is_400(server):
    import httpx

    bad = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": bad}}], "tool_choice": "required"}
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.parameters", r.text
    assert "minimum not supported" in r.json()["error"]["message"]


@pytest.mark.slow
def test_ten_tool_turns_hit_the_prefix_cache(oai):
    """An agent loop of 10 turns (a call, its result, the next call): each turn's prompt extends the last
    turn's tokens exactly (its sampled call is replayed, not re-rendered), so the prefix cache serves the
    whole previous turn, the generated tokens included (all but the EOS, which no step ever ran)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    messages = [{"role": "user", "content": "Check the weather every hour."}]
    last = None
    for turn in range(10):
        r = oai.chat.completions.create(model="tiny", messages=messages, tools=tools, tool_choice="required",
                                        max_tokens=200, temperature=0.7, seed=turn, extra_body=NO_THINK)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (turn, choice)
        if last is not None:
            assert r.usage.prompt_tokens_details.cached_tokens >= last.prompt_tokens, (turn, r.usage, last)
            assert r.usage.prompt_tokens_details.cached_tokens >= last.prompt_tokens + last.completion_tokens - 1
        last = r.usage
        call = choice.message.tool_calls[0]
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": f"{20 + turn} C"}]
    # the last call edited by the client is no replay (its canonical rendering is): the cache serves less
    args = json.loads(call.function.arguments)
    edited = json.dumps({**args, "hourly": not args["hourly"]})
    messages[-2] = {**messages[-2], "tool_calls": [{**messages[-2]["tool_calls"][0],
                                                     "function": {"name": "get_weather", "arguments": edited}}]}
    r = oai.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=1, extra_body=NO_THINK)
    assert r.usage.prompt_tokens_details.cached_tokens < last.prompt_tokens + last.completion_tokens - 1


def test_previous_response_id_reasoning_items_and_retrieval(oai, server):
    import httpx

    first = oai.responses.create(model="tiny", input="Remember the word apple.", max_output_tokens=4, temperature=0,
                                 reasoning={"effort": "low"})
    assert [o.type for o in first.output][:1] == ["reasoning"]
    assert first.usage.output_tokens_details.reasoning_tokens == first.usage.output_tokens  # cut inside the reasoning
    got = oai.responses.retrieve(first.id)
    assert got.id == first.id and got.output[0].type == "reasoning"
    second = oai.responses.create(model="tiny", input="What was the word?", previous_response_id=first.id,
                                  max_output_tokens=2, temperature=0, reasoning={"effort": "low"})
    # the same conversation sent whole, the reasoning item included, is the same prompt
    replayed = [o.model_dump(exclude_none=True) for o in first.output]
    whole = oai.responses.create(model="tiny", max_output_tokens=2, temperature=0, reasoning={"effort": "low"}, input=[
        {"role": "user", "content": "Remember the word apple."}, *replayed,
        {"role": "user", "content": "What was the word?"}])
    assert second.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id and second.max_output_tokens == 2
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        oai.responses.create(model="tiny", input="Hi", previous_response_id="resp_nope", max_output_tokens=1)
    unstored = oai.responses.create(model="tiny", input="Hi", max_output_tokens=1, store=False)
    assert httpx.get(f"{server}/v1/responses/{unstored.id}").status_code == 404
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve("resp_nope")


def test_thinking_default_and_each_apis_switch(oai, claude, server):
    """The built-in checkpoint (seeded weights) does not reason unless asked, on every endpoint; each API's
    own switch turns it on or off; Anthropic's budget_tokens is checked as Anthropic does."""
    import httpx

    ask = [{"role": "user", "content": "Hi"}]

    def chat_reasons(**kw) -> bool:
        r = oai.chat.completions.create(model="tiny", messages=ask, max_tokens=2, temperature=0, **kw)
        return "reasoning_content" in (r.choices[0].message.model_extra or {})

    assert not chat_reasons()
    assert chat_reasons(reasoning_effort="low")
    assert chat_reasons(extra_body={"chat_template_kwargs": {"thinking": True}})
    assert not chat_reasons(reasoning_effort="none")
    assert not [o for o in oai.responses.create(model="tiny", input="Hi", max_output_tokens=2).output
                if o.type == "reasoning"]
    out = oai.responses.create(model="tiny", input="Hi", max_output_tokens=2, reasoning={"effort": "high"})
    assert out.output[0].type == "reasoning" and out.usage.output_tokens_details.reasoning_tokens == 2
    assert [b.type for b in claude.messages.create(model="tiny", max_tokens=2, messages=ask).content] == ["text"]
    m = claude.messages.create(model="tiny", max_tokens=1030, messages=ask, stop_sequences=["e"],
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert m.content[0].type == "thinking"
    for thinking, max_tokens in (({"type": "enabled", "budget_tokens": 4}, 100),
                                 ({"type": "enabled", "budget_tokens": 2000}, 1500), ({"type": "enabled"}, 2000)):
        r = httpx.post(server + "/v1/messages", timeout=30, json={"model": "tiny", "max_tokens": max_tokens,
                                                                   "messages": ask, "thinking": thinking})
        assert r.status_code == 400 and "budget_tokens" in r.text and r.json()["type"] == "error", r.text
    usage = oai.chat.completions.create(model="tiny", messages=ask, max_tokens=3, reasoning_effort="low",
                                        temperature=0).usage  # greedy: an unseeded sample may end it by chance
    assert usage.completion_tokens_details.reasoning_tokens == 3  # still reasoning after 3 tokens


def test_a_reasoning_budget_forces_the_end_of_the_reasoning(tmp_path):
    """The cap Anthropic's budget_tokens sets: after that many reasoning tokens `</think>` comes (in process,
    a real engine: 1,024 tokens through a server would be slow on the tiny model)."""
    import asyncio
    from types import SimpleNamespace

    from dsflash.checkpoint.builtin import seeded_checkpoint
    from dsflash.engine.session import Engine
    from dsflash.server.app import create_app
    from dsflash.server.images import Images
    from dsflash.server.params import Sampling
    from dsflash.tokenizer import load_tokenizer

    ckpt = seeded_checkpoint(tmp_path)
    tok = load_tokenizer(ckpt)
    srv = create_app(Engine.load(ckpt, max_context=1024), tok, model_name="tiny").state.server
    job = srv.chat_job(Sampling(temperature=0), [{"role": "user", "content": "Hi"}], None, (), True, Images(), 0.0,
                       max_tokens=12, stop=None, budget=5)
    request = SimpleNamespace(is_disconnected=lambda: asyncio.sleep(0, False))
    got, _, done = asyncio.run(srv.collect(job, request, True))
    assert done.tokens[5] == tok.token_to_id("</think>") and done.reasoning_tokens == 5
    assert len("".join(got.reasoning)) > 0 and done.completion_tokens == 12


def test_api_details(oai, claude, server):
    """Model names and aliases with each API's 404, /v1/models/{id}, count_tokens, error params naming each
    API's own field, the Responses object's echo, special tokens left out of text, text_offset."""
    import httpx

    from dsflash.checkpoint.builtin import seeded_checkpoint
    from dsflash.server.encoding import encode_messages
    from dsflash.tokenizer import load_tokenizer

    ask = [{"role": "user", "content": "Hi"}]
    assert [x.id for x in oai.models.list().data] == ["tiny", "tiny-alias"]
    assert oai.models.retrieve("tiny-alias").id == "tiny-alias"
    assert oai.chat.completions.create(model="tiny-alias", messages=ask, max_tokens=1).model == "tiny"
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-4o", messages=ask, max_tokens=1)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    for call in (lambda: oai.completions.create(model="gpt-4o", prompt="Hi", max_tokens=1),
                 lambda: oai.responses.create(model="gpt-4o", input="Hi", max_output_tokens=1),
                 lambda: oai.models.retrieve("gpt-4o")):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-x", max_tokens=1, messages=ask)
    assert e.value.body["error"]["type"] == "not_found_error"

    tools = [{"name": "get_weather", "description": "Weather", "input_schema": SCHEMA}]
    counted = claude.messages.count_tokens(model="tiny", messages=ask, tools=tools, system="Be brief.").input_tokens
    m = claude.messages.create(model="tiny", max_tokens=1, messages=ask, tools=tools, system="Be brief.")
    assert counted == m.usage.input_tokens + m.usage.cache_read_input_tokens
    tok = load_tokenizer(seeded_checkpoint())  # the served one's (the same seed, the same bytes)
    text = encode_messages([{"role": "system", "content": "Be brief."}, *ask], [{"type": "function", "function": {
        "name": "get_weather", "parameters": SCHEMA, "description": "Weather"}}], thinking=False)
    assert counted == len(tok.encode(text, add_special_tokens=False).ids)

    long = "word " * 5000  # past the 4,096-token context
    for path, body, field in (("/v1/responses", {"input": long}, "input"),
                              ("/v1/completions", {"prompt": long}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}, "messages")):
        r = httpx.post(server + path, json={"model": "tiny", **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (path, r.text)

    out = oai.responses.create(model="tiny", input="Hi", instructions="Be brief.", max_output_tokens=2,
                               temperature=0.5, tool_choice="none", metadata={"k": "v"},
                               tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}])
    assert (out.temperature, out.max_output_tokens, out.instructions, out.tool_choice) == (0.5, 2, "Be brief.", "none")
    assert [t.name for t in out.tools] == ["f"] and out.metadata == {"k": "v"}

    system = tok.token_to_id("<｜System｜>")
    kw = dict(model="tiny", prompt="Hi", max_tokens=3, temperature=0, logprobs=0)
    hidden = oai.completions.create(**kw, logit_bias={str(system): 100})
    assert hidden.choices[0].text == "" and hidden.choices[0].logprobs.tokens == ["<｜System｜>"] * 3
    shown = oai.completions.create(**kw, logit_bias={str(system): 100}, extra_body={"skip_special_tokens": False})
    assert shown.choices[0].text == "<｜System｜>" * 3
    plain = oai.completions.create(**{**kw, "max_tokens": 6}).choices[0]
    tokens, offsets = plain.logprobs.tokens, plain.logprobs.text_offset
    shown = ["" if t in ("<think>", "</think>") else t for t in tokens]  # left out of a completion's text
    assert "".join(shown) == plain.text and offsets == [sum(len(t) for t in shown[:i]) for i in range(len(tokens))]


def _progress(base: str, body: dict) -> list[dict]:
    import httpx

    with httpx.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True, "return_progress": True},
                      timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return [c["prompt_progress"] for c in chunks if "prompt_progress" in c]


def test_prefill_progress_is_monotone_with_llama_cpp_fields(server):
    body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "a long story " * 40}],
            **NO_THINK}
    events = _progress(server, body)
    assert len(events) >= 3 and all(set(e) == {"total", "cache", "processed", "time_ms"} for e in events)
    pairs = list(zip(events, events[1:], strict=False))
    assert all(a["time_ms"] <= b["time_ms"] and a["processed"] < b["processed"] for a, b in pairs)
    assert events[-1]["processed"] == events[-1]["total"] and events[0]["cache"] == 0
    longer = {**body, "messages": [{"role": "user", "content": "a long story " * 40 + "with an ending"}]}
    again = _progress(server, longer)  # resumed from the cache up to a snapshot of the first prompt
    assert again[-1]["cache"] > 16 and again[-1]["processed"] == again[-1]["total"] > events[-1]["total"]


@pytest.mark.slow
def test_serve_chunk_thinking_and_model_names(tmp_path):
    """`dsflash serve --chunk 16 --thinking on --served-model-name a,b`: progress at least every 16 prefilled
    tokens, thinking by default, both names served and the first reported."""
    from dsflash.checkpoint.builtin import seeded_checkpoint
    from tests.conftest import free_port, start_server

    port = free_port()
    proc = start_server(["-m", "dsflash.cli", "serve", "--model", str(seeded_checkpoint(tmp_path)), "--port",
                         str(port), "--chunk", "16", "--thinking", "on", "--served-model-name", "tiny,alias",
                         "--log-level", "warning"], port)
    base = f"http://127.0.0.1:{port}"
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        assert [x.id for x in client.models.list().data] == ["tiny", "alias"]
        r = client.chat.completions.create(model="alias", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert r.model == "tiny" and "reasoning_content" in r.choices[0].message.model_extra
        events = _progress(base, {"model": "tiny", "max_tokens": 1, **NO_THINK,
                                  "messages": [{"role": "user", "content": "a long story " * 30}]})
        # the stream samples the worker's progress every 0.25 s, so it may skip updates (a loaded machine skipped
        # two in a row): each one it sends ends a pass on --chunk 16's grid of prompt positions, or at the snapshot
        # where the generation tail starts (fewer than 16 tokens from the end; CI sampled it), and a prefill of 14
        # passes is reported on the way
        ends = [e["processed"] for e in events[:-1]]
        assert events[-1]["processed"] == events[-1]["total"], events
        assert all(v % 16 == 0 or events[-1]["total"] - v < 16 for v in ends), (ends, events[-1])
        assert len(ends) >= 2, events
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_reply_is_replayed_only_when_it_comes_back_unchanged():
    from dsflash.server.replay import Replays, Reply, tokenize_with

    store = Replays(limit=2)
    store.remember(Reply((5, 6, 1), False, "Let me look.", "", (("call_a", "get", {"x": 1}),)))
    sent = {"role": "assistant", "content": "Let me look.",
            "tool_calls": [{"id": "call_a", "type": "function", "function": {"name": "get", "arguments": '{"x":1}'}}]}
    assert store.match(sent) is not None  # the same JSON value, however it is spaced
    fn = sent["tool_calls"][0]["function"]
    for changed in ({**sent, "content": "Other."}, {**sent, "reasoning_content": "not what was sampled"},
                    {**sent, "tool_calls": [{**sent["tool_calls"][0], "function": {**fn, "arguments": '{"x": 2}'}}]},
                    {**sent, "tool_calls": [{**sent["tool_calls"][0], "id": "call_b"}]}, {**sent, "role": "user"}):
        assert store.match(changed) is None, changed
    verbatim, ids = store.marked([{"role": "user", "content": "Hi"}, sent])
    assert list(verbatim) == [1] and ids == [(5, 6, 1)]
    assert tokenize_with(lambda text: [len(text)], ids)("ab" + verbatim[1][1] + "cde") == [2, 5, 6, 1, 3]
    for k in range(2):  # bounded: the oldest call ids go first
        store.remember(Reply((k,), False, "", "", ((f"call_{k}", "get", {}),)))
    assert store.match(sent) is None


def test_replies_survive_a_restart_through_the_journal(tmp_path):
    """With a cache directory the kept replies are journalled (a real file): a new store on the same file (a
    restarted server) replays them; a damaged line is skipped; the journal is rewritten with the kept replies
    once it holds twice as many lines; a journal that cannot be written leaves the replies in memory."""
    from dsflash.server.replay import Replays, Reply

    journal = tmp_path / "replays-abc.jsonl"
    store = Replays(limit=2, journal=journal)
    reply = Reply((5, 6, 1), True, "Let me look.", "hm", (("call_a", "get", {"x": [1, "y"]}),))
    store.remember(reply)
    sent = {"role": "assistant", "content": "Let me look.", "reasoning_content": "hm",
            "tool_calls": [{"id": "call_a", "type": "function", "function": {"name": "get",
                                                                           "arguments": '{"x": [1, "y"]}'}}]}
    with open(journal, "a") as f:
        f.write('{"ids": [1, 2\n')  # a line cut by a crash
    again = Replays(limit=2, journal=journal)
    assert again.match(sent) == reply
    for k in range(4):  # 1 + 1 damaged + 4 lines > 2 x 2: rewritten with the two kept replies
        again.remember(Reply((k,), False, "", "", ((f"call_{k}", "get", {}),)))
    assert len(journal.read_text().splitlines()) <= 4 and again.match(sent) is None
    assert Replays(limit=2, journal=journal).match({**sent, "content": "", "reasoning_content": None,
        "tool_calls": [{"id": "call_3", "type": "function", "function": {"name": "get", "arguments": "{}"}}]})
    blocked = Replays(journal=tmp_path / "no-such-dir" / "replays.jsonl")  # writes fail: memory only
    blocked.remember(reply)
    assert blocked.match(sent) == reply
