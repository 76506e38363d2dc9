"""Traces over OTLP/HTTP, when the standard OpenTelemetry variables ask for them.

With `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT` set (and the
optional `mlxgw[otel]` packages installed), every HTTP request is a trace: a server span
for the request (continuing the client's W3C `traceparent`), and for each generation the
worker's spans (prepare, queue, prefill, decode; gateway/pipeline/worker_spans.py). The
exporter, its headers, timeouts, sampler and batching are the SDK's own, from the same
standard variables (OTEL_EXPORTER_OTLP_HEADERS, OTEL_TRACES_SAMPLER, OTEL_BSP_*, ...).

Unset, `from_env` returns None and nothing of OpenTelemetry is imported: each request pays
one None check in the observe middleware and one in `serving.generation`. Spans are queued
by the SDK's batch processor and exported from its own thread, never on the event loop."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

from aiohttp import web

from ...shared import protocol as p
from .worker_spans import emit_worker_spans

log = logging.getLogger(__name__)

TRACING = web.AppKey("tracing", object)  # Tracing | None
SPAN = "trace_span"  # the request's gateway span (request[SPAN]), while it is traced
TRACED = "traced_generations"  # the request's generations whose worker spans to emit

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
SERVICE_NAME = "mlxgw"
STOP_FLUSH_S = 5.0


def wanted(environ: dict | os._Environ = os.environ) -> bool:
    """Whether the environment asks for traces (the SDK's own switches off honoured)."""
    if not any(environ.get(name) for name in ENDPOINT_VARIABLES):
        return False
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() != "none"


def from_env(environ: dict | os._Environ = os.environ) -> Tracing | None:
    """The gateway's tracing, or None (unset, or the optional packages missing: said once)."""
    if not wanted(environ):
        return None
    try:
        tracing = Tracing()
    except ImportError as e:
        log.warning("OTLP traces asked for, but %s: pip install 'mlxgw[otel]'; no traces are exported", e)
        return None
    log.info("exporting OTLP traces to %s", next(environ[n] for n in ENDPOINT_VARIABLES if environ.get(n)))
    return tracing


class Tracing:
    """The tracer provider (one OTLP/HTTP exporter, batched) and the spans of a request."""

    def __init__(self, exporter: Any = None) -> None:
        """exporter: where spans go (None: OTLP/HTTP, configured by the environment)."""
        # imported here only: a gateway without the variables never loads the SDK
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from ... import __version__

        name = os.environ.get("OTEL_SERVICE_NAME") or SERVICE_NAME
        resource = Resource.create({"service.name": name, "service.version": __version__})
        # sampler from OTEL_TRACES_SAMPLER; no exit hook: the SDK's waits up to 30 s (see shutdown)
        self.provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self.processor = BatchSpanProcessor(exporter or OTLPSpanExporter())
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("mlxgw", __version__)
        self.propagator = TraceContextTextMapPropagator()
        self.trace = trace
        self.server, self.internal = trace.SpanKind.SERVER, trace.SpanKind.INTERNAL

    def shutdown(self) -> None:
        """Export what is queued (a stopping gateway's last requests), waiting at most
        STOP_FLUSH_S: an unreachable collector must not hold a stopping gateway. The SDK's
        flush exports in the calling thread, each try bounded only by the exporter's timeout,
        so it runs in a daemon thread of its own, as the SDK's export thread is one."""
        flush = threading.Thread(target=self.processor.force_flush, name="otlp-flush", daemon=True)
        flush.start()
        flush.join(STOP_FLUSH_S)

    def start(self, request: web.Request) -> Any:
        """The request's server span, a child of the client's `traceparent` when it sent one."""
        parent = self.propagator.extract(request.headers)
        return self.tracer.start_span(request.method, context=parent, kind=self.server)

    def context_of(self, span: Any) -> Any:
        return self.trace.set_span_in_context(span)

    def traceparent(self, span: Any) -> str | None:
        """The W3C header of span (what the worker gets); None when it is not sampled."""
        ctx = span.get_span_context()
        if not ctx.trace_flags.sampled:
            return None
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    def parent_of(self, traceparent: str) -> Any:
        """The context a worker's spans continue (the traceparent it was sent and returned)."""
        return self.propagator.extract({"traceparent": traceparent})

    def end(self, span: Any, request: web.Request, route: str, status: int, gen) -> None:
        """Name, attributes and status of the request's span; then its generations' worker spans."""
        try:
            if span.is_recording():
                span.update_name(f"{request.method} {route}")
                span.set_attributes(request_attributes(request, route, status, gen))
                if status >= 500:
                    span.set_status(self.trace.Status(self.trace.StatusCode.ERROR))
            for traced in request.get(TRACED, ()):
                emit_worker_spans(self, span, traced)
        except Exception:  # a trace must never cost a request its answer
            log.exception("recording the trace of %s failed", request.get("rid"))
        finally:
            span.end()


def start_span(request: web.Request) -> tuple[Tracing | None, Any]:
    """(the app's tracing, the request's span): (None, None) when traces are off."""
    tracing = request.app[TRACING]
    if tracing is None:
        return None, None
    span = tracing.start(request)
    request[SPAN] = span
    return tracing, span


def trace_generation(request: web.Request, span: Any, gen) -> None:
    """A generation of a traced request: its worker request carries the span's traceparent
    (the worker returns its times with its last event), and its worker spans are emitted
    when the request ends."""
    req = gen.req
    if not isinstance(req, p.GenerateRequest):
        return  # embeddings, speech and transcriptions: the request's span only
    req.traceparent = request.app[TRACING].traceparent(span)
    if req.traceparent is not None:
        request.setdefault(TRACED, []).append(gen)


def request_attributes(request: web.Request, route: str, status: int, gen) -> dict:
    """The server span's attributes: HTTP's, who asked (the key's name, never the key), and
    the OpenTelemetry GenAI conventions' usage of its generation."""
    key = request.get("key")
    attrs: dict = {
        "http.request.method": request.method,
        "http.route": route,
        "url.path": request.path,
        "http.response.status_code": status,
        "mlxgw.request_id": request.get("rid") or "",
    }
    if key is not None:
        attrs["mlxgw.key"] = key.name
    if request.get("model"):
        attrs["gen_ai.request.model"] = request["model"]
    if status >= 400:
        attrs["error.type"] = str(status)
    if gen is not None:
        attrs.update(usage_attributes(gen))
        if gen.first_token_at is not None:
            attrs["gen_ai.response.time_to_first_chunk"] = round(gen.first_token_at - gen.started, 6)
    return attrs


def usage_attributes(gen) -> dict:
    u = gen.usage
    attrs = {
        "gen_ai.usage.input_tokens": u.prompt_tokens,
        "gen_ai.usage.output_tokens": u.completion_tokens,
        "gen_ai.usage.cache_read.input_tokens": u.cached_tokens,
    }
    if gen.outcome:
        attrs["gen_ai.response.finish_reasons"] = [gen.outcome]
    return attrs


async def tracing_lifecycle(app: web.Application):
    """At stop, the spans still queued are exported."""
    tracing = app[TRACING]
    yield
    if tracing is not None:
        await asyncio.to_thread(tracing.shutdown)
