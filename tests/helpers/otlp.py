"""A real OTLP/HTTP trace receiver for tests: an HTTP server that decodes what exporters POST
to /v1/traces with the official `opentelemetry-proto` messages, and keeps the spans."""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class Span:
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root span
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    start: int  # ns
    end: int
    attributes: dict
    status_code: int
    service: str


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _span(service: str, s) -> Span:
    return Span(
        name=s.name,
        trace_id=s.trace_id.hex(),
        span_id=s.span_id.hex(),
        parent_id=s.parent_span_id.hex(),
        kind=s.kind,
        start=s.start_time_unix_nano,
        end=s.end_time_unix_nano,
        attributes={kv.key: _value(kv.value) for kv in s.attributes},
        status_code=s.status.code,
        service=service,
    )


class OtlpReceiver:
    def __init__(self, port: int = 0):
        self.spans: list[Span] = []
        self.posts: list[dict] = []  # each POST's path and headers
        lock = self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                msg = ExportTraceServiceRequest()
                msg.ParseFromString(body)
                with lock:
                    receiver.posts.append(
                        {"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}}
                    )
                    for rs in msg.resource_spans:
                        attrs = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
                        for ss in rs.scope_spans:
                            receiver.spans.extend(_span(attrs.get("service.name", ""), s) for s in ss.spans)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, predicate, timeout: float = 20) -> list[Span]:
        """The spans once predicate(spans) holds (exporters batch: they arrive a little later)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
