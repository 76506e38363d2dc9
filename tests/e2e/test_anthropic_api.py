"""Anthropic Messages through a real gateway, driven by the official anthropic SDK."""

from __future__ import annotations

import base64
import io
import json

import anthropic
import pytest
from helpers import FIXTURES, http, openai_client, start_long_stream
from helpers.pdf import pdf_with_text
from helpers.usage import prompt_total

MSGS = [{"role": "user", "content": "Tell me about the sea."}]


def png_bytes() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(buf, "PNG")
    return buf.getvalue()


PNG_B64 = base64.b64encode(png_bytes()).decode()


def client(gw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0)


def test_non_streaming_message_and_usage(tiny_gateway, smollm2_tokenizer):
    msg = client(tiny_gateway).messages.create(
        model="tiny", max_tokens=12, extra_body={"temperature": 0}, system="Be brief.", messages=MSGS
    )
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.content[0].type == "text" and msg.content[0].text
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 12
    expected = smollm2_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *MSGS], add_generation_prompt=True
    )
    assert prompt_total(msg.usage) == len(expected)


def test_stream_helper_assembles_the_same_message_in_the_right_event_order(tiny_gateway):
    c = client(tiny_gateway)
    full = c.messages.create(model="tiny", max_tokens=12, extra_body={"temperature": 0}, messages=MSGS)
    types = []
    with c.messages.stream(model="tiny", max_tokens=12, extra_body={"temperature": 0}, messages=MSGS) as stream:
        for event in stream:
            types.append(event.type)
            if event.type == "message_start":
                assert prompt_total(event.message.usage) == prompt_total(full.usage) > 0
        final = stream.get_final_message()
    assert final.content[0].text == full.content[0].text
    assert final.stop_reason == "max_tokens"  # vllm-mlx 0.6.0 said end_turn here
    assert final.usage.output_tokens == 12
    core = [t for t in types if t not in ("text", "ping")]
    assert core[:2] == ["message_start", "content_block_start"]
    assert core[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(core[2:-3]) == {"content_block_delta"}


def test_stop_sequences_report_stop_sequence(tiny_gateway):
    c = client(tiny_gateway)
    text = c.messages.create(model="tiny", max_tokens=30, extra_body={"temperature": 0}, messages=MSGS).content[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    msg = c.messages.create(
        model="tiny", max_tokens=30, extra_body={"temperature": 0}, messages=MSGS, stop_sequences=[stop]
    )
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[: text.index(stop)]


@pytest.mark.parametrize(
    "name,fields",
    [
        ("seed", {"temperature": 1, "seed": 7}),
        ("top_k", {"temperature": 1, "top_k": 3, "seed": 7}),
        ("top_p", {"temperature": 1, "top_p": 0.5, "seed": 7}),
        ("min_p", {"temperature": 1, "min_p": 0.2, "seed": 7}),
        ("presence_penalty", {"temperature": 0, "presence_penalty": 2.0}),
        ("frequency_penalty", {"temperature": 0, "frequency_penalty": 2.0}),
        ("repetition_penalty", {"temperature": 0, "repetition_penalty": 5.0}),
        ("logit_bias", {"temperature": 0, "logit_bias": {"28": 100}}),
    ],
)
def test_every_sampling_field_reaches_the_worker_as_from_openai_chat(tiny_gateway, name, fields):
    """Anthropic requests take the same sampling fields (mlxgw extensions included) as the
    OpenAI APIs: the same values give the same tokens, and the field changes the output."""
    c = client(tiny_gateway)
    msg = c.messages.create(model="tiny", max_tokens=12, messages=MSGS, extra_body=fields)
    chat = openai_client(tiny_gateway).chat.completions.create(
        model="tiny", max_tokens=12, messages=MSGS, extra_body=fields
    )
    assert msg.content[0].text == chat.choices[0].message.content
    baseline = {**fields, "seed": 8} if name == "seed" else {k: v for k, v in fields.items() if k != name}
    without = c.messages.create(model="tiny", max_tokens=12, messages=MSGS, extra_body=baseline)
    assert msg.content[0].text != without.content[0].text


def test_count_tokens_matches_the_real_input_tokens(tiny_gateway):
    c = client(tiny_gateway)
    counted = c.messages.count_tokens(model="tiny", system="Be brief.", messages=MSGS)
    used = c.messages.create(model="tiny", max_tokens=1, system="Be brief.", messages=MSGS)
    assert counted.input_tokens == prompt_total(used.usage)


def test_claude_code_request_shape_is_accepted(tiny_gateway):
    body = json.loads((FIXTURES / "claude_code_request.json").read_text())
    body["max_tokens"] = 8
    status, headers, text = http(
        f"{tiny_gateway.url}/v1/messages?beta=true",
        "POST",
        body,
        headers={
            "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27",
            "anthropic-version": "2023-06-01",
            "x-api-key": "unused",
        },
    )
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [line.split(": ", 1)[1] for line in text.splitlines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop"


def test_claude_code_request_with_a_mid_conversation_system_turn_and_a_png_read(tiny_gateway):
    """Current Claude Code (beta mid-conversation-system-2026-04-07), as recorded: a system
    turn inside `messages`, and its Read tool's PNG in a tool_result, sent to a text-only model."""
    body = json.loads((FIXTURES / "claude_code_image_tool_result_request.json").read_text())
    assert any(m["role"] == "system" for m in body["messages"])
    result = body["messages"][-1]["content"][0]
    assert result["type"] == "tool_result" and result["content"][0]["type"] == "image"
    body["max_tokens"] = 8
    status, headers, text = http(
        f"{tiny_gateway.url}/v1/messages?beta=true",
        "POST",
        body,
        headers={"anthropic-beta": "mid-conversation-system-2026-04-07", "anthropic-version": "2023-06-01"},
    )
    assert status == 200 and headers["x-mlxgw-omitted-content"] == "image"
    events = [line.split(": ", 1)[1] for line in text.splitlines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop"


@pytest.mark.parametrize(
    "body,status,kind,needle",
    [
        (b"{not json", 400, "invalid_request_error", "JSON"),
        ({"model": "tiny", "messages": MSGS}, 400, "invalid_request_error", "max_tokens"),
        ({"model": "tiny", "messages": MSGS, "max_tokens": -1}, 400, "invalid_request_error", "max_tokens"),
        ({"model": "tiny", "max_tokens": 5}, 400, "invalid_request_error", "messages"),
        (
            {"model": "tiny", "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]},
            400,
            "invalid_request_error",
            "role",
        ),
        ({"model": "no-such", "max_tokens": 5, "messages": MSGS}, 404, "not_found_error", "no-such"),
        (
            {"model": "tiny-short", "max_tokens": 5, "messages": [{"role": "user", "content": "word " * 200}]},
            400,
            "invalid_request_error",
            "prompt is too long",
        ),
        (
            {
                "model": "tiny",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
                        ],
                    }
                ],
            },
            400,
            "invalid_request_error",
            "images",
        ),
    ],
)
def test_bad_requests_get_anthropic_errors(tiny_gateway, body, status, kind, needle):
    raw = body if isinstance(body, bytes) else None
    got, _, payload = http(f"{tiny_gateway.url}/v1/messages", "POST", None if raw else body, raw=raw)
    assert got == status, payload
    assert payload["type"] == "error" and payload["error"]["type"] == kind
    assert needle in payload["error"]["message"]


@pytest.mark.parametrize(
    "field,value",
    [("temperature", 1.5), ("top_k", -1), ("seed", 2**63), ("stop_sequences", [""]), ("presence_penalty", 9)],
)
def test_out_of_range_fields_are_anthropic_400s_naming_the_field(tiny_gateway, field, value):
    body = {"model": "tiny", "max_tokens": 5, "messages": MSGS, field: value}
    status, _, payload = http(f"{tiny_gateway.url}/v1/messages", "POST", body)
    assert status == 400 and payload["error"]["type"] == "invalid_request_error"
    assert field in payload["error"]["message"]


def test_sdk_raises_typed_errors(tiny_gateway):
    with pytest.raises(anthropic.NotFoundError):
        client(tiny_gateway).messages.create(model="no-such", max_tokens=5, messages=MSGS)


def test_full_queue_is_overloaded_529(tiny_gateway):
    running = start_long_stream(tiny_gateway, "tiny-small-queue", "anthropic-q-1")
    waiting = start_long_stream(tiny_gateway, "tiny-small-queue", "anthropic-q-2")
    try:
        got, headers, payload = http(
            f"{tiny_gateway.url}/v1/messages", "POST", {"model": "tiny-small-queue", "max_tokens": 5, "messages": MSGS}
        )
        assert got == 529 and payload["error"]["type"] == "overloaded_error"
        assert int(headers["retry-after"]) >= 1
    finally:
        running.close()
        waiting.close()


# -- every message shape current Claude Code sends ----------------------------------------------


CALL = '<tool_call>\n{"name": "Read", "arguments": {"file_path": "a.txt"}}\n</tool_call>'
READ_TOOL = {"name": "Read", "description": "Read a file", "input_schema": {"type": "object"}}


def tool_turns(result_content) -> list[dict]:
    """A user turn, the assistant's Read call, and the user's tool_result with this content."""
    return [
        {"role": "user", "content": "Read the file."},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "a.png"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result_content}]},
    ]


