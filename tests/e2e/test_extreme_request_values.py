"""Property test: any value in any sampling or request field of any generating
API, however extreme (NaN, ±Infinity, 2**64, negatives, huge lists and dicts, deep nesting,
lone surrogates), costs the caller one clear error at most: never a 500 (nor an error event
of an internal error inside a 200 stream), never a worker restart, and no in-flight residue."""

from __future__ import annotations

import json

import pytest
from helpers import TINY_CONFIG, http, start_gateway
from helpers.hostile import ROUTE_FAMILY, assert_error_shape, wait_in_flight_zero, worker_pids
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODELS = ["null", "tiny"]
ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"]
BASE = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/v1/responses": {"input": "hi", "max_output_tokens": 1},
}
# Every field a client can send, per API; sampling fields on all of them.
SAMPLING = ["temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "logit_bias", "stop"]
FIELDS = {
    "/v1/chat/completions": SAMPLING
    + ["max_tokens", "max_completion_tokens", "n", "presence_penalty", "frequency_penalty", "stream"]
    + ["stream_options", "response_format", "tools", "tool_choice", "chat_template_kwargs", "priority"]
    + ["stream_interval", "logprobs", "top_logprobs", "user", "metadata", "messages", "model"],
    "/v1/completions": SAMPLING + ["max_tokens", "prompt", "echo", "suffix", "best_of", "stream", "n", "model"],
    "/v1/messages": SAMPLING
    + ["max_tokens", "stop_sequences", "system", "tools", "tool_choice", "thinking", "metadata", "stream"]
    + ["messages", "model"],
    "/v1/responses": SAMPLING
    + ["max_output_tokens", "input", "instructions", "text", "tools", "tool_choice", "reasoning", "stream"]
    + ["previous_response_id", "store", "model"],
}
# Fields that set how long a generation runs: only values that end quickly or are refused.
LENGTH_FIELDS = {"max_tokens", "max_completion_tokens", "max_output_tokens"}

EXTREME_NUMBERS = st.sampled_from(
    [float("nan"), float("inf"), float("-inf"), 2**64, -(2**64), 2**63, -(2**63) - 1, -1, 0, 1e308, -1e-308, 100_000]
)
# Token-id maps (logit_bias) with ids past any vocabulary, negative, and past 64 bits.
TOKEN_MAPS = st.dictionaries(
    st.sampled_from(["-1", "0", "49151", "99999999", "18446744073709551616", "x"]),
    st.sampled_from([1, -100, 100, 1e308]),
    min_size=1,
    max_size=3,
)
LONE_SURROGATES = st.sampled_from(["\ud800", "\udfff", "a\udc00b", "\ud83d"])


def deep(levels: int, leaf) -> object:
    value = leaf
    for i in range(levels):
        value = [value] if i % 2 else {"k": value}
    return value


EXTREME = st.one_of(
    EXTREME_NUMBERS,
    LONE_SURROGATES,
    TOKEN_MAPS,
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),  # NaN and infinities included
    st.text(max_size=30),
    st.booleans(),
    st.none(),
    st.builds(lambda n, v: [v] * n, st.sampled_from([0, 1, 10_000]), EXTREME_NUMBERS | st.text(max_size=3)),
    st.builds(lambda n: {str(i): i for i in range(n)}, st.sampled_from([1, 20_000])),
    st.builds(deep, st.sampled_from([30, 70, 600]), EXTREME_NUMBERS | st.just("x")),
    st.just("x" * 200_000),
)
# Numeric fields get mostly numbers (so each extreme number meets each numeric field often),
# token maps mostly maps; every field also gets any value at all.
NUMERIC_FIELDS = {"temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty"}
NUMERIC_FIELDS |= {"frequency_penalty", "n", "priority", "stream_interval", "top_logprobs", "best_of", "logprobs"}
NUMERIC = st.one_of(EXTREME_NUMBERS, EXTREME_NUMBERS, st.integers(min_value=-(2**70), max_value=2**70), EXTREME)
MAPS = st.one_of(TOKEN_MAPS, TOKEN_MAPS, EXTREME)
SHORT_LENGTHS = st.sampled_from([float("nan"), float("inf"), 2**64, -(2**63) - 1, -1, 0, 1, 3, "3", None, [], {}])


