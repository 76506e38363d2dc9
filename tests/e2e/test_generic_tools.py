"""Tools on a chat model whose template has no tool format (SmolLM2's ChatML): the generic
format describes the tools in the system turn, the model answers with <tool_call> JSON
markup, and a forced tool choice is enforced by the grammar. Every API, through the official
SDKs, on the tiny random-weight model and on the real default model."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from helpers import openai_client

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"tz": {"enum": ["UTC", "CET"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
ANTHROPIC_TOOLS = [{"name": name, "description": f"{name} tool", "input_schema": s} for name, s in SCHEMAS.items()]
RESPONSES_TOOLS = [{"type": "function", "name": name, "parameters": s} for name, s in SCHEMAS.items()]
TINY = "tiny"  # no tool_parser: SmolLM2's template has no tool format, so the generic one is used


def anthropic_client(gw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0)


def check_call(name: str, arguments: str | dict) -> None:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMAS[name])


def test_openai_required_tool_call_on_a_template_without_tool_format(tiny_gateway):
    out = openai_client(tiny_gateway).chat.completions.create(
        model=TINY, messages=[{"role": "user", "content": "weather?"}], tools=CHAT_TOOLS, tool_choice="required"
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    check_call(call.function.name, call.function.arguments)


def test_openai_named_tool_call_streams_as_deltas(tiny_gateway):
    stream = openai_client(tiny_gateway).chat.completions.create(
        model=TINY,
        messages=[{"role": "user", "content": "time?"}],
        tools=CHAT_TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        stream=True,
    )
    name, arguments, finish = "", "", None
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or []:
            name += delta.function.name or ""
            arguments += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert name == "get_time" and finish == "tool_calls"
    check_call(name, arguments)


def test_anthropic_any_and_named_tool_choice_on_a_template_without_tool_format(tiny_gateway):
    client = anthropic_client(tiny_gateway)
    for choice, expected in (({"type": "any"}, None), ({"type": "tool", "name": "get_weather"}, "get_weather")):
        msg = client.messages.create(
            model=TINY,
            max_tokens=128,
            messages=[{"role": "user", "content": "go"}],
            tools=ANTHROPIC_TOOLS,
            tool_choice=choice,
        )
        assert msg.stop_reason == "tool_use"
        (tool,) = [b for b in msg.content if b.type == "tool_use"]
        assert expected in (None, tool.name)
        check_call(tool.name, tool.input)


def test_responses_required_tool_call_on_a_template_without_tool_format(tiny_gateway):
    response = openai_client(tiny_gateway).responses.create(
        model=TINY, input="weather?", tools=RESPONSES_TOOLS, tool_choice="required", max_output_tokens=128
    )
    (call,) = [item for item in response.output if item.type == "function_call"]
    check_call(call.name, call.arguments)


def test_the_tools_are_described_in_the_prompt(tiny_gateway):
    client = openai_client(tiny_gateway)
    messages = [{"role": "user", "content": "hello"}]
    plain = client.chat.completions.create(model=TINY, messages=messages, max_tokens=1)
    with_tools = client.chat.completions.create(model=TINY, messages=messages, tools=CHAT_TOOLS, max_tokens=1)
    # the instruction plus both schemas: far more than the few tokens of the conversation
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 100


def test_a_tool_round_trip_renders_on_a_template_without_tool_format(tiny_gateway):
    client = openai_client(tiny_gateway)
    first = client.chat.completions.create(
        model=TINY, messages=[{"role": "user", "content": "weather?"}], tools=CHAT_TOOLS, tool_choice="required"
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = client.chat.completions.create(
        model=TINY, messages=history, tools=CHAT_TOOLS, tool_choice="required", max_tokens=128
    )
    (again,) = second.choices[0].message.tool_calls
    check_call(again.function.name, again.function.arguments)
    # the earlier call and its result are in the prompt, as markup and a tool_response block
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20


# -- the real default model (SmolLM2-135M, shipped config) -------------------------------

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
QUESTION = "What is the weather in Paris?"


def city_of(arguments: str | dict) -> str:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, CITY)
    return args["city"]


@pytest.mark.slow
def test_real_model_forced_tool_call_through_openai_chat(real_gateway):
    out = openai_client(real_gateway).chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": QUESTION}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}],
        tool_choice="required",
        temperature=0,
        max_tokens=60,
    )
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and city_of(call.function.arguments)


@pytest.mark.slow
def test_real_model_forced_tool_call_through_anthropic_messages(real_gateway):
    # Claude Code's default model name: the shipped config sends it to the default model
    msg = anthropic_client(real_gateway).messages.create(
        model="claude-opus-5-5",
        max_tokens=60,
        extra_body={"temperature": 0},  # this SDK version has no temperature argument
        messages=[{"role": "user", "content": QUESTION}],
        tools=[{"name": "get_weather", "input_schema": CITY}],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    (tool,) = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and city_of(tool.input)


@pytest.mark.slow
def test_real_model_forced_tool_call_through_responses(real_gateway):
    response = openai_client(real_gateway).responses.create(
        model="gpt-6.2-sol",  # Codex's default model name
        input=QUESTION,
        tools=[{"type": "function", "name": "get_weather", "parameters": CITY}],
        tool_choice="required",
        temperature=0,
        max_output_tokens=60,
    )
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and city_of(call.arguments)