def test_system_turns_inside_messages_are_rendered_in_place_also_in_count_tokens(tiny_gateway, smollm2_tokenizer):
    turns = [
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hi."},
        {"role": "system", "content": [{"type": "text", "text": "Reminder: be brief."}]},
        {"role": "user", "content": "Tell me about the sea."},
    ]
    c = client(tiny_gateway)
    counted = c.messages.count_tokens(model="tiny", system="Be kind.", messages=turns)
    msg = c.messages.create(model="tiny", max_tokens=2, system="Be kind.", messages=turns)
    expected = smollm2_tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "Be kind."},
            *turns[:2],
            {"role": "system", "content": "Reminder: be brief."},
            turns[3],
        ],
        add_generation_prompt=True,
    )
    assert counted.input_tokens == prompt_total(msg.usage) == len(expected)


def test_a_system_turn_before_the_first_reply_joins_the_system_prompt(tiny_gateway, smollm2_tokenizer):
    """Claude Code 2.1's environment block comes as a system turn after the first user message;
    rendered last before the reply, a small model copied it into its answer."""
    env = {"role": "system", "content": [{"type": "text", "text": "# Environment\nWorking directory: /tmp/p"}]}
    turns = [{"role": "user", "content": "Create hello.py."}, env]
    counted = client(tiny_gateway).messages.count_tokens(model="tiny", system="Be kind.", messages=turns)
    expected = smollm2_tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "Be kind.\n\n# Environment\nWorking directory: /tmp/p"},
            {"role": "user", "content": "Create hello.py."},
        ],
        add_generation_prompt=True,
    )
    assert counted.input_tokens == len(expected)


