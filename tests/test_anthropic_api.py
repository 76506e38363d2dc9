"""Anthropic Messages through a real gateway, driven by the official anthropic SDK."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import pytest
from helpers import http, openai_client, start_long_stream

FIXTURES = Path(__file__).parent / "fixtures"
MSGS = [{"role": "user", "content": "Tell me about the sea."}]


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
    assert msg.usage.input_tokens == len(expected)


def test_stream_helper_assembles_the_same_message_in_the_right_event_order(tiny_gateway):
    c = client(tiny_gateway)
    full = c.messages.create(model="tiny", max_tokens=12, extra_body={"temperature": 0}, messages=MSGS)
    types = []
    with c.messages.stream(model="tiny", max_tokens=12, extra_body={"temperature": 0}, messages=MSGS) as stream:
        for event in stream:
            types.append(event.type)
            if event.type == "message_start":
                assert event.message.usage.input_tokens == full.usage.input_tokens > 0
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
    assert counted.input_tokens == used.usage.input_tokens


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
