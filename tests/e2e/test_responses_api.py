"""The OpenAI Responses API through a real gateway, driven by the official openai SDK."""

from __future__ import annotations

import base64
import io
import json

import openai
import pytest
from helpers import FIXTURES, http, openai_client
from helpers.pdf import pdf_with_text

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


def test_text_response_and_usage(tiny_gateway):
    r = openai_client(tiny_gateway).responses.create(model="echo", input="Hello there", instructions="Be nice.")
    assert r.id.startswith("resp_") and r.status == "completed" and r.output_text == "Hello there"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens == len("Hello there")


def test_streamed_events_and_the_sdk_helper_agree(tiny_gateway):
    client = openai_client(tiny_gateway)
    events = list(client.responses.create(model="echo", input="Streaming works", stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Streaming works"
    with client.responses.stream(model="echo", input="Streaming works") as stream:
        final = stream.get_final_response()
    assert final.output_text == "Streaming works"


def test_function_call_items_and_round_trip(tiny_gateway):
    client = openai_client(tiny_gateway)
    r = client.responses.create(model="echo", input="On it." + CALL, tools=TOOLS)
    call = next(o for o in r.output if o.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert r.output_text == "On it."
    follow = client.responses.create(
        model="echo",
        tools=TOOLS,
        input=[
            {"role": "user", "content": CALL},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"},
        ],
    )
    assert follow.output_text == "Sunny"
    events = list(client.responses.create(model="echo", input=CALL, tools=TOOLS, stream=True))
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"city": "Paris"}


def test_previous_response_id_continues_the_conversation(tiny_gateway):
    client = openai_client(tiny_gateway)
    first = client.responses.create(model="tiny", input="Tell me a story.", max_output_tokens=8, temperature=0)
    second = client.responses.create(
        model="tiny", input="And then?", previous_response_id=first.id, max_output_tokens=4, temperature=0
    )
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model="tiny", input="x", previous_response_id="resp_missing")


def test_codex_request_shape_is_served_and_hosted_tools_are_reported(tiny_gateway):
    body = json.loads((FIXTURES / "codex_request.json").read_text())
    body["max_output_tokens"] = 8
    status, headers, text = http(f"{tiny_gateway.url}/v1/responses", "POST", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert headers["x-mlxgw-ignored-tools"] == "web_search"
    kinds = [line.split(": ", 1)[1] for line in text.splitlines() if line.startswith("event: ")]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")


def test_namespace_tool_calls_map_back_to_their_namespace(tiny_gateway):
    tools = [
        {
            "type": "namespace",
            "name": "mcp_github",
            "tools": [{"type": "function", "name": "search_issues", "parameters": {"type": "object"}}],
        }
    ]
    r = openai_client(tiny_gateway).responses.create(
        model="echo",
        tools=tools,
        input='<tool_call>{"name": "mcp_github__search_issues", "arguments": {"q": "bug"}}</tool_call>',
    )
    call = next(o for o in r.output if o.type == "function_call")
    assert call.name == "search_issues" and call.namespace == "mcp_github"


def test_structured_output_via_text_format(tiny_gateway):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    r = openai_client(tiny_gateway).responses.create(
        model="tiny",
        input="json",
        max_output_tokens=50,
        text={"format": {"type": "json_schema", "name": "flag", "schema": schema, "strict": True}},
    )
    assert isinstance(json.loads(r.output_text)["ok"], bool)


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"model": "tiny"}, "'input'"),
        ({"model": "tiny", "input": 5}, "input"),
        ({"model": "tiny", "input": [{"role": "robot", "content": "x"}]}, "role"),
        ({"model": "nope", "input": "x"}, "nope"),
    ],
)
def test_bad_requests_are_clear_4xx(tiny_gateway, body, needle):
    status, _, payload = http(f"{tiny_gateway.url}/v1/responses", "POST", body)
    assert 400 <= status < 500 and needle in payload["error"]["message"]


# -- tool outputs with images and files, usage details, whitespace -----------------------------


def png_data_url() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (20, 200, 30)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_function_call_output_image_for_a_text_model_becomes_a_placeholder(tiny_gateway):
    output = [{"type": "input_text", "text": "Screenshot:"}, {"type": "input_image", "image_url": png_data_url()}]
    raw = openai_client(tiny_gateway).responses.with_raw_response.create(
        model="echo",
        tools=TOOLS,
        input=[
            {"role": "user", "content": "Take a screenshot."},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": output},
        ],
    )
    assert raw.headers["x-mlxgw-omitted-content"] == "image"
    assert raw.parse().output_text == "Screenshot:\n[image omitted: this model does not accept images]"


def test_input_file_pdf_and_text_are_read(tiny_gateway):
    pdf = base64.b64encode(pdf_with_text("Invoice total 42 EUR")).decode()
    for part, expected in [
        (
            {"type": "input_file", "filename": "a.pdf", "file_data": f"data:application/pdf;base64,{pdf}"},
            "Invoice total 42 EUR",
        ),
        (
            {"type": "input_file", "filename": "notes.txt", "file_data": base64.b64encode(b"Some notes").decode()},
            "Some notes",
        ),
    ]:
        r = openai_client(tiny_gateway).responses.create(model="echo", input=[{"role": "user", "content": [part]}])
        assert r.output_text == f"Document: {part['filename']}\n\n{expected}"
    with pytest.raises(openai.BadRequestError, match="not fetched"):
        openai_client(tiny_gateway).responses.create(
            model="echo", input=[{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]
        )


def test_usage_declares_cache_write_tokens(tiny_gateway):
    r = openai_client(tiny_gateway).responses.create(model="echo", input="Hi")
    assert r.usage.input_tokens_details.cache_write_tokens == 0


def test_whitespace_between_tool_calls_is_no_message_item(tiny_gateway):
    client = openai_client(tiny_gateway)
    r = client.responses.create(model="echo", input=f"{CALL}\n{CALL}\n", tools=TOOLS)
    assert [o.type for o in r.output] == ["function_call", "function_call"]
    events = list(client.responses.create(model="echo", input=f"{CALL}\n{CALL}\n", tools=TOOLS, stream=True))
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["function_call", "function_call"]


def test_a_deferred_function_is_not_shown_to_the_model_until_a_tool_search_output_names_it(tiny_gateway):
    """OpenAI's tool search: a function with defer_loading is left out of the prompt until a
    tool_search_output item loads it (the same rule as Anthropic's, translate.is_deferred)."""
    write = {"type": "function", "name": "write", "parameters": {"type": "object", "properties": {}}}
    later = {**write, "name": "deploy", "description": "Deploys the service.", "defer_loading": True}

    def prompt_tokens(tools, items="Hi") -> int:
        r = openai_client(tiny_gateway).responses.create(model="tiny", input=items, tools=tools, max_output_tokens=1)
        return r.usage.input_tokens

    plain = prompt_tokens([write])
    assert prompt_tokens([write, later]) == plain, "a deferred function reached the prompt"
    assert prompt_tokens([write, {**later, "defer_loading": False}]) > plain
    loaded = [
        {"role": "user", "content": "Hi"},
        {
            "type": "tool_search_output",
            "call_id": "ts1",
            "status": "completed",
            "execution": "client",
            "tools": [later],
        },
    ]
    assert prompt_tokens([write, later], loaded) > prompt_tokens([write], loaded), "a loaded function is shown"
