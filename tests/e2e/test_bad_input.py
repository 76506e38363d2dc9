"""Bad input gets a clear 4xx in OpenAI's error shape: never a 500, never a dead worker."""

from __future__ import annotations

import json

import pytest
from helpers import http, openai_client
from helpers.hostile import ROUTE_FAMILY, assert_error_shape, raw_request, wait_in_flight_zero, worker_pids

MSGS = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

CASES = [
    # (name, path, body or raw bytes, status, code, text the message must contain)
    ("malformed json", CHAT, b'{"model": "tiny", "messages": [', 400, "invalid_request", "malformed JSON"),
    (
        "responses text.format not an object",
        "/v1/responses",
        {"model": "tiny", "input": "hi", "text": {"format": "abc"}},
        400,
        "invalid_request",
        "format",
    ),
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
    ("n above the limit", CHAT, {"model": "tiny", "messages": MSGS, "n": 17}, 400, "invalid_request", "at most 16"),
    # the one-pass parse: msgspec's refusals in the words of every other field check
    (
        "n below the limit",
        CHAT,
        {"model": "tiny", "messages": MSGS, "n": 0},
        400,
        "invalid_request",
        "'n' must be at least 1, got 0",
    ),
    (
        "logprobs not a boolean",
        CHAT,
        {"model": "tiny", "messages": MSGS, "logprobs": "yes"},
        400,
        "invalid_request",
        "'logprobs' must be true or false, got str",
    ),
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


@pytest.mark.parametrize(
    ("budget", "needle"),
    [(-1, "'budget_tokens' must be at least 0, got -1"), ("10", "'budget_tokens' must be an integer")],
)
def test_anthropic_thinking_budget_is_checked_in_anthropics_shape(tiny_gateway, budget, needle):
    thinking = {"type": "enabled", "budget_tokens": budget}
    body = {"model": "tiny", "max_tokens": 2, "messages": MSGS, "thinking": thinking}
    status, _, payload = http(tiny_gateway.url + "/v1/messages", "POST", body)
    assert status == 400 and needle in assert_error_shape(payload, "anthropic", status), payload


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


# -- bodies that are valid JSON but hostile: refused before anything else runs ---------------------
def hostile_body(fragment: str) -> bytes:
    """A body every generating route would otherwise accept, with one hostile member."""
    return (
        '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "input": "hi", '
        + fragment
        + "}"
    ).encode()


def nested(levels: int) -> str:
    return '{"a": ' * levels + "1" + "}" * levels


HOSTILE = [
    # (name, body, the param the error names (None: either field may be named), text in the message)
    ("100000 levels of nesting", hostile_body('"tools": ' + "[" * 100_000 + "]" * 100_000), None, "nested"),
    (
        "600 levels in chat_template_kwargs",
        hostile_body(f'"chat_template_kwargs": {nested(600)}'),
        "chat_template_kwargs",
        "nested",
    ),
    ("max_tokens of 2**64", hostile_body('"max_tokens": 18446744073709551616'), "max_tokens", "64-bit"),
    ("seed below the int64 range", hostile_body('"seed": -9223372036854775809'), "seed", "64-bit"),
    ("temperature NaN", hostile_body('"temperature": NaN'), "temperature", "NaN"),
    ("top_p Infinity", hostile_body('"top_p": Infinity'), "top_p", "Infinity"),
    ("temperature 1e400", hostile_body('"temperature": 1e400'), "temperature", "inf"),
    ("logit_bias value of 2**64", hostile_body('"logit_bias": {"5": 18446744073709551616}'), "logit_bias", "64-bit"),
    ("dimensions of 2**64", hostile_body('"dimensions": 18446744073709551616'), "dimensions", "64-bit"),
    (
        "lone surrogate in content",
        b'{"model": "tiny", "prompt": "\\ud800", "input": "x", "messages": [{"role": "user", "content": "\\ud800"}]}',
        None,
        "surrogate",
    ),
    ("lone surrogate in a key", hostile_body('"metadata": {"\\udc00": 1}'), "metadata", "surrogate"),
    ("600 levels in tools", hostile_body(f'"tools": [{nested(600)}]'), "tools", "nested"),
    (
        "600 levels in a response_format schema",
        hostile_body(
            '"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ' + nested(600) + "}}"
        ),
        "response_format",
        "nested",
    ),
]
HOSTILE_ROUTES = list(ROUTE_FAMILY)


@pytest.mark.parametrize("route", HOSTILE_ROUTES)
@pytest.mark.parametrize("name,body,param,needle", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_body_is_a_400_in_the_apis_shape(tiny_gateway, route, name, body, param, needle):
    status, headers, payload = http(tiny_gateway.url + route, "POST", raw=body)
    assert status == 400, payload
    message = assert_error_shape(payload, ROUTE_FAMILY[route], status)
    assert needle in message
    if ROUTE_FAMILY[route] == "openai":
        named = payload["error"]["param"]
        assert named == param if param else (named is None or named in message)
    assert headers["content-type"].startswith("application/json")


# Token ids at or past 2**64 where a client sends token ids: a prompt of ids, an embeddings
# input of ids, and logit_bias keys (strings in JSON, so the body parser cannot see them).
TOKEN_IDS_PAST_64_BITS = [
    ("prompt ids", COMPLETIONS, {"model": "tiny", "prompt": [1, 2**64], "max_tokens": 2}, "prompt"),
    ("batch of prompt ids", COMPLETIONS, {"model": "tiny", "prompt": [[1], [2**64]], "max_tokens": 2}, "prompt"),
    ("embeddings input ids", "/v1/embeddings", {"model": "tiny", "input": [[1, 2**64]]}, "input"),
    ("logit_bias key", CHAT, {"model": "tiny", "messages": MSGS, "logit_bias": {str(2**64): 1}}, "logit_bias"),
    (
        "logit_bias key, completions",
        COMPLETIONS,
        {"model": "tiny", "prompt": "x", "logit_bias": {str(2**64): 1}},
        "logit_bias",
    ),
]


@pytest.mark.parametrize("name,route,body,param", TOKEN_IDS_PAST_64_BITS, ids=[c[0] for c in TOKEN_IDS_PAST_64_BITS])
def test_token_ids_past_64_bits_are_a_400_naming_the_field(tiny_gateway, name, route, body, param):
    status, _, payload = http(tiny_gateway.url + route, "POST", body)
    assert status == 400, payload
    assert_error_shape(payload, "openai", status)
    assert payload["error"]["param"] == param, payload


def body_routes() -> list[tuple[str, str]]:
    """Every route of the gateway that may read a body (method, path with its parameters
    filled in), taken from the route tables the app is built from."""
    import re

    from mlxgw.gateway.app import route_tables

    tables = route_tables()
    found = set()

    def fill(m: re.Match) -> str:
        # a model nothing else uses (unloading or pinning it disturbs no other test)
        return "null-default" if m.group(1) == "name" else "no-such-id"

    for table in tables:
        for route in table:
            if getattr(route, "method", "GET") in ("POST", "PUT", "PATCH"):
                found.add((route.method, re.sub(r"\{(\w+)(:[^}]*)?\}", fill, route.path)))
    return sorted(found)


@pytest.mark.parametrize("method,path", body_routes())
def test_json_nested_100000_levels_is_never_a_500_on_any_route(tiny_gateway, method, path):
    """RecursionError used to escape the JSON reader: a 500 on every route."""
    raw = ("[" * 100_000 + "]" * 100_000).encode()
    status, _, payload = http(tiny_gateway.url + path, method, raw=raw)
    assert status < 500, (path, payload)
    if status >= 400:
        assert isinstance(payload, dict) and "error" in payload, payload


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages"])
def test_oversized_header_is_a_400_in_the_apis_shape(tiny_gateway, route):
    request = (
        f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"x-request-id: {'a' * 10_000}\r\nContent-Length: 2\r\n\r\n{{}}"
    ).encode()
    status, body = raw_request(tiny_gateway.port, request)
    assert status == 400
    message = assert_error_shape(json.loads(body), ROUTE_FAMILY[route], status)
    assert "longer than" in message


def test_malformed_request_line_is_a_400_in_openai_shape(tiny_gateway):
    status, body = raw_request(tiny_gateway.port, b"NOT-HTTP \x00\x01\r\n\r\n")
    assert status == 400
    assert "malformed HTTP request" in assert_error_shape(json.loads(body), "openai", status)


def innocent_stream(gw):
    """A stream on the null engine: its first chunk (it is running from here on) and the rest."""
    stream = openai_client(gw).chat.completions.create(
        model="null", messages=MSGS, max_tokens=200, stream=True, stream_options={"include_usage": True}
    )
    return [next(iter(stream))], stream


def stream_text(chunks) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_hostile_bodies_leave_no_residue_and_spare_a_concurrent_stream(tiny_gateway):
    first, rest = innocent_stream(tiny_gateway)
    alone = first + list(rest)
    before = worker_pids(tiny_gateway, ["tiny", "null"])
    chunks, innocent = innocent_stream(tiny_gateway)
    for route in HOSTILE_ROUTES:
        for _, body, _, _ in HOSTILE:
            assert http(tiny_gateway.url + route, "POST", raw=body)[0] == 400
    for _, route, body, _ in TOKEN_IDS_PAST_64_BITS:
        assert http(tiny_gateway.url + route, "POST", body)[0] == 400
    for _, path, body, status, _, _ in CASES:
        raw = body if isinstance(body, bytes) else None
        assert http(tiny_gateway.url + path, "POST", None if raw is not None else body, raw=raw)[0] == status
    chunks += list(innocent)
    assert chunks[-1].usage.completion_tokens == 200
    assert stream_text(chunks) == stream_text(alone)
    assert wait_in_flight_zero(tiny_gateway) == {}
    assert worker_pids(tiny_gateway, ["tiny", "null"]) == before
    assert tiny_gateway.model_status("tiny")["restarts"] == 0


def test_redacts_server_paths_from_client_messages():
    from mlxgw.shared.errors import ErrorCode, ServiceError

    err = ServiceError(ErrorCode.MODEL_UNAVAILABLE, "load failed: '/Users/ann/.mlxgw/models/x/config.json' missing")
    assert "/Users/ann" not in err.message and "config.json" in err.message
    assert ServiceError(ErrorCode.NOT_FOUND, "use /v1/chat/completions").message == "use /v1/chat/completions"
