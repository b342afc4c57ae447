"""JSON mode: the byte automaton accepts exactly the prefixes of JSON object texts (against Python's json),
and decoding under it, with or without drafts, gives valid JSON."""

import json
import random
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsflash.checkpoint.builtin import seeded_checkpoint
from dsflash.engine.json_mode import (
    START,
    JsonObject,
    SchemaError,
    Vocab,
    compile_schema,
    feed,
    is_complete,
    schema_start,
)
from dsflash.engine.sampling import AfterReasoning, SamplingParams, sample
from dsflash.engine.spec import DecodeStats, decode
from dsflash.tokenizer import EOS_ID, load_tokenizer, token_bytes
from tests.conftest import partly_right_drafter

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)
OBJECTS = st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=4)


def accepts_prefixes(data: bytes) -> bool:
    """Every prefix of `data` is accepted (the automaton refuses for good at the first bad byte)."""
    return feed(START, data) is not None


@settings(max_examples=300, deadline=None)
@given(OBJECTS, st.sampled_from([None, 2]), st.booleans())
def test_every_prefix_of_a_json_object_is_accepted(obj, indent, ascii_only):
    text = json.dumps(obj, indent=indent, ensure_ascii=ascii_only).encode()
    assert accepts_prefixes(text)
    assert is_complete(feed(START, text)) and is_complete(feed(START, text + b" \n"))


ALPHABET = '{}[]",:0123456789.-+eE \\ntrufalsx'


def python_says_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


@settings(max_examples=2000, deadline=None)
@given(st.text(alphabet=ALPHABET, max_size=14))
def test_complete_exactly_when_python_parses_an_object(text):
    assert is_complete(feed(START, text.encode())) == python_says_object(text)


@pytest.mark.parametrize("text", ['{"a":}', '{"a" 1}', "{'a':1}", "[1]", '{"a":01}', '{"a":1.}', '{"a":tru}',
                                  '{"a":"\x01"}', '{"a":"\\q"}', '{"a":1,}', "{,}", "{}}", '{"a":1}x', '{"a":-}',
                                  '{"a":"\\u12g4"}', '{"a":[1 2]}', '{"a":1e}', '{"a":nul}', ' {"a" : [ ] } ,'])
def test_invalid_texts_are_refused(text):
    assert not accepts_prefixes(text.encode()) or not is_complete(feed(START, text.encode()))
    assert not python_says_object(text)


@pytest.mark.parametrize("data", [b'{"a":"\xff"}', b'{"a":"\xc3"}', b'{"a":"\xed\xa0\x80"}', b'{"\xc0\xaf":1}',
                                  b'{"a":"\xf4\x90\x80\x80"}', b'{"a":"\xe0\x80\x80"}', b'{"\xe2\x82":1}'])
def test_invalid_utf8_in_strings_is_refused(data):
    assert not is_complete(feed(START, data))
    assert is_complete(feed(START, '{"é€😀":"ü"}'.encode()))


@pytest.fixture(scope="module")
def vocab():
    tok = load_tokenizer(seeded_checkpoint())
    return tok, token_bytes(tok)


def test_random_decoding_under_the_mask_stays_json(vocab):
    """Sampling from random logits under the mask: every text is a JSON object prefix; once EOS is chosen
    the text parses."""
    tok, tb = vocab
    rng = random.Random(0)
    finished, cache = 0, {}
    for run in range(40):
        c = JsonObject(Vocab(tb), EOS_ID, cache=cache)
        out = b""
        for pos in range(60):
            t = sample(torch.randn(len(tb), generator=torch.Generator().manual_seed(rng.randrange(1 << 30))),
                       pos, SamplingParams(temperature=1.0, seed=run), constraint=c)
            if t == EOS_ID:
                assert isinstance(json.loads(out), dict)
                finished += 1
                break
            out += tb[t]
            c.advance(t)
            assert accepts_prefixes(out), out
    assert finished  # the walk closes objects now and then


def test_thinking_starts_the_mask_after_the_reasoning(vocab):
    tok, tb = vocab
    think_end = tok.token_to_id("</think>")
    c = AfterReasoning(think_end, JsonObject(Vocab(tb), EOS_ID))
    assert c.allowed() is None
    c.advance(tok.token_to_id("Hello") or 100)
    assert c.allowed() is None
    c.advance(think_end)
    mask = c.allowed()
    assert mask[tok.token_to_id("{")] and not mask[tok.token_to_id("}")] and not mask[EOS_ID]
    # a reasoning budget: after 2 reasoning tokens the reasoning's end is the one token left (a sure draft)
    capped = AfterReasoning(think_end, JsonObject(Vocab(tb), EOS_ID), budget=2)
    capped.advance(100)
    assert capped.allowed() is None and capped.determined(3) == []
    capped.advance(101)
    assert capped.allowed() == [think_end] and capped.determined(3) == [think_end]
    capped.advance(think_end)
    assert capped.allowed()[tok.token_to_id("{")] and capped.reasoning == 2


