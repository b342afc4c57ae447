"""DeepSeek-V4.1 chat encoding: OpenAI-style messages -> prompt text (BOS first).

Sources followed (read, not copied):
- DeepSeek's release encoder `encoding/encoding.py`, as carried by SGLang in
  `python/sglang/srt/entrypoints/openai/encoding_dsv41.py` (sgl-project/sglang @ 0e43c22). From it: the
  token strings, the tools section text, DSML tool-call rendering (`<｜DSML｜ calls>` / `<｜DSML｜ invoke>` /
  `<｜DSML｜ parameter>`, leading-space tag names new in V4.1), tool results as `<tool_result>` blocks merged
  into the surrounding user turn and ordered by the preceding assistant's call order, the reasoning-effort
  line in the leading `<｜System｜>` block (thinking mode only), the mid-conversation `<｜System｜>` turn that
  counts as a user turn, and dropping the reasoning of assistant turns that precede the last user turn
  unless tools are defined.
- `models/templates/deepseek-ai-DeepSeek-V4.1.jinja` (ikawrakow/ik_llama.cpp @ 1ade91e) for the OpenAI
  request shape: a request-level `tools` list, `tool` role messages, an `<｜Assistant｜>` header in front of
  every assistant turn, `add_generation_prompt`.

For well-formed conversations (first message optionally system, then user/tool and assistant turns) the
output equals the release encoder's. Deviations:
- `reasoning_effort` is an int in [1, 100]; named levels are the HTTP layer's business. `None` means
  `DEFAULT_REASONING_EFFORT` = 75. The sources disagree on the default: SGLang maps its default "high" to
  50, the jinja template uses 75, as does DwarfStar's `--think` (spec systems.md).
- With tools but no leading system message the tools section follows the (empty) system text after
  "\\n\\n", as the release encoder does when a server inserts an empty system message for the tools; the
  jinja template omits that "\\n\\n".
- An assistant turn always gets its `<｜Assistant｜>` header, also when no user turn precedes it (the release
  encoder emits the header only after a user or mid-conversation system turn).
- The generation prompt is appended after any final non-assistant turn, including a lone leading system
  message (the release encoder appends it only after a user or mid-conversation system turn).
- Reasoning is dropped exactly when the release encoder drops it (thinking mode, no tools defined); the
  jinja template also keeps it whenever any `tool` message is present.
- Rejected with EncodingError: `developer` and `latest_reminder` roles and image content parts. Not
  implemented: task tokens, `response_format`, continuing a final assistant message without EOS.
- Message text is not escaped: marker strings inside user text render verbatim, as in both sources.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dsflash.tokens import ASSISTANT, BOS, DSML, EOS, SYSTEM, THINK_END, THINK_START, USER

DSML_CALLS_OPEN = f"<{DSML} calls>"
DSML_CALLS_CLOSE = f"</{DSML} calls>"
DSML_INVOKE_OPEN = f'<{DSML} invoke name="'
DSML_INVOKE_CLOSE = f"</{DSML} invoke>"
DSML_PARAMETER_OPEN = f'<{DSML} parameter name="'
DSML_PARAMETER_CLOSE = f"</{DSML} parameter>"
# Closes the name="..." attribute of an invoke tag and the attributes of a parameter tag.
DSML_ATTRIBUTES_END = '">'
# Separates assistant content from its tool-call block, also when the content is empty.
TOOL_CALLS_SEPARATOR = "\n\n"

TOOL_RESULT_OPEN = "<tool_result>"
TOOL_RESULT_CLOSE = "</tool_result>"

DEFAULT_REASONING_EFFORT = 75
REASONING_EFFORT_LINE = (
    "Reasoning Effort: {effort} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
)

TOOLS_SECTION = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    f'"{DSML_CALLS_OPEN}" block like the following:\n\n'
    f"{DSML_CALLS_OPEN}\n"
    f'{DSML_INVOKE_OPEN}$TOOL_NAME">\n'
    f'{DSML_PARAMETER_OPEN}$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{DSML_PARAMETER_CLOSE}\n'
    "...\n"
    f"{DSML_INVOKE_CLOSE}\n"
    f'{DSML_INVOKE_OPEN}$TOOL_NAME2">\n'
    "...\n"
    f"{DSML_INVOKE_CLOSE}\n"
    f"{DSML_CALLS_CLOSE}\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside "
    f"{THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    "{schemas}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)


class EncodingError(ValueError):
    """A chat request cannot be encoded; the message starts with the offending field, e.g. `messages[2].role`."""


@dataclass(frozen=True)
class ToolCall:
    """One function call as OpenAI carries it: `arguments` is the JSON text of an object."""

    name: str
    arguments: str


@dataclass
class _SystemTurn:
    text: str


@dataclass
class _UserPart:
    text: str  # as rendered: tool results already wrapped in <tool_result>
    tool_call_id: str | None  # None for user text, "" for a result without an id


@dataclass
class _UserTurn:
    """A run of user and tool messages: one `<｜User｜>` turn whose parts are joined by a blank line."""

    parts: list[_UserPart]


@dataclass
class _AssistantTurn:
    content: str
    reasoning: str
    tool_calls: list[ToolCall]
    call_order: dict[str, int]  # tool_call_id -> position in tool_calls, for ordering the results
    # (thinking, text): the turn's completion as sampled, written in place of its rendering when the turn's
    # header is the one it was sampled after (`<think>` when thinking, else `</think>`)
    verbatim: tuple[bool, str] | None = None


_Turn = _SystemTurn | _UserTurn | _AssistantTurn


def _json(value: Any) -> str:
    # The release encoder writes JSON with json.dumps defaults, non-ASCII kept as is.
    return json.dumps(value, ensure_ascii=False)


def _text(value: Any, field: str) -> str:
    """Message content: a string, null, or a list of text parts (joined by a blank line, as the release
    encoder joins content blocks)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise EncodingError(f"{field}[{i}]: only {{'type': 'text', 'text': str}} parts are supported")
            texts.append(part["text"])
        return "\n\n".join(texts)
    raise EncodingError(f"{field}: must be a string, null or a list of text parts, got {type(value).__name__}")


