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

from dsinfer.base.stages import STAGE_BUCKETS
from dsinfer.gateway.backend import MIGRATION_CAUSES, BackendMetrics

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


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
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "healthy": GaugeMetricFamily(
                "dsinfer_worker_healthy", "1 when the worker is healthy", labels=labels
            ),
            "running": GaugeMetricFamily(
                "dsinfer_worker_running_requests", "running on the worker", labels=labels
            ),
            "waiting": GaugeMetricFamily(
                "dsinfer_worker_waiting_requests", "queued on the worker", labels=labels
            ),
            "kv": GaugeMetricFamily("dsinfer_kv_cache_usage_ratio", "KV pages in use / total", labels=labels),
            "prompt": CounterMetricFamily(
                "dsinfer_worker_prompt_tokens", "prompt tokens admitted", labels=labels
            ),
            "hits": CounterMetricFamily(
                "dsinfer_prefix_cache_hit_tokens",
                "prompt tokens served from a cache tier",
                labels=[*labels, "tier"],
            ),
            "hit_rate": GaugeMetricFamily(
                "dsinfer_prefix_cache_hit_rate", "cached / prompt tokens since start", labels=labels
            ),
            "bytes": CounterMetricFamily("dsinfer_kv_transfer_bytes", "KV bytes transferred", labels=labels),
            "seconds": CounterMetricFamily(
                "dsinfer_kv_transfer_seconds", "KV transfer wall time", labels=labels
            ),
            "transfers": CounterMetricFamily("dsinfer_kv_transfers", "KV transfers completed", labels=labels),
            "drafts": CounterMetricFamily(
                "dsinfer_spec_decode_draft_tokens", "MTP draft tokens verified", labels=labels
            ),
            "accepted": CounterMetricFamily(
                "dsinfer_spec_decode_accepted_tokens",
                "MTP draft tokens the target model agreed with",
                labels=labels,
            ),
            "acceptance": GaugeMetricFamily(
                "dsinfer_spec_decode_acceptance_rate",
                "accepted / verified MTP drafts since start",
                labels=labels,
            ),
        }
        for w in snap.workers:
            key, r = [w.worker, w.role], w.report
            families["healthy"].add_metric(key, int(w.healthy))
            families["running"].add_metric(key, r.num_running)
            families["waiting"].add_metric(key, r.num_waiting)
            families["kv"].add_metric(key, r.kv_pages_used / r.kv_pages_total if r.kv_pages_total else 0.0)
            families["prompt"].add_metric(key, r.prompt_tokens)
            families["hits"].add_metric([*key, "memory"], r.memory_hit_tokens)
            families["hits"].add_metric([*key, "host"], r.host_hit_tokens)
            families["hits"].add_metric([*key, "disk"], r.disk_hit_tokens)
            hits = r.memory_hit_tokens + r.host_hit_tokens + r.disk_hit_tokens
            families["hit_rate"].add_metric(key, hits / r.prompt_tokens if r.prompt_tokens else 0.0)
            families["bytes"].add_metric(key, r.transfer_bytes)
            families["seconds"].add_metric(key, r.transfer_seconds)
            families["transfers"].add_metric(key, r.transfers)
            families["drafts"].add_metric(key, r.mtp_drafts_proposed)
            families["accepted"].add_metric(key, r.mtp_drafts_accepted)
            rate = r.mtp_drafts_accepted / r.mtp_drafts_proposed if r.mtp_drafts_proposed else 0.0
            families["acceptance"].add_metric(key, rate)
        yield from families.values()
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
        self.ttft = Histogram(
            "dsinfer_time_to_first_token_seconds",
            "arrival to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "dsinfer_time_per_output_token_seconds",
            "mean time between output tokens of a choice",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "dsinfer_e2e_request_latency_seconds",
            "arrival to last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
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
