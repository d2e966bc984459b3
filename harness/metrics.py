"""What a running server says about its workers and what its processes cost.

- The gateway's ``/metrics`` per worker: healthy, running and waiting requests, KV pages in use
  (``dsinfer_kv_cache_usage_ratio``: pages in use / total), prompt tokens admitted, prefix-cache
  hits, KV transfers; the gateway's own queue length and requests in flight. Scraped once, polled
  into time series, or waited on (every worker healthy, every KV page free).
- Processes: CPU seconds (user + system) of a set of pids and of the whole machine, resident
  memory, and RSS sampled over time in a thread (``RssSampler``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

WORKER_SERIES = {
    "dsinfer_worker_healthy": "healthy",
    "dsinfer_worker_running_requests": "running",
    "dsinfer_worker_waiting_requests": "waiting",
    "dsinfer_kv_cache_usage_ratio": "kv",
    "dsinfer_worker_prompt_tokens_total": "prompt_tokens",
    "dsinfer_prefix_cache_hit_tokens_total": "hit_tokens",  # summed over tiers
    "dsinfer_kv_transfer_bytes_total": "transfer_bytes",
    "dsinfer_kv_transfers_total": "transfers",
}
GATEWAY = "gateway"  # the pseudo-worker that holds the gateway's own gauges
GATEWAY_SERIES = {"dsinfer_queue_length": "queue", "dsinfer_in_flight_requests": "in_flight"}

Workers = dict[str, dict[str, Any]]


# /metrics ----------------------------------------------------------------------------------------
def parse_metrics(text: str) -> Workers:
    """worker name -> {"role": ..., series key (``WORKER_SERIES``) -> value} from the gateway's
    Prometheus text; the gateway's queue length and in-flight count under ``GATEWAY``."""
    workers: Workers = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in GATEWAY_SERIES:
                workers.setdefault(GATEWAY, {"role": GATEWAY})[GATEWAY_SERIES[sample.name]] = sample.value
                continue
            key = WORKER_SERIES.get(sample.name)
            worker = sample.labels.get("worker")
            if key is None or worker is None:
                continue
            entry = workers.setdefault(worker, {"role": sample.labels.get("role", "")})
            entry[key] = entry.get(key, 0.0) + sample.value
    return workers


def metric_value(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` (with ``_total`` for a counter) whose labels include
    ``labels``, in Prometheus text."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def series(workers: Workers, key: str) -> dict[str, float]:
    """worker -> the value of one series (``WORKER_SERIES``'s key: "healthy", "kv"...)."""
    return {w: v[key] for w, v in workers.items() if w != GATEWAY and key in v}


def healthy(workers: Workers) -> set[str]:
    return {w for w, v in series(workers, "healthy").items() if v == 1}


def kv_in_use(workers: Workers) -> dict[str, float]:
    """worker -> share of its KV pages in use, for the workers holding any."""
    return {w: v for w, v in series(workers, "kv").items() if v > 0}


def scrape(base_url: str) -> Workers:
    """``parse_metrics`` of ``base_url/metrics`` now."""
    resp = httpx.get(f"{base_url}/metrics", timeout=10)
    resp.raise_for_status()
    return parse_metrics(resp.text)


async def scrape_async(client: httpx.AsyncClient, base_url: str) -> Workers:
    resp = await client.get(f"{base_url}/metrics", timeout=10)
    resp.raise_for_status()
    return parse_metrics(resp.text)


def _until(
    condition: Callable[[], bool], timeout: float, interval: float, failure: Callable[[], str]
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if condition():
                return
        if time.monotonic() >= deadline:
            raise TimeoutError(failure())
        time.sleep(interval)


def wait_workers(base_url: str, workers: set[str], timeout: float, context: Callable[[], str] = str) -> None:
    """Until every worker of ``workers`` is healthy (``context()``: said on a timeout)."""
    _until(
        lambda: workers <= healthy(scrape(base_url)),
        timeout,
        0.5,
        lambda: (
            f"workers {workers - healthy(scrape(base_url))} not healthy after {timeout:.0f} s\n{context()}"
        ),
    )


def wait_kv_free(base_url: str, timeout: float = 20.0) -> None:
    """Until no worker holds a KV page and the gateway has no request in flight."""

    def free() -> bool:
        workers = scrape(base_url)
        return not kv_in_use(workers) and workers.get(GATEWAY, {}).get("in_flight") == 0

    def held() -> str:
        workers = scrape(base_url)
        return f"KV still held: {kv_in_use(workers)}, in flight {workers.get(GATEWAY, {}).get('in_flight')}"

    _until(free, timeout, 0.5, held)


async def wait_healthy_count(client: httpx.AsyncClient, base_url: str, ranks: int, timeout: float) -> None:
    """Until the gateway lists ``ranks`` workers, all healthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            workers = await scrape_async(client, base_url)
            workers.pop(GATEWAY, None)
            if len(workers) == ranks and all(w.get("healthy") == 1 for w in workers.values()):
                return
        await asyncio.sleep(0.5)
    raise TimeoutError(f"{base_url}: not {ranks} healthy workers after {timeout:.0f} s")


async def poll(
    client: httpx.AsyncClient,
    base_url: str,
    interval: float,
    start: float,
    stop: asyncio.Event,
    samples: list[tuple[float, Workers]],
) -> None:
    """(seconds since ``start`` (perf_counter), workers) into ``samples`` every ``interval`` s
    until ``stop`` is set; a failed scrape is a missing sample."""
    while not stop.is_set():
        t = time.perf_counter()
        with contextlib.suppress(httpx.HTTPError):
            samples.append((t - start, await scrape_async(client, base_url)))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=max(0.0, interval - (time.perf_counter() - t)))


# Processes ---------------------------------------------------------------------------------------
def cpu_seconds(pids: Iterable[int]) -> dict[int, float]:
    """User + system CPU seconds of each live process (all its threads)."""
    out = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            times = psutil.Process(pid).cpu_times()
            out[pid] = times.user + times.system
    return out


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return (sum(values[:8]) - idle) / tick, sum(values[:8]) / tick


def rss_mib(pids: Iterable[int]) -> dict[int, float]:
    """Resident memory of each live process, MiB."""
    out = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            out[pid] = psutil.Process(pid).memory_info().rss / 2**20
    return out


def session_pids(sid: int) -> list[int]:
    """The processes of session ``sid`` (a child started in a session of its own, and all it started)."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if entry.name.isdigit() and int(fields[3]) == sid:  # state ppid pgrp session ...
                found.append(int(entry.name))
    return found


@dataclass
class RssSampler:
    """Resident memory of the processes ``pids()`` names (asked anew at each sample, so it follows
    restarts), every ``interval`` s in a thread: ``samples`` of (seconds since start, pid -> MiB),
    and the peak of their sum."""

    pids: Callable[[], Iterable[int]]
    interval: float = 0.25
    samples: list[tuple[float, dict[int, float]]] = field(default_factory=list)
    peak_mib: float = 0.0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss sampler", daemon=True)
        self._start = time.monotonic()

    def _run(self) -> None:
        while not self._stop.is_set():
            sample = rss_mib(self.pids())
            self.samples.append((time.monotonic() - self._start, sample))
            self.peak_mib = max(self.peak_mib, sum(sample.values()))
            self._stop.wait(self.interval)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> RssSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
