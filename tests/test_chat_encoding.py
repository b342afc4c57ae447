"""V4.1 prompt rendering: expected strings are written out by hand from the release encoder's rules."""

import pytest

from dsflash.server.dsml import parse_complete
from dsflash.server.encoding import EncodingError, ToolCall, encode_messages

EFFORT_75 = "Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}

WEATHER_TOOLS_SECTION = (
    "## Tools\n"
    "\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    '"<｜DSML｜ calls>" block like the following:\n'
    "\n"
    "<｜DSML｜ calls>\n"
    '<｜DSML｜ invoke name="$TOOL_NAME">\n'
    '<｜DSML｜ parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜ parameter>\n'
    "...\n"
    "</｜DSML｜ invoke>\n"
    '<｜DSML｜ invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜ invoke>\n"
    "</｜DSML｜ calls>\n"
    "\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n'
    "\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n"
    "\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n"
    "\n"
    "### Available Tool Schemas\n"
    "\n"
    '{"name": "get_weather", "description": "Current weather", "parameters": {"type": "object", "properties": '
    '{"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}\n'
    "\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)

WEATHER_CALL_DSML = (
    "\n\n<｜DSML｜ calls>\n"
    '<｜DSML｜ invoke name="get_weather">\n'
    '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n"
    "</｜DSML｜ calls>"
)


def weather_call(call_id: str, city: str) -> dict:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": f'{{"city": "{city}", "days": 2}}'},
    }


TWO_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
    {"role": "user", "content": "And 3+3?"},
]


def test_plain_chat_without_thinking():
    prompt = encode_messages([{"role": "user", "content": "Hello"}], thinking=False)
    assert prompt == "<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜></think>"


def test_plain_chat_thinks_by_default_with_effort_75():
    prompt = encode_messages([{"role": "user", "content": "Hello"}])
    assert prompt == "<｜begin▁of▁sentence｜><｜System｜>" + EFFORT_75 + "<｜User｜>Hello<｜Assistant｜><think>"


def test_reasoning_effort_is_rendered_only_in_thinking_mode():
    messages = [{"role": "user", "content": "Hello"}]
    assert encode_messages(messages, thinking=True, reasoning_effort=30) == (
        "<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 30 (range 1-100, the higher the value, the more "
        "thorough the reasoning)\n\n<｜User｜>Hello<｜Assistant｜><think>"
    )
    assert encode_messages(messages, thinking=False, reasoning_effort=30) == (
        "<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜></think>"
    )


def test_without_generation_prompt_the_prompt_ends_with_the_last_message():
    prompt = encode_messages([{"role": "user", "content": "Hello"}], thinking=False, add_generation_prompt=False)
    assert prompt == "<｜begin▁of▁sentence｜><｜User｜>Hello"


def test_system_and_multi_turn_drop_reasoning_of_earlier_turns():
    assert encode_messages(TWO_TURNS) == (
        "<｜begin▁of▁sentence｜><｜System｜>" + EFFORT_75 + "Be brief."
        "<｜User｜>What is 2+2?<｜Assistant｜></think>4<｜end▁of▁sentence｜>"
        "<｜User｜>And 3+3?<｜Assistant｜><think>"
    )


def test_system_and_multi_turn_without_thinking():
    assert encode_messages(TWO_TURNS, thinking=False) == (
        "<｜begin▁of▁sentence｜><｜System｜>Be brief."
        "<｜User｜>What is 2+2?<｜Assistant｜></think>4<｜end▁of▁sentence｜>"
        "<｜User｜>And 3+3?<｜Assistant｜></think>"
    )


def test_assistant_turn_after_the_last_user_keeps_its_reasoning():
    # A final assistant message is a complete turn: no generation prompt follows it.
    assert encode_messages(TWO_TURNS[:3]) == (
        "<｜begin▁of▁sentence｜><｜System｜>" + EFFORT_75 + "Be brief."
        "<｜User｜>What is 2+2?<｜Assistant｜><think>Add them.</think>4<｜end▁of▁sentence｜>"
    )


def test_consecutive_user_messages_share_one_turn():
    messages = [{"role": "user", "content": "first"}, {"role": "user", "content": [{"type": "text", "text": "second"}]}]
    assert encode_messages(messages, thinking=False) == (
        "<｜begin▁of▁sentence｜><｜User｜>first\n\nsecond<｜Assistant｜></think>"
    )


