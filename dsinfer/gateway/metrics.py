"""Prometheus metrics of one gateway app (its own registry, never the process-global one).

Request-side series are observed as requests end; the backend's gauges and per-worker counters
are read from ``Backend.metrics_snapshot()`` at scrape time by a custom collector.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from dsinfer.base.protocol import LoadReport
from dsinfer.base.stages import STAGE_BUCKETS
from dsinfer.gateway.backend import MIGRATION_CAUSES, BackendMetrics

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)

_TTFT = ("dsinfer_time_to_first_token_seconds", "arrival to first token")
_TPOT = ("dsinfer_time_per_output_token_seconds", "mean time between output tokens of a choice")
_E2E = ("dsinfer_e2e_request_latency_seconds", "arrival to last token")


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def _hit_tokens(r: LoadReport) -> int:
    return r.memory_hit_tokens + r.host_hit_tokens + r.disk_hit_tokens


# Each worker's series read from its latest LoadReport: (family, name, help, value).
_PER_WORKER: tuple[
    tuple[type[GaugeMetricFamily | CounterMetricFamily], str, str, Callable[[LoadReport], float]], ...
] = (
    (GaugeMetricFamily, "dsinfer_worker_running_requests", "running on the worker", lambda r: r.num_running),
    (GaugeMetricFamily, "dsinfer_worker_waiting_requests", "queued on the worker", lambda r: r.num_waiting),
    (
        GaugeMetricFamily,
        "dsinfer_kv_cache_usage_ratio",
        "KV pages in use / total",
        lambda r: _ratio(r.kv_pages_used, r.kv_pages_total),
    ),
    (
        CounterMetricFamily,
        "dsinfer_worker_prompt_tokens",
        "prompt tokens admitted",
        lambda r: r.prompt_tokens,
    ),
    (
        GaugeMetricFamily,
        "dsinfer_prefix_cache_hit_rate",
        "cached / prompt tokens since start",
        lambda r: _ratio(_hit_tokens(r), r.prompt_tokens),
    ),
    (CounterMetricFamily, "dsinfer_kv_transfer_bytes", "KV bytes transferred", lambda r: r.transfer_bytes),
    (
        CounterMetricFamily,
        "dsinfer_kv_transfer_seconds",
        "KV transfer wall time",
        lambda r: r.transfer_seconds,
    ),
    (CounterMetricFamily, "dsinfer_kv_transfers", "KV transfers completed", lambda r: r.transfers),
    (
        CounterMetricFamily,
        "dsinfer_spec_decode_draft_tokens",
        "MTP draft tokens verified",
        lambda r: r.mtp_drafts_proposed,
    ),
    (
        CounterMetricFamily,
        "dsinfer_spec_decode_accepted_tokens",
        "MTP draft tokens the target model agreed with",
        lambda r: r.mtp_drafts_accepted,
    ),
    (
        CounterMetricFamily,
        "dsinfer_spec_decode_verifications",
        "sequence-steps that verified MTP drafts",
        lambda r: r.mtp_verifications,
    ),
    (
        GaugeMetricFamily,
        "dsinfer_spec_decode_acceptance_rate",
        "accepted / verified MTP drafts since start",
        lambda r: _ratio(r.mtp_drafts_accepted, r.mtp_drafts_proposed),
    ),
    (
        GaugeMetricFamily,
        "dsinfer_spec_decode_mean_accepted_length",
        "tokens a verification step yields per sequence since start (1 + accepted drafts per "
        "verification; 0 without drafts)",
        lambda r: 1 + _ratio(r.mtp_drafts_accepted, r.mtp_verifications) if r.mtp_verifications else 0.0,
    ),
)

# The KV tiers below each worker's pool, from LoadReport.kv_tiers: (family, name, help, counter).
_PER_TIER: tuple[tuple[type[GaugeMetricFamily | CounterMetricFamily], str, str, str], ...] = (
    (
        CounterMetricFamily,
        "dsinfer_kv_tier_pages_loaded",
        "KV pages copied from the tier into the pool",
        "pages_loaded",
    ),
    (
        CounterMetricFamily,
        "dsinfer_kv_tier_loaded_bytes",
        "bytes copied from the tier into the pool",
        "bytes_loaded",
    ),
    (
        CounterMetricFamily,
        "dsinfer_kv_tier_load_seconds",
        "seconds from asking for a page to its being in the pool, summed over pages",
        "load_seconds",
    ),
    (CounterMetricFamily, "dsinfer_kv_tier_pages_written", "KV pages copied to the tier", "pages_written"),
    (CounterMetricFamily, "dsinfer_kv_tier_evictions", "pages the tier dropped for room", "evictions"),
    (GaugeMetricFamily, "dsinfer_kv_tier_bytes", "bytes the tier holds now", "bytes"),
    (GaugeMetricFamily, "dsinfer_kv_tier_capacity_pages", "KV pages the tier can hold", "capacity_pages"),
)


class BackendCollector(Collector):
    def __init__(self, snapshot: Callable[[], BackendMetrics]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        yield GaugeMetricFamily(
            "dsinfer_backend_ready", "1 when every needed role has a healthy worker", int(snap.ready)
        )
        yield GaugeMetricFamily(
            "dsinfer_queue_length",
            "choices dispatched with no first token yet (bounded by --max-queued-requests)",
            snap.queue_length,
        )
        yield GaugeMetricFamily(
            "dsinfer_in_flight_requests", "worker requests dispatched, not finished", snap.in_flight
        )
        labels = ["worker", "role"]
        healthy = GaugeMetricFamily("dsinfer_worker_healthy", "1 when the worker is healthy", labels=labels)
        families = [kind(name, text, labels=labels) for kind, name, text, _ in _PER_WORKER]
        hits = CounterMetricFamily(
            "dsinfer_prefix_cache_hit_tokens",
            "prompt tokens served from a cache tier",
            labels=[*labels, "tier"],
        )
        tiers = [kind(name, text, labels=[*labels, "tier"]) for kind, name, text, _ in _PER_TIER]
        groups = CounterMetricFamily(
            "dsinfer_kv_transfer_group_bytes",
            "KV bytes transferred, by cache group (latent, indexer; V4: c4, c4_indexer, c128, resume_point)",
            labels=[*labels, "group"],
        )
        for w in snap.workers:
            key, r = [w.worker, w.role], w.report
            healthy.add_metric(key, int(w.healthy))
            for family, (*_, value) in zip(families, _PER_WORKER, strict=True):
                family.add_metric(key, value(r))
            hits.add_metric([*key, "memory"], r.memory_hit_tokens)
            hits.add_metric([*key, "host"], r.host_hit_tokens)
            hits.add_metric([*key, "disk"], r.disk_hit_tokens)
            for tier, counters in r.kv_tiers.items():
                for family, (*_, counter) in zip(tiers, _PER_TIER, strict=True):
                    family.add_metric([*key, tier], counters.get(counter, 0.0))
            for group, n in r.transfer_bytes_by_group.items():
                groups.add_metric([*key, group], n)
        yield healthy
        yield from families
        yield hits
        yield from tiers
        yield groups
        yield from _rank_histograms(snap)
        moves = CounterMetricFamily(
            "dsinfer_choice_migrations",
            "choices moved to another rank, by cause (rank_died, unresponsive, unreachable, drained, "
            "refused) and whether they had streamed tokens (a continuation)",
            labels=["cause", "streaming"],
        )
        for cause in MIGRATION_CAUSES:
            for streaming in (False, True):
                moves.add_metric(
                    [cause, str(streaming).lower()], snap.migrations.moves.get((cause, streaming), 0)
                )
        yield moves
        yield SummaryMetricFamily(
            "dsinfer_migration_recovery_seconds",
            "from a choice's move to its next token on the new rank",
            count_value=snap.migrations.resumed,
            sum_value=snap.migrations.resume_seconds,
        )
        events = CounterMetricFamily(
            "dsinfer_pool_events",
            "pool restarts (pool_restarted), ranks that died while their pool served on (rank_died) "
            "and ranks that rejoined it (rank_rejoined)",
            labels=["pool", "event"],
        )
        for (pool, event), count in sorted(snap.pool_events.items()):
            events.add_metric([pool, event], count)
        yield events


def _rank_histograms(snap: BackendMetrics) -> Iterator[Metric]:
    stages = HistogramMetricFamily(
        "dsinfer_request_stage_seconds",
        "time requests spent in each stage on a rank (prefill.queue, prefill.forward, kv_flush, "
        "kv_transfer; decode.queue, kv_wait, generate; colocated: generate)",
        labels=["worker", "role", "stage"],
    )
    steps = HistogramMetricFamily(
        "dsinfer_step_seconds", "a rank's forward steps (the pool's agreed steps)", labels=["worker", "role"]
    )
    swaps = CounterMetricFamily(
        "dsinfer_eplb_swaps", "expert placements swapped in by online rebalancing", labels=["worker", "role"]
    )
    for w in snap.workers:
        r = w.report
        for stage, counts in sorted(r.stage_counts.items()):
            stages.add_metric([w.worker, w.role, stage], _buckets(counts), r.stage_seconds.get(stage, 0.0))
        if r.step_counts:
            steps.add_metric([w.worker, w.role], _buckets(r.step_counts), r.step_seconds)
        swaps.add_metric([w.worker, w.role], r.eplb_swaps)
    yield from (stages, steps, swaps)


def _buckets(counts: list[int]) -> list[tuple[str, float]]:
    """Counts per bucket of STAGE_BUCKETS (the last past every bound) as Prometheus' cumulative buckets."""
    bounds = [*(f"{b:g}" for b in STAGE_BUCKETS), "+Inf"]
    return list(zip(bounds, itertools.accumulate(counts), strict=True))


class GatewayMetrics:
    def __init__(self, snapshot: Callable[[], BackendMetrics]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "dsinfer_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.http_in_flight = Gauge(
            "dsinfer_http_requests_in_flight", "generation requests being served", registry=r
        )
        self.ttft = Histogram(*_TTFT, buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(*_TPOT, buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram(*_E2E, buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(
            "dsinfer_prompt_tokens", "prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter("dsinfer_generation_tokens", "generated tokens", registry=r)
        self.cached_tokens = Counter(
            "dsinfer_cached_prompt_tokens", "prompt tokens served from a cache", registry=r
        )
        r.register(BackendCollector(snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)
