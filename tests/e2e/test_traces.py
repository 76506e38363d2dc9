"""Traces over OTLP/HTTP against a real `mlxgw up` with the tiny model and a real receiver
that decodes the official opentelemetry-proto messages: one trace per request, the
gateway's span continuing the client's `traceparent`, the worker's spans (prepare, queue,
prefill, decode) its children with the GenAI conventions' attributes; and with the
variables unset, nothing sent."""

from __future__ import annotations

import os
import secrets
import socket

import pytest
import yaml
from helpers import NO_EOS, REPO, http
from helpers.otlp import OtlpReceiver

from mlxgw.bench.servers import start_mlxgw
from mlxgw.gateway.access.keys import hash_key

KEY = "sk-traces-" + secrets.token_hex(8)
SERVER, INTERNAL = 2, 1  # opentelemetry.proto.trace.v1.Span.SpanKind
WORKER_PHASES = ("prepare", "queue", "prefill", "decode")


def _env(**set_: str) -> dict:
    """This environment without any OTEL_ variable, plus set_."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return {**env, **set_}


def _start(home, name: str, config: dict, env: dict, extra_args=()):
    # start_mlxgw adds env to os.environ: the OTEL_ variables of the caller are cleared here
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("OTEL_")}
    try:
        return start_mlxgw(home, config, name, env=env, extra_args=extra_args, cwd=REPO, timeout=240)
    finally:
        os.environ.update(saved)


@pytest.fixture(scope="module")
def receiver():
    r = OtlpReceiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def traced(home, tiny_dir, receiver, tmp_path_factory):
    keys = tmp_path_factory.mktemp("traces") / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": [{"name": "alice", "sha256": hash_key(KEY)}]}))
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_EXPORTER_OTLP_HEADERS": "x-team=ml",
        "OTEL_BSP_SCHEDULE_DELAY": "50",  # export within 50 ms (the SDK's default waits 5 s)
    }
    config = {"manager": {"auto_discover": False}, "models": [{"name": "tiny", "preload": True}]}
    gw = _start(home, "traces-gateway", config, env, ("--keys", str(keys)))
    yield gw
    gw.stop()


def _chat(gw, headers: dict, stream: bool = False) -> tuple[int, object]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": stream}
    body["logit_bias"] = NO_EOS  # three tokens: a first, then two decode steps
    if stream:
        body["stream_options"] = {"include_usage": True}
    status, _, payload = http(
        f"{gw.url}/v1/chat/completions", "POST", body, {**headers, "Authorization": f"Bearer {KEY}"}
    )
    return status, payload


def _complete(spans: list, trace_id: str) -> bool:
    names = {s.name for s in spans if s.trace_id == trace_id}
    return "POST /v1/chat/completions" in names and {"decode", "chat tiny"} <= names


def test_a_request_is_one_trace_from_the_client_into_the_worker(traced, receiver):
    client_trace, client_span = secrets.token_hex(16), secrets.token_hex(8)
    status, payload = _chat(traced, {"traceparent": f"00-{client_trace}-{client_span}-01"})
    assert status == 200, payload
    receiver.wait_for(lambda spans: _complete(spans, client_trace))
    spans = receiver.trace(client_trace)
    by_name = {s.name: s for s in spans}
    assert sorted(by_name) == sorted(["POST /v1/chat/completions", "chat tiny", *WORKER_PHASES]), spans
    assert len(spans) == len(by_name)  # one of each

    gateway = by_name["POST /v1/chat/completions"]
    assert gateway.parent_id == client_span and gateway.kind == SERVER and gateway.service == "mlxgw"
    a = gateway.attributes
    assert a["http.route"] == "/v1/chat/completions" and a["http.response.status_code"] == 200
    assert a["mlxgw.key"] == "alice" and a["gen_ai.request.model"] == "tiny"
    assert not any(KEY in str(v) for s in spans for v in s.attributes.values())  # the key's name, never the key
    usage = payload["usage"]
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert a["gen_ai.response.finish_reasons"] == [payload["choices"][0]["finish_reason"]]

    worker = by_name["chat tiny"]
    assert worker.parent_id == gateway.span_id and worker.kind == INTERNAL
    w = worker.attributes
    assert w["gen_ai.operation.name"] == "chat" and w["gen_ai.request.model"] == "tiny"
    assert w["gen_ai.request.max_tokens"] == 3 and w["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    phases = [by_name[n] for n in WORKER_PHASES]
    assert all(p.parent_id == worker.span_id for p in phases)
    # in order, inside the worker's span, inside the gateway's
    assert gateway.start <= worker.start and worker.end <= gateway.end
    assert [p.start for p in phases] == sorted(p.start for p in phases)
    for before, after in zip(phases, phases[1:]):
        assert before.end == after.start
    prefill, decode = by_name["prefill"].attributes, by_name["decode"].attributes
    computed, cached = prefill["mlxgw.prefill.computed_tokens"], prefill["gen_ai.usage.cache_read.input_tokens"]
    assert computed + cached == usage["prompt_tokens"] and prefill["mlxgw.prefill.steps"] >= 1
    assert decode["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert decode["mlxgw.decode.steps"] == usage["completion_tokens"] - 1  # the first token came with the prefill

    assert receiver.posts[0]["path"] == "/v1/traces" and receiver.posts[0]["headers"]["x-team"] == "ml"


def test_a_request_without_traceparent_starts_its_own_trace(traced, receiver):
    before = {s.trace_id for s in receiver.spans}
    status, _ = _chat(traced, {}, stream=True)
    assert status == 200
    new = lambda spans: [s for s in spans if s.trace_id not in before and s.name == "decode"]  # noqa: E731
    decode = new(receiver.wait_for(lambda spans: new(spans)))
    assert len(decode) == 1  # one trace for the request
    spans = receiver.trace(decode[0].trace_id)
    roots = [s for s in spans if not s.parent_id]
    assert [r.name for r in roots] == ["POST /v1/chat/completions"]
    assert {s.name for s in spans} == {"POST /v1/chat/completions", "chat tiny", *WORKER_PHASES}


def _bind(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_with_the_variables_unset_nothing_is_sent(home, tmp_path_factory):
    """A gateway with the other OTEL_ variables but no endpoint: a traced client's request
    sends nothing, not even to the SDK's default endpoint (localhost:4318)."""
    if not _bind(4318):
        pytest.skip("port 4318 (OTLP/HTTP's default) is taken on this machine")
    default = OtlpReceiver(4318)
    try:
        env = {
            "OTEL_SERVICE_NAME": "mlxgw-test",
            "OTEL_EXPORTER_OTLP_HEADERS": "x-team=ml",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
        }
        config = {"manager": {"auto_discover": False}, "models": [{"name": "null", "engine": "null", "preload": True}]}
        gw = _start(home, "untraced-gateway", config, env)
        try:
            body = {"model": "null", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            trace = {"traceparent": f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"}
            status, _, _ = http(f"{gw.url}/v1/chat/completions", "POST", body, trace)
            assert status == 200
            assert default.wait_for(lambda spans: spans, timeout=1.0) == [] and default.posts == []
        finally:
            gw.stop()
    finally:
        default.close()
