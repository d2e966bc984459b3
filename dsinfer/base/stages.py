"""What a rank measures of each request it works on: consecutive stages (``prefill.queue``,
``prefill.forward``, ``kv_flush``; ``decode.queue``, ``kv_wait``, ``generate``...), each ended
by the next ``mark``. Every stage's duration goes into a histogram (``StageHistogram``, sent in
the rank's load reports and exported by the gateway as ``dsinfer_request_stage_seconds``);
a traced request's (tracing on and a traceparent) become the children of its span on the rank,
recorded when the request's work there ends (dsinfer/base/tracing.py)."""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from dsinfer.base.tracing import Attributes, Interval, Tracer

# upper bounds (seconds) of the stage histograms' buckets; +Inf is the count
STAGE_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


@dataclass
class StageHistogram:
    """Per stage since start: counts per bucket of ``STAGE_BUCKETS`` (not cumulative; the last
    one past every bound) and the sum of the seconds."""

    counts: dict[str, list[int]] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=dict)

    def observe(self, stage: str, seconds: float) -> None:
        counts = self.counts.setdefault(stage, [0] * (len(STAGE_BUCKETS) + 1))
        counts[bisect.bisect_left(STAGE_BUCKETS, seconds)] += 1
        self.sums[stage] = self.sums.get(stage, 0.0) + seconds


@dataclass
class _Open:
    traceparent: str  # "" when not traced
    start: float
    children: list[Interval]
    current: str  # the stage running since ``since``
    since: float


class RequestStages:
    """A rank's requests in flight, by id: their stages, measured always, traced when asked.
    ``name``: each traced request's span here (the role)."""

    def __init__(self, tracer: Tracer, name: str, attributes: Attributes | None = None) -> None:
        self.tracer, self.name, self.attributes = tracer, name, dict(attributes or {})
        self.histogram = StageHistogram()
        self._open: dict[str, _Open] = {}

    def start(self, request_id: str, traceparent: str, stage: str) -> None:
        now = time.time()
        traced = traceparent if self.tracer.enabled else ""
        self._open[request_id] = _Open(traced, now, [], stage, now)

    def mark(self, request_id: str, stage: str) -> None:
        """The request's current stage ends now and ``stage`` begins."""
        request = self._open.get(request_id)
        if request is not None and request.current != stage:
            now = time.time()
            self._close_stage(request, now)
            request.current, request.since = stage, now

    def end(
        self, request_id: str, error: str | None = None, finish: str = "", extra: Sequence[Interval] = ()
    ) -> None:
        """The request's work here ends (``extra``: intervals beside its stages, measured too)."""
        request = self._open.pop(request_id, None)
        if request is None:
            return
        now = time.time()
        self._close_stage(request, now)
        for interval in extra:
            self.histogram.observe(interval.name, interval.end - interval.start)
        if request.traceparent:
            attributes = {**self.attributes, "dsinfer.request_id": request_id, "dsinfer.finish": finish}
            children = [*request.children, *extra]
            self.tracer.record(
                self.name, request.traceparent, request.start, now, attributes, children, error
            )

    def __len__(self) -> int:
        return len(self._open)

    def _close_stage(self, request: _Open, now: float) -> None:
        self.histogram.observe(request.current, now - request.since)
        if request.traceparent:
            request.children.append(Interval(request.current, request.since, now))
