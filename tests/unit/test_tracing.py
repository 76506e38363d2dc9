"""Tracing's switches and the checks on what a worker returns: the environment decides
whether the SDK is loaded at all, a worker's times become spans only when they can be
trusted, and the worker's marks count steps and keep time order."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from helpers import REPO

from mlxgw.gateway.pipeline.tracing import Tracing, from_env, wanted
from mlxgw.gateway.pipeline.worker_spans import emit_worker_spans, marks_of
from mlxgw.shared import protocol as p
from mlxgw.shared.events import Accepted, Usage
from mlxgw.worker.schedule.trace_marks import marks_for

ENDPOINT = "http://127.0.0.1:9"


@pytest.mark.parametrize(
    "env, on",
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "x", "OTEL_EXPORTER_OTLP_HEADERS": "a=b"}, False),  # no endpoint: off
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ENDPOINT + "/v1/traces"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_TRACES_EXPORTER": "none"}, False),
    ],
)
def test_the_standard_variables_switch_traces(env, on):
    assert wanted(env) is on
    if not on:
        assert from_env(env) is None


def test_unset_the_gateway_never_imports_opentelemetry():
    """The cost of traces off: not one module of the SDK (or of protobuf) is loaded."""
    code = (
        "import sys\n"
        "from mlxgw.gateway import app, server\n"
        "from mlxgw.gateway.pipeline.tracing import from_env\n"
        "assert from_env() is None\n"
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry', 'google.protobuf'))))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _good() -> dict:
    t = time.time_ns()
    return {
        "parent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01",
        "arrived": t,
        "queued": t + 10,
        "admitted": t + 20,
        "first_token": t + 30,
        "end": t + 40,
        "prefill_steps": 1,
        "decode_steps": 2,
    }


@pytest.mark.parametrize(
    "change",
    [
        {"parent": None},
        {"arrived": None},
        {"end": "soon"},
        {"queued": 1.5},
        {"admitted": True},
        {"first_token": -1},
        {"end": 1},  # before it began
        {"admitted": 2**70},
    ],
)
def test_a_worker_map_that_cannot_be_trusted_makes_no_spans(change):
    assert marks_of(_good()) is not None
    assert marks_of({**_good(), **change}) is None
    assert marks_of("not a map") is None


def test_phases_never_reached_and_odd_counts_are_kept_or_zeroed():
    marks = marks_of({**_good(), "admitted": None, "first_token": None, "decode_steps": "many"})
    assert marks["admitted"] is None and marks["first_token"] is None and marks["decode_steps"] == 0


def test_worker_marks_count_prefill_then_decode_steps_in_time_order():
    assert marks_for(p.GenerateRequest(rid="a"), time.monotonic()) is None  # not traced: nothing noted
    marks = marks_for(
        p.GenerateRequest(rid="b", traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01"), time.monotonic()
    )
    marks.admit()
    admitted = marks.admitted
    marks.step(None)
    marks.step(None)  # the step that read its last chunk and made its first token
    first = time.monotonic()
    marks.step(first)
    marks.admit()  # a paused row admitted again keeps its first admission
    wire = marks.wire(first)
    assert marks.admitted == admitted and (wire["prefill_steps"], wire["decode_steps"]) == (2, 1)
    assert marks_of(wire) is not None  # what the worker sends, the gateway takes
    assert wire["arrived"] <= wire["queued"] <= wire["admitted"] <= wire["first_token"] <= wire["end"]
    assert abs(wire["end"] - time.time_ns()) < 1e9


def _emitted(marks: dict, outcome: str, trace_of=None) -> dict:
    """The spans emit_worker_spans makes of one generation, by name (an in-memory exporter)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing = Tracing(exporter)
    root = tracing.tracer.start_span("POST /v1/chat/completions", kind=tracing.server)
    parent = tracing.traceparent(trace_of(tracing) if trace_of else root)
    req = p.GenerateRequest(rid="req_1", messages=[{"role": "user", "content": "hi"}], max_tokens=5, traceparent=parent)
    gen = SimpleNamespace(
        req=req, model_name="tiny", usage=Usage(12, 0, 4), outcome=outcome, accepted=Accepted(12, 5, 3)
    )
    gen.worker_trace = {**marks, "parent": parent}
    emit_worker_spans(tracing, root, gen)
    root.end()
    tracing.shutdown()
    return {s.name: s for s in exporter.get_finished_spans()}


def test_a_request_that_timed_out_in_the_queue_has_no_prefill_or_decode_span():
    marks = {**_good(), "admitted": None, "first_token": None}
    spans = _emitted(marks, "error:timeout")
    assert set(spans) == {"POST /v1/chat/completions", "chat tiny", "prepare", "queue"}
    worker, queue = spans["chat tiny"], spans["queue"]
    assert worker.parent.span_id == spans["POST /v1/chat/completions"].context.span_id
    assert queue.parent.span_id == worker.context.span_id
    assert worker.status.status_code.name == "ERROR" and worker.attributes["error.type"] == "timeout"
    assert queue.end_time == marks["end"] and queue.attributes["mlxgw.queue.waiting"] == 3
    assert worker.attributes["gen_ai.usage.cache_read.input_tokens"] == 4


def test_times_returned_under_another_trace_make_no_spans():
    other = lambda tracing: tracing.tracer.start_span("elsewhere")  # noqa: E731
    assert set(_emitted(_good(), "stop", other)) == {"POST /v1/chat/completions"}
