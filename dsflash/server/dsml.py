"""Incremental parser for DeepSeek-V4.1 output: reasoning, content and DSML tool calls as stream events.

What the model generates after the generation prompt of `encoding.encode_messages` is, in thinking mode,
`reasoning</think>content`, otherwise `content`; content may be followed by a tool-call block
`\\n\\n<｜DSML｜ calls>` … `</｜DSML｜ calls>`, and the turn ends with EOS (see
`encoding.render_assistant_completion`).

Sources followed (read, not copied):
- deepseek-ai/deepseek-recipe `deepseek-recipe/src/stream/state_machine.rs` (@ ac74541), DeepSeek's own
  streaming parser: newlines at the start of reasoning and of content are dropped; newlines just before
  `</think>` or before the first `<｜DSML｜` tag belong to neither side; a stray `</think>` in content is
  dropped; a tool-call block may also open inside reasoning; text between DSML tags and anything after the
  block is dropped; string="true" values are streamed as JSON string pieces and other values spliced in
  as JSON; an invoke without parameters has arguments `{}`.
- SGLang `python/sglang/srt/entrypoints/openai/encoding_dsv41.py` (@ 0e43c22),
  `parse_message_from_completion_text`: the arguments text `{"key": value, ...}` with json.dumps
  separators, and the complete-message result (content, reasoning, tool calls).

Deviations: EOS text ends the turn (our detokenizer may keep it; deepseek-recipe never sees it); the
block must close with the V4.1 `</｜DSML｜ calls>` (deepseek-recipe also accepts V4's `tool_calls`); a
parameter name is JSON-escaped inside the arguments text (deepseek-recipe copies it raw); a parameter
without a `string="…"` attribute counts as a string; calls still open at `finish()` are not reported as
complete by `parse_complete`. Where the release decoder raises on malformed output, this parser keeps
going, so a server can keep streaming.

Anything that may be the start of a marker (including a run of newlines that may precede one) is held
back at a chunk end, so no partial marker is ever emitted as text and the concatenated events do not
depend on how the text was split into chunks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum

from dsflash.server.encoding import (
    DSML,
    DSML_ATTRIBUTES_END,
    DSML_CALLS_CLOSE,
    DSML_INVOKE_CLOSE,
    DSML_INVOKE_OPEN,
    DSML_PARAMETER_CLOSE,
    DSML_PARAMETER_OPEN,
    EOS,
    THINK_END,
    ToolCall,
)


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    name: str


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    index: int
    text: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


Event = ContentDelta | ReasoningDelta | ToolCallStart | ToolCallArgumentsDelta | ToolCallEnd


class _State(Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    CALLS = "calls"  # inside a calls block, between invokes
    INVOKE_NAME = "invoke name"  # after `<｜DSML｜ invoke name="`
    INVOKE = "invoke"  # inside an invoke, between parameters
    PARAMETER_HEADER = "parameter header"  # after `<｜DSML｜ parameter name="`
    PARAMETER_VALUE = "parameter value"
    DONE = "done"


# The first DSML tag opens a tool-call block, whatever its tag name; the rest of the tag is skipped.
_BLOCK_OPEN = "<" + DSML

_MARKERS: dict[_State, tuple[str, ...]] = {
    _State.REASONING: (THINK_END, _BLOCK_OPEN, EOS),
    _State.CONTENT: (_BLOCK_OPEN, THINK_END, EOS),
    _State.CALLS: (DSML_INVOKE_OPEN, DSML_CALLS_CLOSE, EOS),
    _State.INVOKE_NAME: (DSML_ATTRIBUTES_END,),
    _State.INVOKE: (DSML_PARAMETER_OPEN, DSML_INVOKE_CLOSE, EOS),
    _State.PARAMETER_HEADER: (DSML_ATTRIBUTES_END,),
    _State.PARAMETER_VALUE: (DSML_PARAMETER_CLOSE,),
}
# In these states the newlines right before a marker belong to the marker, not to the text.
_NEWLINES_BEFORE_MARKERS = {_State.REASONING: (THINK_END, _BLOCK_OPEN), _State.CONTENT: (_BLOCK_OPEN,)}

_STRING_ATTRIBUTE = '" string="'


def _split(buffer: str, state: _State, final: bool) -> tuple[int, str | None, int]:
    """Split `buffer` at the earliest complete marker of `state`.

    Returns (end of safe text, marker or None, start of the rest). Without a complete marker the safe text
    stops where a marker might begin (unless `final`), and that tail is kept for the next chunk. A complete
    marker is only taken once no other marker could still start earlier, which matters when one marker is
    the tail of another.
    """
    markers = _MARKERS[state]
    absorbing = _NEWLINES_BEFORE_MARKERS.get(state, ())
    found, found_at = None, len(buffer)
    for marker in markers:
        at = buffer.find(marker)
        if at != -1 and at < found_at:
            found, found_at = marker, at
    if not final:
        longest = max(len(m) for m in markers)
        hold_from = found_at if found is not None else len(buffer)
        for start in range(max(0, len(buffer) - longest + 1), hold_from):
            tail = buffer[start:]
            if any(m.startswith(tail) and len(tail) < len(m) for m in markers):
                hold_from = start
                break
        if found is None or hold_from < found_at:
            if absorbing:
                hold_from = len(buffer[:hold_from].rstrip("\n"))
            return hold_from, None, hold_from
    if found is None:
        return len(buffer), None, len(buffer)
    text_end = len(buffer[:found_at].rstrip("\n")) if found in absorbing else found_at
    return text_end, found, found_at + len(found)


class DsmlParser:
    """Feed generated text in any chunks; each call returns the events that are certain so far."""

    def __init__(self, thinking: bool):
        self._state = _State.REASONING if thinking else _State.CONTENT
        self._buffer = ""
        self._leading = True  # newlines at the start of reasoning or content are dropped
        self._calls = 0  # tool calls started so far; the open one is self._calls - 1
        self._parameters = 0  # parameters of the open call so far
        self._string_value = False  # the open parameter is a string, streamed JSON-escaped

    def feed(self, text: str) -> list[Event]:
        if self._state is _State.DONE:
            return []  # text after the turn's end is not part of it
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        """Flush held-back text at the end of generation."""
        events = self._drain(final=True)
        self._buffer = ""
        return events

    def _drain(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while self._state is not _State.DONE and self._buffer:
            text_end, marker, rest_from = _split(self._buffer, self._state, final)
            if self._state in (_State.INVOKE_NAME, _State.PARAMETER_HEADER) and marker is None:
                break  # a name is only useful whole; wait for its closing `">`
            text = self._buffer[:text_end]
            self._buffer = self._buffer[rest_from:]
            self._emit_text(text, events)
            if marker is None:
                break
            self._on_marker(marker, text, events)
        return events

    def _emit_text(self, text: str, events: list[Event]) -> None:
        if self._state in (_State.REASONING, _State.CONTENT):
            if self._leading:
                text = text.lstrip("\n")
                self._leading = not text
            if text:
                delta = ReasoningDelta if self._state is _State.REASONING else ContentDelta
                events.append(delta(text))
        elif self._state is _State.PARAMETER_VALUE and text:
            escaped = json.dumps(text, ensure_ascii=False)[1:-1] if self._string_value else text
            events.append(ToolCallArgumentsDelta(self._calls - 1, escaped))
        # Text between DSML tags (newlines) carries no meaning and is dropped.

    def _on_marker(self, marker: str, text: str, events: list[Event]) -> None:
        state = self._state
        if marker == EOS or marker == DSML_CALLS_CLOSE:
            self._state = _State.DONE
        elif marker == _BLOCK_OPEN:
            self._state = _State.CALLS
        elif marker == THINK_END:
            # Ends reasoning; a second one inside content is dropped.
            self._leading = state is _State.REASONING
            self._state = _State.CONTENT
        elif marker == DSML_INVOKE_OPEN:
            self._state = _State.INVOKE_NAME
        elif state is _State.INVOKE_NAME:
            events.append(ToolCallStart(self._calls, text))
            self._calls += 1
            self._parameters = 0
            self._state = _State.INVOKE
        elif marker == DSML_PARAMETER_OPEN:
            self._state = _State.PARAMETER_HEADER
        elif state is _State.PARAMETER_HEADER:
            name, has_flag, flag = text.rpartition(_STRING_ATTRIBUTE)
            if not has_flag:
                name, flag = text, "true"
            self._string_value = flag != "false"
            opening = "{" if self._parameters == 0 else ", "
            opening += json.dumps(name, ensure_ascii=False) + ": " + ('"' if self._string_value else "")
            events.append(ToolCallArgumentsDelta(self._calls - 1, opening))
            self._parameters += 1
            self._state = _State.PARAMETER_VALUE
        elif marker == DSML_PARAMETER_CLOSE:
            if self._string_value:
                events.append(ToolCallArgumentsDelta(self._calls - 1, '"'))
            self._state = _State.INVOKE
        elif marker == DSML_INVOKE_CLOSE:
            events.append(ToolCallArgumentsDelta(self._calls - 1, "}" if self._parameters else "{}"))
            events.append(ToolCallEnd(self._calls - 1))
            self._state = _State.CALLS


class WholeCalls:
    """A stream's tool-call events held back until the call's end, then released together (its start, one
    arguments delta with all their text, its end): a call cut off by max_tokens is never sent, so a streamed
    call is as whole as a non-streamed reply's (`Collected.closed`), on every API. Other events pass at once."""

    def __init__(self):
        self._held: dict[int, list[Event]] = {}

    def __call__(self, events: list[Event]) -> list[Event]:
        out: list[Event] = []
        for e in events:
            if isinstance(e, ToolCallStart):
                self._held[e.index] = [e]
            elif isinstance(e, ToolCallArgumentsDelta):
                self._held[e.index].append(e)
            elif isinstance(e, ToolCallEnd):
                start, *deltas = self._held.pop(e.index)
                text = "".join(d.text for d in deltas)
                out += [start, *([ToolCallArgumentsDelta(e.index, text)] if text else []), e]
            else:
                out.append(e)
        return out


class Collected:
    """Parser events gathered into a whole reply: content, reasoning and the tool calls (name and the
    JSON text of the arguments, by call index; `closed` marks the calls whose block ended)."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, ToolCall] = {}
        self.closed: set[int] = set()

    def add(self, events: list) -> None:
        for event in events:
            if isinstance(event, ContentDelta):
                self.content.append(event.text)
            elif isinstance(event, ReasoningDelta):
                self.reasoning.append(event.text)
            elif isinstance(event, ToolCallStart):
                self.calls[event.index] = ToolCall(event.name, "")
            elif isinstance(event, ToolCallArgumentsDelta):
                call = self.calls[event.index]
                self.calls[event.index] = ToolCall(call.name, call.arguments + event.text)
            else:
                self.closed.add(event.index)


def parse_complete(text: str, *, thinking: bool) -> tuple[str, str, list[ToolCall]]:
    """Non-streaming parse of a whole generation: (content, reasoning, completed tool calls)."""
    parser = DsmlParser(thinking)
    got = Collected()
    got.add(parser.feed(text) + parser.finish())
    return "".join(got.content), "".join(got.reasoning), [got.calls[i] for i in sorted(got.closed)]
