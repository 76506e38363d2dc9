"""Structured output by constrained decoding (llguidance): sampled at temperature 1 from a
random-weight model, every answer must still parse and validate against its schema."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from helpers import openai_client

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    },
    "tags": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["tags", "ok"],
        "additionalProperties": False,
    },
    "point": {
        "type": "object",
        "properties": {
            "x": {"type": "integer", "minimum": -50, "maximum": 50},
            "y": {"type": "integer", "minimum": -50, "maximum": 50},
            "label": {"type": ["string", "null"], "maxLength": 5},
        },
        "required": ["x", "y", "label"],
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize("name", SCHEMAS)
def test_sampled_outputs_always_validate(tiny_gateway, name):
    client = openai_client(tiny_gateway)
    schema = SCHEMAS[name]
    runs = 17 if name != "point" else 16  # 50 in all
    for i in range(runs):
        out = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": f"Give me a {name} #{i}"}],
            temperature=1.0,
            max_tokens=300,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
        )
        assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)


def test_json_object_mode_gives_an_object(tiny_gateway):
    out = openai_client(tiny_gateway).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "json please"}],
        max_tokens=400,
        temperature=0.7,
        response_format={"type": "json_object"},
    )
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:  # an unbounded object from random weights may run out of tokens; it must still be a JSON prefix
        assert out.choices[0].message.content.lstrip().startswith("{")


def test_anthropic_output_config_format_is_enforced(tiny_gateway):
    client = anthropic.Anthropic(base_url=tiny_gateway.url, api_key="unused", max_retries=0)
    schema = SCHEMAS["person"]
    msg = client.messages.create(
        model="tiny",
        max_tokens=300,
        messages=[{"role": "user", "content": "title?"}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert msg.stop_reason == "end_turn"
    jsonschema.validate(json.loads(msg.content[0].text), schema)


def test_constraints_compose_with_batching(tiny_gateway):
    import concurrent.futures

    client = openai_client(tiny_gateway)
    schema = SCHEMAS["point"]

    def one(i: int):
        kw = {}
        if i % 2 == 0:
            kw["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
        return i, client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"#{i}"}], max_tokens=60, temperature=1.0, **kw
        )

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    for i, out in results:
        if i % 2 == 0:
            jsonschema.validate(json.loads(out.choices[0].message.content), schema)
        else:
            assert out.choices[0].finish_reason in ("length", "stop")


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
    "properties": {"tz": {"type": "string", "maxLength": 6}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]


def test_named_tool_choice_is_forced_by_constrained_decoding(tiny_gateway):
    client = openai_client(tiny_gateway)
    for i in range(10):
        out = client.chat.completions.create(
            model="tiny-tools",
            messages=[{"role": "user", "content": f"weather {i}"}],
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=1.0,
            max_tokens=200,
        )
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_required_tool_choice_picks_one_of_the_tools(tiny_gateway):
    client = openai_client(tiny_gateway)
    for i in range(6):
        out = client.chat.completions.create(
            model="tiny-tools",
            messages=[{"role": "user", "content": f"anything {i}"}],
            tools=TOOLS,
            tool_choice="required",
            temperature=1.0,
            max_tokens=200,
        )
        (call,) = out.choices[0].message.tool_calls
        schema = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_anthropic_tool_choice_any_is_forced(tiny_gateway):
    client = anthropic.Anthropic(base_url=tiny_gateway.url, api_key="unused", max_retries=0)
    msg = client.messages.create(
        model="tiny-tools",
        max_tokens=200,
        messages=[{"role": "user", "content": "go"}],
        tools=[{"name": "get_weather", "input_schema": WEATHER}],
        tool_choice={"type": "any"},
    )
    assert msg.stop_reason == "tool_use"
    tool = msg.content[-1]
    assert tool.type == "tool_use" and tool.name == "get_weather"
    jsonschema.validate(tool.input, WEATHER)


def test_tool_choice_naming_an_unknown_tool_is_a_400(tiny_gateway):
    import openai

    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        openai_client(tiny_gateway).chat.completions.create(
            model="tiny-tools",
            messages=[{"role": "user", "content": "x"}],
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "launch_rockets"}},
        )