def _arguments_object(arguments: Any, field: str) -> dict[str, Any]:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise EncodingError(f"{field}: not valid JSON ({e})") from e
    if not isinstance(arguments, dict):
        raise EncodingError(f"{field}: must be a JSON object, got {type(arguments).__name__}")
    return arguments


def render_tool_calls(tool_calls: Sequence[ToolCall]) -> str:
    """The DSML block for a list of calls: string arguments verbatim with string="true", everything else as
    JSON with string="false"."""
    invokes = []
    for i, call in enumerate(tool_calls):
        arguments = _arguments_object(call.arguments, f"tool_calls[{i}].arguments")
        parameters = [
            f'{DSML_PARAMETER_OPEN}{key}" string="true">{value}{DSML_PARAMETER_CLOSE}'
            if isinstance(value, str)
            else f'{DSML_PARAMETER_OPEN}{key}" string="false">{_json(value)}{DSML_PARAMETER_CLOSE}'
            for key, value in arguments.items()
        ]
        invokes.append(f'{DSML_INVOKE_OPEN}{call.name}">\n' + "\n".join(parameters) + f"\n{DSML_INVOKE_CLOSE}")
    return f"{DSML_CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{DSML_CALLS_CLOSE}"


def render_assistant_completion(content: str, tool_calls: Sequence[ToolCall] = (), reasoning: str | None = None) -> str:
    """The text a model generates after the generation prompt, EOS included: `reasoning</think>` when
    `reasoning` is given (thinking mode), then the content, then the DSML block if there are calls."""
    text = "" if reasoning is None else reasoning + THINK_END
    text += content
    if tool_calls:
        text += TOOL_CALLS_SEPARATOR + render_tool_calls(tool_calls)
    return text + EOS


def _tool_schemas(tools: Any) -> str:
    if not isinstance(tools, list):
        raise EncodingError(f"tools: must be a list, got {type(tools).__name__}")
    schemas = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise EncodingError(f"tools[{i}].type: only 'function' tools are supported")
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
            raise EncodingError(f"tools[{i}].function.name: must be a non-empty string")
        schemas.append(_json(function))
    return "\n".join(schemas)