def test_mid_conversation_system_message_counts_as_a_user_turn():
    messages = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "answer", "reasoning_content": "prior"},
        {"role": "system", "content": "Now answer in French."},
    ]
    assert encode_messages(messages) == (
        "<｜begin▁of▁sentence｜><｜System｜>" + EFFORT_75 + "<｜User｜>first<｜Assistant｜></think>answer"
        "<｜end▁of▁sentence｜><｜System｜>Now answer in French.<｜Assistant｜><think>"
    )
    messages.append({"role": "user", "content": "Go"})
    assert encode_messages(messages, thinking=False) == (
        "<｜begin▁of▁sentence｜><｜User｜>first<｜Assistant｜></think>answer<｜end▁of▁sentence｜>"
        "<｜System｜>Now answer in French.<｜User｜>Go<｜Assistant｜></think>"
    )


def test_tool_definitions_call_and_result_round_trip():
    messages = [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Use the tool.",
            "tool_calls": [weather_call("c1", "Paris")],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
    ]
    prompt = encode_messages(messages, tools=[WEATHER_TOOL])
    # With tools, every assistant turn keeps its reasoning.
    assert prompt == (
        "<｜begin▁of▁sentence｜><｜System｜>" + EFFORT_75 + "You are a weather bot.\n\n" + WEATHER_TOOLS_SECTION
        + "<｜User｜>Weather in Paris?<｜Assistant｜><think>Use the tool.</think>" + WEATHER_CALL_DSML
        + "<｜end▁of▁sentence｜><｜User｜><tool_result>{\"temp\": 21}</tool_result><｜Assistant｜><think>"
    )

    # What the model generated for the call turn parses back into the message it came from.
    turn_start = prompt.index("<｜Assistant｜><think>") + len("<｜Assistant｜><think>")
    generated = prompt[turn_start : prompt.index("<｜User｜><tool_result>")]
    assert parse_complete(generated, thinking=True) == (
        "",
        "Use the tool.",
        [ToolCall("get_weather", '{"city": "Paris", "days": 2}')],
    )

    messages += [
        {"role": "assistant", "content": "It is 21 °C.", "reasoning_content": "Got it."},
        {"role": "user", "content": "Thanks"},
    ]
    assert encode_messages(messages, tools=[WEATHER_TOOL], thinking=False) == (
        "<｜begin▁of▁sentence｜><｜System｜>You are a weather bot.\n\n" + WEATHER_TOOLS_SECTION
        + "<｜User｜>Weather in Paris?<｜Assistant｜></think>" + WEATHER_CALL_DSML
        + "<｜end▁of▁sentence｜><｜User｜><tool_result>{\"temp\": 21}</tool_result>"
        "<｜Assistant｜></think>It is 21 °C.<｜end▁of▁sentence｜><｜User｜>Thanks<｜Assistant｜></think>"
    )


def test_tools_without_system_message_follow_an_empty_system_text():
    prompt = encode_messages([{"role": "user", "content": "Hi"}], tools=[WEATHER_TOOL], thinking=False)
    assert prompt == (
        "<｜begin▁of▁sentence｜><｜System｜>\n\n" + WEATHER_TOOLS_SECTION + "<｜User｜>Hi<｜Assistant｜></think>"
    )


def test_tool_results_follow_the_call_order_and_arguments_are_canonical_json():
    calls = [
        {"id": "a", "function": {"name": "f", "arguments": '{"z":{"b":1,"a":[true,null]},"s":"x"}'}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": {}}},
    ]
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "Calling.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "b", "content": "B"},
        {"role": "tool", "tool_call_id": "a", "content": "A"},
        {"role": "user", "content": "and?"},
    ]
    assert encode_messages(messages, thinking=False) == (
        "<｜begin▁of▁sentence｜><｜User｜>go<｜Assistant｜></think>Calling.\n\n<｜DSML｜ calls>\n"
        '<｜DSML｜ invoke name="f">\n'
        '<｜DSML｜ parameter name="z" string="false">{"b": 1, "a": [true, null]}</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="s" string="true">x</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
        '<｜DSML｜ invoke name="g">\n'
        "\n"
        "</｜DSML｜ invoke>\n"
        "</｜DSML｜ calls><｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\nand?<｜Assistant｜></think>"
    )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "developer", "content": "b"}]}, "messages[1].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
            "messages[0].tool_calls[0].function.name",
        ),
        ({"messages": [{"role": "assistant", "reasoning_content": 1}]}, "messages[0].reasoning_content"),
        ({"messages": [{"role": "tool", "tool_call_id": 5}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user"}], "tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"messages": [{"role": "user"}], "tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ({"messages": [{"role": "user"}], "reasoning_effort": 0}, "reasoning_effort"),
        ({"messages": [{"role": "user"}], "reasoning_effort": 101}, "reasoning_effort"),
        ({"messages": [{"role": "user"}], "reasoning_effort": True}, "reasoning_effort"),
    ],
)
def test_invalid_requests_name_the_field(kwargs, field):
    with pytest.raises(EncodingError) as error:
        encode_messages(**kwargs)
    assert str(error.value).startswith(field + ":")
