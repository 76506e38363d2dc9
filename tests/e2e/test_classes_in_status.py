"""Latency classes through a real `mlxgw up` (tiny model): a request's class from its route
or what it asks, each class's target and what the workers measured in /v1/status, and a
class that is not one a 400 in the API's shape."""

from __future__ import annotations

from helpers import http, wait_for

CLASSES = ["editor", "chat", "agent", "background"]


def _agent_answered(gw) -> dict | None:
    status, _, body = http(f"{gw.url}/v1/status")
    assert status == 200
    agent = body["classes"]["agent"]
    return body if agent["answered"] >= 1 else None


def test_a_request_s_class_and_its_first_token_time_are_in_status(tiny_gateway):
    body = {"model": "tiny", "prompt": "One two", "max_tokens": 2, "latency_class": "agent"}
    status, _, out = http(f"{tiny_gateway.url}/v1/completions", "POST", body)
    assert status == 200, out
    report = wait_for(lambda: _agent_answered(tiny_gateway), timeout=30)
    classes = report["classes"]
    assert list(classes) == CLASSES
    assert [classes[c]["target_s"] for c in CLASSES] == [0.5, 1.0, 3.0, 60.0]  # the documented defaults
    (model,) = [m for m in report["models"] if m["name"] == "tiny"]
    measured = [w["stats"]["classes"]["agent"] for w in model["workers"]]
    assert any(m["ttft_p50_s"] is not None and m["target_s"] == 3.0 for m in measured), measured


def test_a_class_that_is_not_one_is_refused_naming_the_field(tiny_gateway):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "latency_class": "urgent"}
    status, _, out = http(f"{tiny_gateway.url}/v1/chat/completions", "POST", body)
    assert status == 400, out
    assert out["error"]["param"] == "latency_class", out
