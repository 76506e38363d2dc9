"""Bad input gets a clear 4xx in OpenAI's error shape: never a 500, never a dead worker."""

from __future__ import annotations

import pytest
from helpers import http

MSGS = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

CASES = [
    # (name, path, body or raw bytes, status, code, text the message must contain)
    ("malformed json", CHAT, b'{"model": "tiny", "messages": [', 400, "invalid_request", "malformed JSON"),
    ("not utf-8", CHAT, b'\xff\xfe{"model"', 400, "invalid_request", "UTF-8"),
    ("empty body", CHAT, b"", 400, "invalid_request", "empty"),
    ("body is a list", CHAT, [1, 2], 400, "invalid_request", "JSON object"),
    ("missing messages", CHAT, {"model": "tiny"}, 400, "invalid_request", "'messages'"),
    ("missing model", CHAT, {"messages": MSGS}, 400, "invalid_request", "'model'"),
    ("messages not a list", CHAT, {"model": "tiny", "messages": "hi"}, 400, "invalid_request", "messages"),
    ("empty messages", CHAT, {"model": "tiny", "messages": []}, 400, "invalid_request", "non-empty"),
    ("message without role", CHAT, {"model": "tiny", "messages": [{"content": "x"}]}, 400, "invalid_request", "role"),
    (
        "content of wrong type",
        CHAT,
        {"model": "tiny", "messages": [{"role": "user", "content": 5}]},
        400,
        "invalid_request",
        "content",
    ),
    (
        "temperature wrong type",
        CHAT,
        {"model": "tiny", "messages": MSGS, "temperature": "hot"},
        400,
        "invalid_request",
        "temperature",
    ),
    (
        "temperature out of range",
        CHAT,
        {"model": "tiny", "messages": MSGS, "temperature": 7},
        400,
        "invalid_request",
        "temperature",
    ),
    (
        "max_tokens zero",
        CHAT,
        {"model": "tiny", "messages": MSGS, "max_tokens": 0},
        400,
        "invalid_request",
        "max_tokens",
    ),
    (
        "max_tokens negative",
        COMPLETIONS,
        {"model": "tiny", "prompt": "x", "max_tokens": -1},
        400,
        "invalid_request",
        "max_tokens",
    ),
    ("n above one", CHAT, {"model": "tiny", "messages": MSGS, "n": 3}, 400, "invalid_request", "n=1"),
    ("stop of wrong type", CHAT, {"model": "tiny", "messages": MSGS, "stop": 12}, 400, "invalid_request", "stop"),
    (
        "bad logit_bias",
        CHAT,
        {"model": "tiny", "messages": MSGS, "logit_bias": {"x": 1}},
        400,
        "invalid_request",
        "logit_bias",
    ),
    (
        "image to a text model",
        CHAT,
        {
            "model": "tiny",
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
            ],
        },
        400,
        "invalid_request",
        "images",
    ),
    ("unknown model", CHAT, {"model": "nope", "messages": MSGS}, 404, "model_not_found", "nope"),
    ("missing prompt", COMPLETIONS, {"model": "tiny"}, 400, "invalid_request", "'prompt'"),
    ("prompt of wrong type", COMPLETIONS, {"model": "tiny", "prompt": {"a": 1}}, 400, "invalid_request", "prompt"),
    (
        "token id out of range",
        COMPLETIONS,
        {"model": "tiny", "prompt": [1, 99999999]},
        400,
        "invalid_request",
        "token ids",
    ),
    (
        "prompt longer than the context",
        COMPLETIONS,
        {"model": "tiny-short", "prompt": "word " * 200},
        400,
        "context_length_exceeded",
        "64",
    ),
    (
        "max_tokens past the context, policy reject",
        COMPLETIONS,
        {"model": "tiny-short", "prompt": "word " * 20, "max_tokens": 500},
        400,
        "context_length_exceeded",
        "500",
    ),
    (
        "response_format of an unknown type",
        CHAT,
        {"model": "tiny", "messages": MSGS, "response_format": {"type": "xml"}},
        400,
        "invalid_request",
        "response_format",
    ),
    (
        "json schema that is not a schema",
        CHAT,
        {
            "model": "tiny",
            "messages": MSGS,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wobbly"}}},
        },
        400,
        "invalid_request",
        "invalid json_schema",
    ),
]


@pytest.mark.parametrize("name,path,body,status,code,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_a_clear_error(tiny_gateway, name, path, body, status, code, needle):
    raw = body if isinstance(body, bytes) else None
    got, headers, payload = http(tiny_gateway.url + path, "POST", None if raw is not None else body, raw=raw)
    assert got == status, payload
    err = payload["error"]
    assert err["code"] == code
    assert needle in err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    assert headers["content-type"].startswith("application/json")


def test_context_error_names_both_numbers(tiny_gateway, smollm2_tokenizer):
    prompt = "word " * 200
    _, _, payload = http(tiny_gateway.url + COMPLETIONS, "POST", {"model": "tiny-short", "prompt": prompt})
    message = payload["error"]["message"]
    assert "64 tokens" in message and f"{len(smollm2_tokenizer.encode(prompt))} tokens" in message


def test_body_over_the_limit_is_413(tiny_gateway):
    huge = {"model": "tiny", "messages": [{"role": "user", "content": "x" * (11 * 1024 * 1024)}]}
    status, _, payload = http(tiny_gateway.url + CHAT, "POST", huge)
    assert status == 413 and payload["error"]["code"] == "request_too_large"


def test_unknown_route_and_wrong_method_use_the_error_shape(tiny_gateway):
    status, _, payload = http(tiny_gateway.url + "/v1/nothing-here")
    assert status == 404 and payload["error"]["code"] == "not_found"
    status, _, payload = http(tiny_gateway.url + CHAT, "GET")
    assert status == 405 and "POST" in payload["error"]["message"]


def test_gateway_and_worker_stay_healthy_after_bad_input(tiny_gateway):
    for _, path, body, *_ in CASES:
        raw = body if isinstance(body, bytes) else None
        http(tiny_gateway.url + path, "POST", None if raw is not None else body, raw=raw)
    status, _, health = http(tiny_gateway.url + "/health")
    assert status == 200 and health["models"]["tiny"] == "ready"
    status, _, out = http(tiny_gateway.url + CHAT, "POST", {"model": "tiny", "messages": MSGS, "max_tokens": 3})
    assert status == 200 and out["usage"]["completion_tokens"] == 3
    assert tiny_gateway.model_status("tiny")["restarts"] == 0
