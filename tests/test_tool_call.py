"""Forced tool calls: the DSML automaton accepts the chat encoding's rendering of calls whose arguments
follow the schema, refuses ones that do not, and sampling under it (random logits) always gives a call
whose parsed arguments are valid JSON of the schema."""

import json
import random

import pytest
import torch

from dsflash.checkpoint.builtin import seeded_checkpoint
from dsflash.engine.json_mode import SchemaError, Vocab, compile_schema
from dsflash.engine.sampling import SamplingParams, sample
from dsflash.engine.tool_call import ToolCall, parameter_names
from dsflash.server.dsml import parse_complete
from dsflash.server.encoding import EOS, TOOL_CALLS_SEPARATOR, render_tool_calls
from dsflash.server.encoding import ToolCall as Call
from dsflash.server.worker import DSML_SYNTAX
from dsflash.tokenizer import EOS_ID, load_tokenizer, token_bytes
from dsflash.tokens import DSML

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"},
    "days": {"type": "integer"},
    "unit": {"enum": ["C", "F"]},
    "hourly": {"type": "boolean"},
    "where": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]},
}, "required": ["city", "days"]}


@pytest.fixture(scope="module")
def vocab():
    tok = load_tokenizer(seeded_checkpoint())
    return tok, Vocab(token_bytes(tok, (DSML,)))


def tool_call(vocab, tools) -> ToolCall:
    tok, v = vocab
    return ToolCall(v, EOS_ID, DSML_SYNTAX, tools, lambda text: tok.encode(text, add_special_tokens=False).ids)


def accepts(vocab, tools, text: str) -> bool:
    """Whether the automaton takes `text`, then EOS, in some tokenization (each step the longest allowed
    token that `text` goes on with)."""
    _, v = vocab
    c, rest = tool_call(vocab, tools), text.encode()
    while rest:
        allowed = c.allowed()
        ids = allowed if isinstance(allowed, list) else allowed.nonzero().flatten().tolist()
        fits = [t for t in ids if v.tokens[t] and rest.startswith(v.tokens[t])]
        if not fits:
            return False
        best = max(fits, key=lambda t: len(v.tokens[t]))
        c.advance(best)
        rest = rest[len(v.tokens[best]):]
    return EOS_ID in c.allowed() if isinstance(c.allowed(), list) else bool(c.allowed()[EOS_ID])


def rendered(name: str, args: dict) -> str:
    return TOOL_CALLS_SEPARATOR + render_tool_calls([Call(name, json.dumps(args))])


def test_the_encodings_rendering_of_valid_calls_is_accepted(vocab):
    tools = [("get_weather", compile_schema(WEATHER)), ("ping", compile_schema({"type": "object"}))]
    for args in ({"city": "Paris", "days": 2}, {"city": "Rome <b>", "days": -3, "unit": "F", "hourly": True},
                 {"city": "", "days": 0, "where": {"lat": 1.5}}):
        assert accepts(vocab, tools, rendered("get_weather", args)), args
    for args in ({}, {"anything": [1, {"x": None}], "s": "text"}):
        assert accepts(vocab, tools, rendered("ping", args)), args
    for name, args in (("get_weather", {"days": 2}),  # a required property missing
                       ("get_weather", {"city": "Paris", "days": 2.5}),  # not an integer
                       ("get_weather", {"city": "Paris", "days": 1, "unit": "K"}),  # not in the enum
                       ("get_weather", {"days": 1, "city": "Paris"}),  # out of schema order
                       ("get_weather", {"city": "Paris", "days": 1, "other": 1}),  # undeclared
                       ("get_time", {})):  # not a forced tool
        assert not accepts(vocab, tools, rendered(name, args)), (name, args)


@pytest.mark.parametrize("schema", [WEATHER, {"type": "object"}], ids=["declared", "open"])
def test_sampled_calls_parse_into_arguments_of_the_schema(vocab, schema):
    tok, v = vocab
    rng = random.Random(0)
    tools = [("get_weather", compile_schema(schema)), ("get_time", compile_schema({"type": "object"}))]
    finished = 0
    for run in range(12):
        c, out = tool_call(vocab, tools), []
        for pos in range(400):
            logits = torch.randn(len(v.tokens), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
            t = sample(logits, pos, SamplingParams(temperature=1.0, seed=run), constraint=c)
            c.advance(t)
            if t == EOS_ID:
                break
            out.append(t)
        else:
            continue
        finished += 1
        content, _, calls = parse_complete(tok.decode(out, skip_special_tokens=False) + EOS, thinking=False)
        assert content == "" and len(calls) == 1 and calls[0].name in ("get_weather", "get_time")
        args = json.loads(calls[0].arguments)
        assert isinstance(args, dict)
        if calls[0].name == "get_weather" and schema is WEATHER:
            assert isinstance(args["city"], str) and type(args["days"]) is int
            assert set(args) <= set(WEATHER["properties"]) and args.get("unit", "C") in ("C", "F")
    assert finished >= 3  # random walks end a call now and then


def test_names_dsml_cannot_carry_are_refused():
    with pytest.raises(SchemaError, match="DSML name"):
        parameter_names("get", compile_schema({"type": "object", "properties": {'a"b': {"type": "string"}}}))
    with pytest.raises(SchemaError, match="DSML name"):
        parameter_names("a<b", compile_schema({"type": "object"}))
    with pytest.raises(SchemaError, match="root must be an object"):
        parameter_names("get", compile_schema({"type": "string"}))
