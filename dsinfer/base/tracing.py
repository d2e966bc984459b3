"""Distributed tracing over OpenTelemetry (the optional ``tracing`` extra): one trace per client
request, spans from the gateway and every rank that works on it, exported over OTLP/HTTP.

Processes pass a span on as its W3C ``traceparent`` (the client's header, then the gateway's
spans' in ``WorkerRequest.traceparent``). Ranks record a request's spans when its work there ends,
with the instants it kept (``record``): nothing is held open across steps. With no endpoint the
tracer is off: ``record`` and ``open`` return at once, and OpenTelemetry is never imported.

Instants are ``time.time()`` seconds: spans of different processes share one clock.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Attributes = Mapping[str, str | int | float | bool]
OTLP_TRACES_PATH = "/v1/traces"


@dataclass(frozen=True)
class Interval:
    """A finished child span: ``name`` from ``start`` to ``end`` (time.time() seconds)."""

    name: str
    start: float
    end: float
    attributes: Attributes = field(default_factory=dict)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def endpoint_problem(endpoint: str) -> str | None:
    """Why ``--otlp-traces-endpoint`` cannot work here, or None."""
    if not endpoint.startswith(("http://", "https://")):
        return f"--otlp-traces-endpoint must be an http:// or https:// URL (OTLP/HTTP), got {endpoint!r}"
    try:
        import opentelemetry.exporter.otlp.proto.http
        import opentelemetry.sdk  # noqa: F401
    except ImportError as e:
        return f"--otlp-traces-endpoint needs OpenTelemetry ({e}): pip install 'dsinfer[tracing]'"
    return None


def traces_url(endpoint: str) -> str:
    """``--otlp-traces-endpoint`` as the exporter's URL: a collector's base URL gets /v1/traces."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith(OTLP_TRACES_PATH) else endpoint + OTLP_TRACES_PATH


class OpenSpan:
    """A span that runs while the code that opened it waits (the gateway's request and attempt
    spans); ending it twice ends it once."""

    def __init__(self, span: Any = None, traceparent: str = "") -> None:
        self._span, self.traceparent = span, traceparent

    def event(self, name: str, attributes: Attributes | None = None) -> None:
        if self._span is not None:
            self._span.add_event(name, dict(attributes or {}))

    def set(self, attributes: Attributes) -> None:
        if self._span is not None:
            self._span.set_attributes(dict(attributes))

    def end(self, error: str | None = None, at: float | None = None) -> None:
        span, self._span = self._span, None
        if span is None:
            return
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=None if at is None else _ns(at))


NO_SPAN = OpenSpan()


class Tracer:
    """One process's tracer: ``service`` (dsinfer-gateway, dsinfer-prefill...) names it in the
    trace; ``endpoint`` None: off."""

    def __init__(self, service: str, endpoint: str | None, attributes: Attributes | None = None) -> None:
        self.enabled = endpoint is not None
        self._provider: Any = None
        if endpoint is None:
            return
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create({"service.name": service, **(attributes or {})})
        # its own provider, not the process-global one: a library in the process keeps its own
        self._provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        exporter = OTLPSpanExporter(endpoint=traces_url(endpoint), timeout=5)
        self._provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
        self._tracer = self._provider.get_tracer("dsinfer")
        self._propagator = TraceContextTextMapPropagator()

    def open(
        self,
        name: str,
        parent: str = "",
        attributes: Attributes | None = None,
        start: float | None = None,
        server: bool = False,
    ) -> OpenSpan:
        """A running span under ``parent`` (a traceparent; "" starts a trace); end it yourself.
        ``server``: the span of an incoming request (OpenTelemetry's SERVER kind)."""
        if not self.enabled:
            return NO_SPAN
        span = self._start(name, parent, attributes, start, server)
        return OpenSpan(span, self._traceparent(span))

    def record(
        self,
        name: str,
        parent: str,
        start: float,
        end: float | None = None,
        attributes: Attributes | None = None,
        children: Sequence[Interval] = (),
        error: str | None = None,
    ) -> None:
        """A finished span from ``start`` to ``end`` (default now) under ``parent``, with its
        ``children``. Nothing when off or when ``parent`` is "" (the request is not traced)."""
        if not self.enabled or not parent:
            return
        span = self._start(name, parent, attributes, start)
        child_parent = self._traceparent(span)
        for child in children:
            if child.end >= child.start > 0:
                self.record(child.name, child_parent, child.start, child.end, child.attributes)
        OpenSpan(span).end(error, time.time() if end is None else end)

    def close(self) -> None:
        """Export what is left and stop (at the process's end)."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None
            self.enabled = False

    def _start(
        self, name: str, parent: str, attributes: Attributes | None, start: float | None, server: bool = False
    ) -> Any:
        from opentelemetry.trace import SpanKind

        context = self._propagator.extract({"traceparent": parent}) if parent else None
        return self._tracer.start_span(
            name,
            context=context,
            kind=SpanKind.SERVER if server else SpanKind.INTERNAL,
            attributes=dict(attributes or {}),
            start_time=None if start is None else _ns(start),
        )

    def _traceparent(self, span: Any) -> str:
        from opentelemetry.trace import set_span_in_context

        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=set_span_in_context(span))
        return carrier.get("traceparent", "")