def test_late_system_turns_merge_into_the_first_for_templates_that_refuse_them():
    from mlxgw.shared.chat import merge_system_turns

    merged = merge_system_turns(
        [
            {"role": "system", "content": "A."},
            {"role": "user", "content": "u1"},
            {"role": "system", "content": [{"type": "text", "text": "B."}]},
            {"role": "assistant", "content": "a1"},
        ]
    )
    assert merged == [
        {"role": "system", "content": "A.\n\nB."},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
    ]


def test_tool_result_image_for_a_text_model_becomes_a_placeholder_named_in_a_header(tiny_gateway):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_B64}}
    raw = client(tiny_gateway).messages.with_raw_response.create(
        model="echo", max_tokens=200, messages=tool_turns([{"type": "text", "text": "The file:"}, image])
    )
    assert raw.headers["x-mlxgw-omitted-content"] == "image"
    assert raw.parse().content[0].text == "The file:\n[image omitted: this model does not accept images]"


def test_documents_are_read_as_text_pdf_included(tiny_gateway):
    pdf = base64.b64encode(pdf_with_text("Revenue grew 12 percent")).decode()
    for source, expected in [
        ({"type": "text", "media_type": "text/plain", "data": "Plain notes."}, "Plain notes."),
        ({"type": "base64", "media_type": "application/pdf", "data": pdf}, "Revenue grew 12 percent"),
        ({"type": "content", "content": [{"type": "text", "text": "From blocks."}]}, "From blocks."),
    ]:
        doc = {"type": "document", "source": source, "title": "report", "cache_control": {"type": "ephemeral"}}
        msg = client(tiny_gateway).messages.create(
            model="echo", max_tokens=200, messages=[{"role": "user", "content": [doc]}]
        )
        assert msg.content[0].text == f"Document: report\n\n{expected}"
    blocks = {"type": "content", "content": [{"type": "text", "text": "From blocks."}]}
    in_tool_result = client(tiny_gateway).messages.create(
        model="echo", max_tokens=200, messages=tool_turns([{"type": "document", "source": blocks}])
    )
    assert in_tool_result.content[0].text == "From blocks."