def _assistant_tool_calls(value: Any, field: str) -> tuple[list[ToolCall], dict[str, int]]:
    if value is None:
        return [], {}
    if not isinstance(value, list):
        raise EncodingError(f"{field}: must be a list, got {type(value).__name__}")
    calls, order = [], {}
    for i, entry in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(entry, Mapping):
            raise EncodingError(f"{where}: must be an object")
        if entry.get("type", "function") != "function":
            raise EncodingError(f"{where}.type: only 'function' calls are supported")
        function = entry.get("function")
        if not isinstance(function, Mapping):
            raise EncodingError(f"{where}.function: must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise EncodingError(f"{where}.function.name: must be a non-empty string")
        if "arguments" not in function:
            raise EncodingError(f"{where}.function.arguments: missing")
        arguments = _arguments_object(function["arguments"], f"{where}.function.arguments")
        calls.append(ToolCall(name, _json(arguments)))
        call_id = entry.get("id")
        if isinstance(call_id, str) and call_id:
            order[call_id] = i
    return calls, order


def _turns(messages: Any, verbatim: Mapping[int, tuple[bool, str]]) -> list[_Turn]:
    """Validate messages and merge each run of user/tool messages into one user turn."""
    if not isinstance(messages, list) or not messages:
        raise EncodingError("messages: must be a non-empty list")
    turns: list[_Turn] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise EncodingError(f"{where}: must be an object")
        role = message.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise EncodingError(f"{where}.role: must be 'system', 'user', 'assistant' or 'tool', got {role!r}")
        content = _text(message.get("content"), f"{where}.content")
        if role == "system":
            turns.append(_SystemTurn(content))
        elif role == "assistant":
            reasoning = message.get("reasoning_content")
            if reasoning is not None and not isinstance(reasoning, str):
                raise EncodingError(f"{where}.reasoning_content: must be a string or null")
            calls, order = _assistant_tool_calls(message.get("tool_calls"), f"{where}.tool_calls")
            turns.append(_AssistantTurn(content, reasoning or "", calls, order, verbatim.get(i)))
        else:
            if role == "tool":
                call_id = message.get("tool_call_id")
                if call_id is not None and not isinstance(call_id, str):
                    raise EncodingError(f"{where}.tool_call_id: must be a string")
                part = _UserPart(TOOL_RESULT_OPEN + content + TOOL_RESULT_CLOSE, call_id or "")
            else:
                part = _UserPart(content, None)
            if turns and isinstance(turns[-1], _UserTurn):
                turns[-1].parts.append(part)
            else:
                turns.append(_UserTurn([part]))
    return turns


def _user_text(turn: _UserTurn, call_order: dict[str, int]) -> str:
    """Tool results take the order of the calls that produced them; text parts keep their slots. Unknown ids
    sort as position 0, as in the release encoder."""
    results = [part for part in turn.parts if part.tool_call_id is not None]
    results.sort(key=lambda part: call_order.get(part.tool_call_id, 0))
    ordered = iter(results)
    return "\n\n".join(part.text if part.tool_call_id is None else next(ordered).text for part in turn.parts)


def encode_messages(
    messages: list[Mapping[str, Any]],
    tools: list[Mapping[str, Any]] | None = None,
    thinking: bool | None = None,
    reasoning_effort: int | None = None,
    add_generation_prompt: bool = True,
    verbatim: Mapping[int, tuple[bool, str]] | None = None,
) -> str:
    """Render an OpenAI-style chat request as DeepSeek-V4.1 prompt text, starting with BOS.

    `thinking` None means thinking on. In thinking mode without tools, assistant turns before the last user
    (or mid-conversation system) turn lose their reasoning; with tools every turn keeps it. The generation
    prompt `<｜Assistant｜>` + `<think>` (thinking) or `</think>` (not thinking) follows a final non-assistant
    turn when `add_generation_prompt` is set. `verbatim`: by message index, assistant turns' completions as
    they were sampled (thinking, text with EOS), written instead of their rendering where their header is
    the same, so the prompt extends the tokens of the turn that sampled them.
    """
    thinking = True if thinking is None else thinking
    if not isinstance(thinking, bool):
        raise EncodingError(f"thinking: must be a bool or null, got {type(thinking).__name__}")
    effort = DEFAULT_REASONING_EFFORT if reasoning_effort is None else reasoning_effort
    if type(effort) is not int or not 1 <= effort <= 100:
        raise EncodingError(f"reasoning_effort: must be an integer in [1, 100], got {reasoning_effort!r}")
    schemas = _tool_schemas(tools) if tools else ""
    turns = _turns(messages, verbatim or {})

    # A system turn after the first position opens a new user-like turn, as a user message does.
    last_user = max(
        (i for i, turn in enumerate(turns) if isinstance(turn, _UserTurn) or (isinstance(turn, _SystemTurn) and i)),
        default=-1,
    )
    drop_old_reasoning = thinking and not schemas

    out = [BOS]
    leading_system = turns[0] if isinstance(turns[0], _SystemTurn) else None
    if thinking or leading_system is not None or schemas:
        out.append(SYSTEM)
        if thinking:
            out.append(REASONING_EFFORT_LINE.format(effort=effort))
        if leading_system is not None:
            out.append(leading_system.text)
        if schemas:
            out.append("\n\n" + TOOLS_SECTION.format(schemas=schemas))

    call_order: dict[str, int] = {}
    for i, turn in enumerate(turns):
        if isinstance(turn, _SystemTurn):
            if i > 0:
                out.append(SYSTEM + turn.text)
        elif isinstance(turn, _UserTurn):
            out.append(USER + _user_text(turn, call_order))
        else:
            if turn.tool_calls:
                call_order = turn.call_order
            keep_reasoning = thinking and (not drop_old_reasoning or i > last_user)
            reasoning = turn.reasoning if keep_reasoning else None
            if turn.verbatim is not None and turn.verbatim[0] == keep_reasoning:
                completion = turn.verbatim[1]
            else:
                completion = render_assistant_completion(turn.content, turn.tool_calls, reasoning)
            out.append(ASSISTANT + (THINK_START if keep_reasoning else THINK_END) + completion)
    if add_generation_prompt and not isinstance(turns[-1], _AssistantTurn):
        out.append(ASSISTANT + (THINK_START if thinking else THINK_END))
    return "".join(out)
