"""Tool calls and reasoning, end to end through both APIs and their official SDKs.

The echo engine repeats the last message byte by byte, so the model's output is exact
and known: what is under test is the worker's parser, the event stream and each API's
rendering (never the markup leaking as text)."""

from __future__ import annotations

import json

import anthropic
from helpers import openai_client

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    }
]
ANTHROPIC_TOOLS = [
    {"name": "get_weather", "description": "Weather forecast", "input_schema": TOOLS[0]["function"]["parameters"]}
]


def ask(text: str):
    return [{"role": "user", "content": text}]


def test_openai_tool_call_non_streaming(tiny_gateway):
    out = openai_client(tiny_gateway).chat.completions.create(
        model="echo", messages=ask("Checking." + CALL), tools=TOOLS
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}


def test_openai_streamed_tool_call_deltas_assemble_to_the_same_call(tiny_gateway):
    chunks = list(
        openai_client(tiny_gateway).chat.completions.create(
            model="echo", messages=ask("Checking." + CALL), tools=TOOLS, stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Checking." and "<tool_call>" not in text
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(arguments) == {"city": "Paris", "days": 2}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_without_tools_the_markup_is_plain_text(tiny_gateway):
    out = openai_client(tiny_gateway).chat.completions.create(model="echo", messages=ask(CALL))
    assert out.choices[0].message.content == CALL and out.choices[0].finish_reason == "stop"


def test_reasoning_is_split_into_reasoning_content(tiny_gateway):
    client = openai_client(tiny_gateway)
    out = client.chat.completions.create(model="echo", messages=ask("<think>Paris is the capital.</think>Paris"))
    message = out.choices[0].message
    assert message.content == "Paris" and message.model_extra["reasoning_content"] == "Paris is the capital."
    chunks = list(
        client.chat.completions.create(
            model="echo", stream=True, messages=ask("<think>Paris is the capital.</think>Paris")
        )
    )
    reasoning = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices
    )
    assert reasoning == "Paris is the capital."
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Paris"


def test_tool_round_trip_in_the_openai_api(tiny_gateway):
    client = openai_client(tiny_gateway)
    first = client.chat.completions.create(model="echo", messages=ask(CALL), tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    history = ask(CALL) + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"},
    ]
    final = client.chat.completions.create(model="echo", messages=history, tools=TOOLS)
    assert final.choices[0].message.content == "Sunny, 24 C" and final.choices[0].finish_reason == "stop"


def anthropic_client(gw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0)


def test_anthropic_tool_use_block_and_stream_helper(tiny_gateway):
    client = anthropic_client(tiny_gateway)
    msg = client.messages.create(model="echo", max_tokens=500, messages=ask("Checking." + CALL), tools=ANTHROPIC_TOOLS)
    assert msg.stop_reason == "tool_use"
    text, tool = msg.content
    assert text.type == "text" and text.text == "Checking."
    assert tool.type == "tool_use" and tool.name == "get_weather" and tool.input == {"city": "Paris", "days": 2}
    with client.messages.stream(
        model="echo", max_tokens=500, messages=ask("Checking." + CALL), tools=ANTHROPIC_TOOLS
    ) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"city": "Paris", "days": 2} and final.stop_reason == "tool_use"


def test_anthropic_thinking_blocks(tiny_gateway):
    client = anthropic_client(tiny_gateway)
    msg = client.messages.create(model="echo", max_tokens=500, messages=ask("<think>Let me see.</think>Yes."))
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "Let me see." and msg.content[1].text == "Yes."
    with client.messages.stream(model="echo", max_tokens=500, messages=ask("<think>Let me see.</think>Yes.")) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == "Let me see."


def test_anthropic_tool_round_trip(tiny_gateway):
    client = anthropic_client(tiny_gateway)
    first = client.messages.create(model="echo", max_tokens=500, messages=ask(CALL), tools=ANTHROPIC_TOOLS)
    tool = first.content[-1]
    final = client.messages.create(
        model="echo",
        max_tokens=500,
        tools=ANTHROPIC_TOOLS,
        messages=[
            *ask(CALL),
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool.id, "content": "Sunny, 24 C"}]},
        ],
    )
    assert final.stop_reason == "end_turn" and final.content[0].text == "Sunny, 24 C"


def test_template_opened_thinking_is_reasoning_and_a_budget_ends_it(tiny_gateway):
    """tiny-think's template opens <think> itself. Random weights never close it on their own,
    so without a budget everything is reasoning; with one, the end tag is forced after the
    budget and the rest is the answer."""
    client = openai_client(tiny_gateway)
    free = client.chat.completions.create(
        model="tiny-think",
        messages=ask("hi"),
        max_tokens=40,
        temperature=0,
        extra_body={"logit_bias": {"0": -100, "2": -100}},
    )
    assert free.choices[0].message.model_extra.get("reasoning_content")
    assert not free.choices[0].message.content
    capped = client.chat.completions.create(
        model="tiny-think",
        messages=ask("hi"),
        max_tokens=60,
        temperature=0,
        extra_body={"reasoning_budget": 10, "logit_bias": {"0": -100, "2": -100}},
    )
    message = capped.choices[0].message
    assert message.model_extra.get("reasoning_content") and message.content
    msg = anthropic_client(tiny_gateway).messages.create(
        model="tiny-think",
        max_tokens=60,
        messages=ask("hi"),
        thinking={"type": "enabled", "budget_tokens": 10},
        extra_body={"temperature": 0},
    )
    assert [b.type for b in msg.content] == ["thinking", "text"]