@pytest.mark.parametrize(
    "source,needle",
    [
        (
            {"type": "base64", "media_type": "application/pdf", "data": base64.b64encode(b"%PDF-1.4 junk").decode()},
            "PDF",
        ),
        ({"type": "base64", "media_type": "application/pdf", "data": base64.b64encode(b"hello").decode()}, "not a PDF"),
        ({"type": "base64", "media_type": "application/pdf", "data": "***"}, "base64"),
        ({"type": "url", "url": "https://example.com/a.pdf"}, "not fetched"),
    ],
)
def test_unreadable_documents_are_clear_400s(tiny_gateway, source, needle):
    body = {
        "model": "echo",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": [{"type": "document", "source": source}]}],
    }
    status, _, payload = http(f"{tiny_gateway.url}/v1/messages", "POST", body)
    assert status == 400 and payload["error"]["type"] == "invalid_request_error"
    assert needle in payload["error"]["message"]


def test_thinking_blocks_and_cache_control_sent_back_are_accepted(tiny_gateway):
    turns = [
        {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "The user greets me.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Hello!"},
            ],
        },
        {"role": "user", "content": "Say it again."},
    ]
    msg = client(tiny_gateway).messages.create(model="echo", max_tokens=50, messages=turns)
    assert msg.content[0].text == "Say it again."


def test_whitespace_between_tool_calls_is_no_text_block(tiny_gateway):
    turns = [{"role": "user", "content": f"{CALL}\n{CALL}\n"}]
    c = client(tiny_gateway)
    msg = c.messages.create(model="echo", max_tokens=300, messages=turns, tools=[READ_TOOL])
    assert [b.type for b in msg.content] == ["tool_use", "tool_use"]
    with c.messages.stream(model="echo", max_tokens=300, messages=turns, tools=[READ_TOOL]) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["tool_use", "tool_use"]


def test_the_model_list_comes_in_anthropics_shape_when_anthropic_version_is_sent(tiny_gateway):
    status, _, body = http(f"{tiny_gateway.url}/v1/models", headers={"anthropic-version": "2023-06-01"})
    assert status == 200 and "object" not in body
    assert body["has_more"] is False and body["first_id"] == body["data"][0]["id"]
    tiny = next(m for m in body["data"] if m["id"] == "tiny")
    assert tiny["type"] == "model" and tiny["display_name"] == "tiny" and tiny["created_at"].endswith("Z")
    _, _, openai_shape = http(f"{tiny_gateway.url}/v1/models")  # without the header: OpenAI's
    assert openai_shape["object"] == "list" and "has_more" not in openai_shape


def _system_with_billing_line(cch: str) -> list[dict]:
    """Claude Code's system prompt: a billing line for Anthropic's servers, then the prompt."""
    header = f"x-anthropic-billing-header: cc_version=2.1.332.{cch[:3]}; cc_entrypoint=sdk-cli; cch={cch};"
    prompt = " ".join(f"instruction{i}" for i in range(200))
    return [{"type": "text", "text": header}, {"type": "text", "text": prompt, "cache_control": {"type": "ephemeral"}}]


def test_claude_codes_billing_line_is_left_out_of_the_prompt(tiny_gateway):
    c = client(tiny_gateway)
    with_line = c.messages.count_tokens(model="tiny", system=_system_with_billing_line("a1b2c"), messages=MSGS)
    without = c.messages.count_tokens(model="tiny", system=_system_with_billing_line("a1b2c")[1:], messages=MSGS)
    assert with_line.input_tokens == without.input_tokens