@st.composite
def hostile_request(draw) -> tuple[str, dict]:
    route = draw(st.sampled_from(ROUTES))
    body = {"model": draw(st.sampled_from(MODELS)), **BASE[route]}
    for name in draw(st.lists(st.sampled_from(FIELDS[route]), min_size=1, max_size=2, unique=True)):
        if name in LENGTH_FIELDS:
            body[name] = draw(SHORT_LENGTHS)
        elif name in NUMERIC_FIELDS:
            body[name] = draw(NUMERIC)
        else:
            body[name] = draw(MAPS if name == "logit_bias" else EXTREME)
    return route, body


def internal_error_in_stream(text: str) -> bool:
    """A 200 stream that carries an internal error event hides a 500."""
    return any(
        marker in text for marker in ('"code": "internal_error"', '"type": "api_error"', '"type": "server_error"')
    )


@pytest.fixture(scope="module")
def hostile_gateway(home, tiny_dir):
    """A gateway of its own: a failure here must not leave restarted workers to other tests."""
    models = [m for m in TINY_CONFIG["models"] if m["name"] in MODELS]
    gw = start_gateway(home, {**TINY_CONFIG, "models": [{**m, "preload": True} for m in models]}, "hostile-gateway")
    yield gw
    gw.stop()


def send(gw, route: str, body: dict) -> int:
    """One request; asserts it got no 5xx and, if refused, the API's error shape."""
    raw = json.dumps(body, allow_nan=True).encode()  # NaN, Infinity and \ud800 as clients send them
    status, _, payload = http(gw.url + route, "POST", raw=raw, timeout=60)
    assert status < 500, (route, json.dumps(body, allow_nan=True)[:300], payload)
    if status >= 400:
        assert_error_shape(payload, ROUTE_FAMILY[route], status)
    elif isinstance(payload, str):
        assert not internal_error_in_stream(payload), (route, body, payload[-500:])
    return status


def snapshot(gw) -> tuple[dict, dict]:
    """Worker pids and restart counts, to compare after the attack."""
    return worker_pids(gw, MODELS), {m: gw.model_status(m)["restarts"] for m in MODELS}


def assert_unharmed(gw, before: tuple[dict, dict]) -> None:
    assert wait_in_flight_zero(gw) == {}
    assert snapshot(gw) == before


SWEPT_VALUES = [float("nan"), float("inf"), float("-inf"), 2**64, -(2**63) - 1, -1, 0, 100_000, 1e308]
SWEPT_MAPS = [{"99999999": 1}, {"-1": 1}, {"18446744073709551616": 1}, {str(i): 1 for i in range(100_000)}]


def test_every_extreme_value_in_every_sampling_field_is_harmless(hostile_gateway):
    before = snapshot(hostile_gateway)
    for route in ROUTES:
        for name in SAMPLING + ["presence_penalty", "frequency_penalty"]:
            values = SWEPT_MAPS if name == "logit_bias" else SWEPT_VALUES
            for value in values:
                # temperature > 0 so that seeds and samplers are really used
                body = {"model": "tiny", **BASE[route], "temperature": 0.7, name: value}
                send(hostile_gateway, route, body)
    assert_unharmed(hostile_gateway, before)


def test_random_hostile_bodies_are_harmless(hostile_gateway):
    before = snapshot(hostile_gateway)
    seen: set[int] = set()

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(hostile_request())
    def hit(request):
        seen.add(send(hostile_gateway, *request))

    hit()
    assert seen & {400, 422}, f"nothing was refused: the strategy is not hostile enough ({seen})"
    assert_unharmed(hostile_gateway, before)