@pytest.mark.slow  # ~7 s on 2 cores
def test_json_decoding_with_drafts_is_exact(vocab):
    from dsflash.engine.session import Engine

    tok, tb = vocab
    engine = Engine.load(seeded_checkpoint(), max_context=4096)
    ids = tok.encode("Give me JSON:", add_special_tokens=False).ids
    params = SamplingParams(temperature=0.8, seed=5)
    s = engine.session()
    plain = list(decode(s, s.prefill(ids), 30, params, {EOS_ID}, constraint=JsonObject(Vocab(tb), EOS_ID)))
    text = b"".join(tb[t] for t in plain if t != EOS_ID)
    assert accepts_prefixes(text) and text.lstrip().startswith(b"{")
    s = engine.session()
    s.draft = partly_right_drafter(s, len(ids), plain)
    stats = DecodeStats()
    assert list(decode(s, s.prefill(ids), 30, params, {EOS_ID}, dspark=4, stats=stats,
                       constraint=JsonObject(Vocab(tb), EOS_ID), adaptive=False)) == plain
    assert stats.accepted > 0


# ---------------------------------------------------------------------------------------------------------
# structured outputs: a JSON schema's subset
# ---------------------------------------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "description": "annotations are fine"},
    "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}},
    "ok": {"type": "boolean"},
    "kind": {"enum": ["x", 1, None]},
    "nested": {"type": "object", "properties": {"v": {"type": ["number", "null"]}}, "required": ["v"]},
    "extra": {}}, "required": ["name", "age", "nested"], "additionalProperties": False}


def schema_state(text: str):
    return feed(schema_start(compile_schema(SCHEMA)), text.encode())


def conforms(value, schema) -> bool:
    """The subset's meaning, written independently of the automaton."""
    if "const" in schema:
        return json.dumps(value) == json.dumps(schema["const"])
    if "enum" in schema:
        return json.dumps(value) in [json.dumps(e) for e in schema["enum"]]
    kinds = schema.get("type", ["object", "array", "string", "integer", "number", "boolean", "null"])
    kinds = [kinds] if isinstance(kinds, str) else kinds
    is_int = isinstance(value, int) and not isinstance(value, bool)
    ok = {"object": isinstance(value, dict), "array": isinstance(value, list), "string": isinstance(value, str),
          "integer": is_int, "number": is_int or isinstance(value, float), "boolean": isinstance(value, bool),
          "null": value is None}
    if not any(ok[k] for k in kinds):
        return False
    if isinstance(value, dict) and "properties" in schema:
        props = schema["properties"]
        return (set(value) <= set(props) and set(schema.get("required", [])) <= set(value)
                and all(conforms(v, props[k]) for k, v in value.items()))
    if isinstance(value, list) and "items" in schema:
        return all(conforms(v, schema["items"]) for v in value)
    return True


@pytest.mark.parametrize("text", [
    '{"name":"bo","age":3,"nested":{"v":null}}',
    '{ "name" : "é", "age" : -12 , "tags" : ["a","b"], "ok": true, "kind": null, "nested": {"v": 1.5e3},'
    ' "extra": [1, {"z": "free"}] }',
    '{"name":"","age":0,"kind":1,"nested":{"v":-0.5}}',
])
def test_schema_documents_are_accepted(text):
    assert conforms(json.loads(text), SCHEMA) and is_complete(schema_state(text))


@pytest.mark.parametrize("text", [
    '{"name":"x"}',  # required properties missing: cannot close
    '{"age":1,"name":"x","nested":{"v":1}}',  # out of schema order
    '{"name":"x","age":1.5,"nested":{"v":1}}', '{"name":"x","age":"1","nested":{"v":1}}',  # types
    '{"name":"x","age":1,"tags":["c"],"nested":{"v":1}}', '{"name":"x","age":1,"kind":2,"nested":{"v":1}}',
    '{"name":"x","age":1,"zzz":1,"nested":{"v":1}}', '{"name":"x","age":1,"nested":{}}',
    '{"name":"x","age":1e2,"nested":{"v":1}}', '{"name":1,"age":1,"nested":{"v":1}}',
])
def test_schema_violations_are_refused(text):
    assert not is_complete(schema_state(text))


@pytest.mark.parametrize("schema, message", [
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "x"}}}, "pattern"),
    ({"anyOf": [{"type": "string"}]}, "anyOf"),
    ({"type": "object", "properties": {"a": {"$ref": "#/x"}}}, "$ref"),
    ({"type": "object", "properties": {}, "required": ["b"]}, "required"),
    ({"type": "object", "additionalProperties": {"type": "string"}}, "additionalProperties"),
    ({"type": "thing"}, "type"),
])
def test_unsupported_schemas_are_refused(schema, message):
    with pytest.raises(SchemaError, match=re.escape(message)):
        compile_schema(schema)
    with pytest.raises(SchemaError, match="root"):
        schema_start(compile_schema({"type": "string"}))


@pytest.mark.slow  # ~10 s; the prefix and completion tests check the grammar in the default run
def test_random_decoding_under_a_schema_conforms(vocab):
    tok, tb = vocab
    rng, finished = random.Random(1), 0
    node = compile_schema(SCHEMA)
    for run in range(60):
        c = JsonObject(Vocab(tb), EOS_ID, schema=node)
        out = b""
        for pos in range(120):
            logits = torch.randn(len(tb), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
            logits[[tok.token_to_id(t) for t in ('"', "}", '",') if tok.token_to_id(t) is not None]] += 3
            t = sample(logits, pos, SamplingParams(temperature=1.0, seed=run), constraint=c)
            if t == EOS_ID:
                assert conforms(json.loads(out), SCHEMA), out
                finished += 1
                break
            out += tb[t]
            c.advance(t)
            assert feed(schema_start(node), out) is not None, out
    assert finished
