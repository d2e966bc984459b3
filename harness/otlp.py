"""An OTLP/HTTP trace receiver on a free port (what a collector does, for tests and benchmarks):
it accepts ``POST /v1/traces`` (protobuf ExportTraceServiceRequest) and keeps every span as a
plain ``ReceivedSpan``; ``keep=False`` counts them only (a sink for the tracing-cost benchmark)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from dsinfer.base.processes import free_port


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root
    start: float  # seconds since the epoch
    end: float
    attributes: dict[str, Any] = field(default_factory=dict)
    events: tuple[str, ...] = ()
    error: bool = False


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def decode_spans(body: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope in resource_spans.scope_spans:
            for s in scope.spans:
                spans.append(
                    ReceivedSpan(
                        service=str(resource.get("service.name", "")),
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        start=s.start_time_unix_nano / 1e9,
                        end=s.end_time_unix_nano / 1e9,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        events=tuple(e.name for e in s.events),
                        error=s.status.code == s.status.STATUS_CODE_ERROR,
                    )
                )
    return spans


class TraceReceiver:
    def __init__(self, keep: bool = True) -> None:
        self.keep = keep
        self.spans: list[ReceivedSpan] = []
        self.count = 0
        self._lock = threading.Lock()
        self.port = free_port()
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                receiver.add(decode_spans(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler

    def add(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self.count += len(spans)
            if self.keep:
                self.spans.extend(spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(
        self, trace_id: str, services: set[str], timeout: float, names: frozenset[str] = frozenset()
    ) -> list[ReceivedSpan]:
        """The trace's spans once every one of ``services`` sent some and every span of ``names``
        arrived (a parent ends, and is exported, after its children; at most ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            spans = self.trace(trace_id)
            if services <= {s.service for s in spans} and names <= {s.name for s in spans}:
                return spans
            time.sleep(0.2)
        return self.trace(trace_id)


@contextmanager
def trace_receiver(keep: bool = True) -> Iterator[TraceReceiver]:
    receiver = TraceReceiver(keep)
    receiver._thread.start()
    try:
        yield receiver
    finally:
        receiver._server.shutdown()
        receiver._server.server_close()
