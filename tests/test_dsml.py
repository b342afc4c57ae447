"""Output parsing: streamed events must not depend on chunking, and parsing inverts rendering."""

import json

from hypothesis import given
from hypothesis import strategies as st

from dsflash.server.dsml import (
    ContentDelta,
    DsmlParser,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    parse_complete,
)
from dsflash.server.encoding import ToolCall, render_assistant_completion

GENERATED = (
    "Checking the weather.</think>Let me look.\n\n<｜DSML｜ calls>\n"
    '<｜DSML｜ invoke name="get_weather">\n'
    '<｜DSML｜ parameter name="city" string="true">Pa"ris\n</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="opts" string="false">{"days": [1, 2.5], "x": null}</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n"
    '<｜DSML｜ invoke name="noop">\n'
    "\n"
    "</｜DSML｜ invoke>\n"
    "</｜DSML｜ calls><｜end▁of▁sentence｜>"
)
GENERATED_PARSED = (
    "Let me look.",
    "Checking the weather.",
    [
        ToolCall("get_weather", '{"city": "Pa\\"ris\\n", "opts": {"days": [1, 2.5], "x": null}}'),
        ToolCall("noop", "{}"),
    ],
)


def stream(text: str, cuts: list[int], thinking: bool) -> tuple[str, str, list[ToolCall]]:
    """Feed `text` cut at `cuts` and fold the events the way a client would."""
    parser = DsmlParser(thinking)
    bounds = [0, *sorted(cuts), len(text)]
    events = [e for a, b in zip(bounds, bounds[1:], strict=False) for e in parser.feed(text[a:b])]
    events += parser.finish()
    content, reasoning, names, arguments, ended = "", "", {}, {}, []
    for event in events:
        match event:
            case ContentDelta(text=piece):
                content += piece
            case ReasoningDelta(text=piece):
                reasoning += piece
            case ToolCallStart(index=i, name=name):
                assert i == len(names), "calls are numbered in order"
                names[i], arguments[i] = name, ""
            case ToolCallArgumentsDelta(index=i, text=piece):
                assert i not in ended, "no arguments after a call ended"
                arguments[i] += piece
            case ToolCallEnd(index=i):
                ended.append(i)
    return content, reasoning, [ToolCall(names[i], arguments[i]) for i in ended]


def test_complete_parse_of_a_hand_written_generation():
    assert parse_complete(GENERATED, thinking=True) == GENERATED_PARSED


def test_streaming_one_character_at_a_time_matches():
    assert stream(GENERATED, list(range(1, len(GENERATED))), thinking=True) == GENERATED_PARSED


def test_partial_marker_at_a_chunk_end_is_held_back():
    parser = DsmlParser(thinking=False)
    assert parser.feed("Hello <｜DS") == [ContentDelta("Hello ")]
    assert parser.feed('ML｜ calls>\n<｜DSML｜ invoke name="f') == []
    assert parser.feed('">\n') == [ToolCallStart(0, "f")]
    assert parser.feed('<｜DSML｜ parameter name="q" string="true">a</｜DSML｜ par') == [
        ToolCallArgumentsDelta(0, '{"q": "'),
        ToolCallArgumentsDelta(0, "a"),
    ]
    assert parser.feed("ameter>\n</｜DSML｜ invoke>") == [
        ToolCallArgumentsDelta(0, '"'),
        ToolCallArgumentsDelta(0, "}"),
        ToolCallEnd(0),
    ]


def test_partial_end_of_sentence_and_think_end_are_held_back():
    parser = DsmlParser(thinking=True)
    assert parser.feed("hmm</thi") == [ReasoningDelta("hmm")]
    assert parser.feed("nk>ok<｜end▁of") == [ContentDelta("ok")]
    assert parser.feed("▁sentence｜>ignored") == []
    assert parser.feed("more") == []
    assert parser.finish() == []


def test_unfinished_marker_is_text_at_the_end():
    parser = DsmlParser(thinking=False)
    assert parser.feed("a <｜end") == [ContentDelta("a ")]
    assert parser.finish() == [ContentDelta("<｜end")]


def test_newlines_around_reasoning_and_before_calls_belong_to_neither():
    text = '\n\nplan\n\n</think>\n\nanswer\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n</｜DSML｜ invoke>'
    assert parse_complete(text, thinking=True) == ("answer", "plan", [ToolCall("f", "{}")])
    assert parse_complete("\nanswer\n\n", thinking=False) == ("answer\n\n", "", [])


def test_stray_think_end_in_content_is_dropped():
    assert parse_complete("a</think>b", thinking=False) == ("ab", "", [])


def test_call_opened_inside_reasoning_is_parsed():
    text = 'plan\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'
    assert parse_complete(text, thinking=True) == ("", "plan", [ToolCall("f", "{}")])


def test_call_cut_off_by_the_end_of_generation_is_not_complete():
    text = '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="a" string="true">unfinis'
    assert parse_complete(text, thinking=False) == ("", "", [])
    assert stream(text, [5, 40], thinking=False) == ("", "", [])


# Text the model could write: no fullwidth bar (no DSML or EOS marker) and no `</think>`.
plain_text = st.text(st.characters(blacklist_characters="｜", blacklist_categories=("Cs",))).filter(
    lambda s: "</think>" not in s
)
json_scalars = (
    st.none() | st.booleans() | st.integers(-(10**20), 10**20) | st.floats(allow_nan=False, allow_infinity=False)
)
json_keys = st.text("abcdefghijklmnopqrstuvwxyz_ 0123456789", min_size=1, max_size=8)
json_values = st.recursive(
    json_scalars | plain_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(plain_text, inner, max_size=3),
    max_leaves=8,
)
tool_calls = st.lists(
    st.builds(
        lambda name, arguments: ToolCall(name, json.dumps(arguments, ensure_ascii=False)),
        st.from_regex(r"[a-z][a-z0-9_]{0,11}", fullmatch=True),
        st.dictionaries(json_keys, json_values, max_size=4),
    ),
    max_size=3,
)


@st.composite
def assistant_turns(draw):
    """(content, reasoning or None, calls): leading newlines and newlines right before `</think>` or a call
    block are not part of the text, so the generated texts avoid them."""
    calls = draw(tool_calls)
    content = draw(plain_text.filter(lambda s: not s.startswith("\n") and not (calls and s.endswith("\n"))))
    reasoning = draw(st.none() | plain_text.filter(lambda s: not s.startswith("\n") and not s.endswith("\n")))
    return content, reasoning, calls


@given(assistant_turns())
def test_parse_inverts_render(turn):
    content, reasoning, calls = turn
    text = render_assistant_completion(content, calls, reasoning)
    assert parse_complete(text, thinking=reasoning is not None) == (content, reasoning or "", calls)


@given(assistant_turns(), st.data())
def test_streamed_events_do_not_depend_on_chunking(turn, data):
    content, reasoning, calls = turn
    thinking = reasoning is not None
    text = render_assistant_completion(content, calls, reasoning)
    if data.draw(st.booleans()):
        text = text.removesuffix("<｜end▁of▁sentence｜>")  # a generation stopped without the EOS text
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert stream(text, cuts, thinking) == parse_complete(text, thinking=thinking)