def test_a_new_billing_line_does_not_miss_the_prefix_cache(tiny_gateway):
    """Its values change per session (or per request): left in, every new Claude Code
    session would prefill its whole system prompt and tools again."""
    c = client(tiny_gateway)
    c.messages.create(model="tiny", max_tokens=1, system=_system_with_billing_line("11111"), messages=MSGS)
    again = c.messages.create(model="tiny", max_tokens=1, system=_system_with_billing_line("99999"), messages=MSGS)
    assert again.usage.cache_read_input_tokens >= prompt_total(again.usage) - 1


WRITE_TOOL = {
    "name": "Write",
    "description": "Writes a file.",
    "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]},
}
# What Claude Code 2.1 sends first: a deferred placeholder ("never call this tool") that a small
# model called when it was shown.
PLACEHOLDER = {
    "name": "DeferredToolPlaceholder",
    "description": "Reserved placeholder that keeps deferred tool loading active; never call this tool.",
    "input_schema": {"type": "object", "properties": {}},
    "defer_loading": True,
}


def test_a_deferred_tool_is_not_shown_to_the_model_until_a_tool_search_loads_it(tiny_gateway):
    def count(tools, messages=MSGS) -> int:
        body = {"model": "tiny", "messages": messages, "tools": tools}  # tools in its generic system turn
        status, _, r = http(f"{tiny_gateway.url}/v1/messages/count_tokens", method="POST", body=body)
        assert status == 200, r
        return r["input_tokens"]

    plain = count([WRITE_TOOL])
    assert count([PLACEHOLDER, WRITE_TOOL]) == plain, "a deferred tool reached the prompt"
    assert count([{**PLACEHOLDER, "defer_loading": False}, WRITE_TOOL]) > plain  # one not deferred is shown
    searched = MSGS + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "s1", "name": "tool_search", "input": {}}]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "s1",
                    "content": [{"type": "tool_reference", "tool_name": "DeferredToolPlaceholder"}],
                }
            ],
        },
    ]
    assert count([PLACEHOLDER, WRITE_TOOL], searched) > count([WRITE_TOOL], searched), "a loaded tool is shown"


def test_usage_splits_the_prompt_into_input_cache_read_and_cache_write(tiny_gateway):
    """input + cache read + cache write is the whole prompt (Claude Code sums them as the
    context's size; counting cached tokens as input too made a warm context look twice its
    size); a cache_control breakpoint reports what was computed as written to the cache."""
    c = client(tiny_gateway)
    system = [{"type": "text", "text": "You review code for a team. " * 20, "cache_control": {"type": "ephemeral"}}]
    first = c.messages.create(model="tiny", max_tokens=1, system=system, messages=MSGS)
    again = c.messages.create(model="tiny", max_tokens=1, system=system, messages=MSGS)
    plain = c.messages.create(model="tiny", max_tokens=1, system=system[0]["text"], messages=MSGS)
    total = c.messages.count_tokens(model="tiny", system=system, messages=MSGS).input_tokens
    for u in (first.usage, again.usage, plain.usage):
        assert prompt_total(u) == total, u
    assert first.usage.input_tokens == 0 and first.usage.cache_creation_input_tokens > 0
    assert again.usage.cache_read_input_tokens >= total - 32  # whole 32-token blocks come back
    assert plain.usage.cache_creation_input_tokens == 0 and plain.usage.cache_read_input_tokens > 0


@pytest.mark.parametrize(
    "mark,says",
    [({"type": "persistent"}, "ephemeral"), ({"type": "ephemeral", "ttl": "2h"}, "'5m' or '1h'")],
)
def test_a_malformed_cache_control_is_refused_in_anthropics_shape(tiny_gateway, mark, says):
    body = {
        "model": "tiny",
        "max_tokens": 1,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": mark}],
        "messages": MSGS,
    }
    status, _, out = http(f"{tiny_gateway.url}/v1/messages", method="POST", body=body)
    assert status == 400 and out["type"] == "error" and says in out["error"]["message"], out
