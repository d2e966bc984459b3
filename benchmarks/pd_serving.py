"""PD serving: the load balancers against round-robin, and PD against one colocated engine.

One seeded, skewed workload is replayed against three all-in-one ``dsinfer serve`` servers, one
after the other, each started fresh and stopped at the end of its phase:

- ``pd-load``: a prefill pool of 2 ranks and a decode pool of 2 ranks, ``--balancer load``;
- ``pd-round-robin``: the same with ``--balancer round_robin``;
- ``colocated``: one colocated pool of one rank (prefill and decode on the same rank).

Every server runs the built-in tiny model with dummy weights in float32 on the CPU, the same
``--threads-per-rank`` and the same KV budget per rank (``--kv-cache-memory``).

Workload (``--seed``): ``--num-requests`` requests with Poisson arrivals at ``--rate`` req/s.
Prompts are lists of token ids (ids 2..vocab-1, so neither BOS nor EOS) sent as the ``prompt`` of
``/v1/completions``: a fraction ``--prefix-fraction`` starts with one of ``--num-prefixes`` shared
prefixes of ``--prefix-len`` tokens (chosen with Zipf weights 1, 1/2, 1/3, ...: one hot prefix),
followed by a lognormal suffix; the others are lognormal (median ``--prompt-median``, sigma
``--prompt-sigma``) clipped to ``--min-prompt``..``--max-prompt`` tokens. Outputs are uniform in
``--min-output``..``--max-output`` tokens, ``ignore_eos``, temperature 0, streamed (SSE).

Client metrics per request: TTFT = send to the first chunk carrying a choice; TPOT = (last
choice chunk - first) / (completion tokens - 1), tokens from the final usage chunk; E2E = send
to the last choice chunk. Reported: p50/p90/p99, request throughput and output tokens/s over
the measurement window (first send to last response end).

Per-rank load, from the gateway's ``/metrics`` polled every ``--poll-interval`` s during the
window (workers report every 0.5 s, so each sample is up to one heartbeat old):

- prefill ranks: prompt tokens admitted during the window (``dsinfer_worker_prompt_tokens_total``
  delta), the same less prefix-cache hits (the tokens actually computed), and the time average of
  running + waiting requests;
- decode ranks: time averages of ``dsinfer_kv_cache_usage_ratio`` and of running + waiting;
- for each: max/mean across the ranks of the role (1.0 = perfectly even).

Each server is warmed up (``--warmup-requests`` requests of assorted lengths, unrelated to the
workload's prefixes) before the measured requests. Servers run in their own process group and
are always stopped (SIGINT, bounded wait, then SIGKILL of the group and of every process
recorded under it), also on errors and Ctrl-C.

    /work/venv/bin/python benchmarks/pd_serving.py
    # -> benchmarks/results/pd_serving.json and pd_serving.md; server logs under --log-dir
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
VOCAB_SIZE = 4096  # the tiny preset's vocabulary
FIRST_TOKEN_ID = 2  # 0 is BOS and 1 is EOS in the tiny preset: prompts avoid both
T0 = time.monotonic()
CONFIG_NAMES = ("pd-load", "pd-round-robin", "colocated")


def progress(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


# Server configurations -------------------------------------------------------------------------
def topology_flags(name: str) -> list[str]:
    if name == "pd-load":
        return ["--prefill-pool-size", "2", "--decode-pool-size", "2", "--balancer", "load"]
    if name == "pd-round-robin":
        return ["--prefill-pool-size", "2", "--decode-pool-size", "2", "--balancer", "round_robin"]
    if name == "colocated":
        return ["--colocated", "--decode-pools", "1", "--decode-pool-size", "1"]
    raise ValueError(f"unknown configuration {name!r}; choose from {', '.join(CONFIG_NAMES)}")


def engine_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--model",
        "tiny",
        "--load-format",
        "dummy",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--seed",
        "0",
        "--threads-per-rank",
        str(args.threads_per_rank),
        "--kv-cache-memory",
        args.kv_cache_memory,
        "--drain-timeout",
        "5",
    ]


# Server process (own process group; always stopped) --------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stat_fields(pid: int) -> list[str]:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2 :].split()


def _descendants(root: int) -> list[tuple[int, str]]:
    """(pid, start time) of every live process below ``root`` (the ranks live in sessions of
    their own, so the process group does not reach them; the start time guards against reuse)."""
    parents: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = _stat_fields(int(entry.name))
                parents[int(entry.name)] = (int(fields[1]), fields[19])
    found: list[tuple[int, str]] = []
    for pid, (_, started) in parents.items():
        p = pid
        while p in parents and p > 1:
            p = parents[p][0]
            if p == root:
                found.append((pid, started))
                break
    return found


@dataclass
class ServeProcess:
    argv: list[str]
    port: int
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=REPO
            )

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_healthy(self, timeout: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.25)
        raise TimeoutError(f"server not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGINT to the group (the supervisor drains its pools), bounded waits, then SIGKILL of
        the group and of every process recorded below it that is still the same process."""
        proc = self.process
        if proc is None:
            return None
        below = _descendants(proc.pid)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        deadline = time.monotonic() + 5
        for pid, started in below:
            with contextlib.suppress(OSError, IndexError):
                if _stat_fields(pid)[19] == started:
                    os.kill(pid, signal.SIGKILL)
        while time.monotonic() < deadline and any(_alive(pid, started) for pid, started in below):
            time.sleep(0.1)
        return proc.returncode


def _alive(pid: int, started: str) -> bool:
    try:
        fields = _stat_fields(pid)
    except (OSError, IndexError):
        return False
    return fields[19] == started and fields[0] != "Z"


@contextlib.contextmanager
def serve(flags: list[str], log_dir: Path, name: str, startup_timeout: float) -> Iterator[ServeProcess]:
    port = free_port()
    argv = [sys.executable, "-m", "dsinfer.cli.main", "serve", "--port", str(port), *flags]
    server = ServeProcess(argv, port, log_dir / f"pd_serving-{name}.log")
    progress(f"[{name}] starting server: {shlex.join(argv[1:])}")
    started = time.monotonic()
    try:
        server.start()
        server.wait_healthy(startup_timeout)
        progress(f"[{name}] server healthy after {time.monotonic() - started:.1f} s (log {server.log_path})")
        yield server
    finally:
        progress(f"[{name}] stopping server")
        stopping = time.monotonic()
        code = server.stop()
        progress(f"[{name}] server stopped in {time.monotonic() - stopping:.1f} s (exit code {code})")


# Workload --------------------------------------------------------------------------------------
@dataclass
class Item:
    index: int
    arrival: float  # seconds after the first request
    prompt: list[int]
    prefix: int | None  # which shared prefix the prompt starts with
    max_tokens: int


def lognormal_len(rng: np.random.Generator, median: float, sigma: float, low: int, high: int) -> int:
    return int(min(max(round(rng.lognormal(math.log(median), sigma)), low), high))


def random_ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(FIRST_TOKEN_ID, VOCAB_SIZE, size=n).tolist()


def make_workload(args: argparse.Namespace) -> list[Item]:
    rng = np.random.default_rng(args.seed)
    prefixes = [random_ids(rng, args.prefix_len) for _ in range(args.num_prefixes)]
    weights = np.array([1.0 / (k + 1) for k in range(args.num_prefixes)])
    weights /= weights.sum()
    gaps = rng.exponential(1.0 / args.rate, size=args.num_requests)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    items = []
    for i in range(args.num_requests):
        shared = args.num_prefixes > 0 and rng.random() < args.prefix_fraction
        if shared:
            k = int(rng.choice(args.num_prefixes, p=weights))
            high = max(args.min_prompt, args.max_prompt - args.prefix_len)
            suffix = lognormal_len(rng, args.prompt_median, args.prompt_sigma, args.min_prompt, high)
            prompt, prefix = prefixes[k] + random_ids(rng, suffix), k
        else:
            n = lognormal_len(rng, args.prompt_median, args.prompt_sigma, args.min_prompt, args.max_prompt)
            prompt, prefix = random_ids(rng, n), None
        max_tokens = int(rng.integers(args.min_output, args.max_output + 1))
        items.append(Item(i, float(arrivals[i]), prompt, prefix, max_tokens))
    return items


def warmup_items(count: int, seed: int) -> list[Item]:
    """Assorted lengths (short to the longest prompt) so that every shape class is compiled."""
    rng = np.random.default_rng(seed + 1_000_003)
    lengths = [16, 1500, 300, 64, 900, 40, 600, 128]
    return [Item(-1 - i, 0.0, random_ids(rng, lengths[i % len(lengths)]), None, 16) for i in range(count)]


def workload_summary(items: list[Item], args: argparse.Namespace) -> dict[str, Any]:
    lens = np.array([len(it.prompt) for it in items])
    outs = np.array([it.max_tokens for it in items])
    per_prefix = [sum(it.prefix == k for it in items) for k in range(args.num_prefixes)]
    return {
        "num_requests": len(items),
        "arrival_span_s": items[-1].arrival if items else 0.0,
        "prompt_tokens_total": int(lens.sum()),
        "prompt_len": {
            "min": int(lens.min()),
            "p50": float(np.percentile(lens, 50)),
            "mean": float(lens.mean()),
            "p90": float(np.percentile(lens, 90)),
            "p99": float(np.percentile(lens, 99)),
            "max": int(lens.max()),
        },
        "output_tokens_total": int(outs.sum()),
        "output_len_mean": float(outs.mean()),
        "requests_with_shared_prefix": int(sum(per_prefix)),
        "requests_per_prefix": per_prefix,
    }


# Client ----------------------------------------------------------------------------------------
@dataclass
class Result:
    index: int
    prompt_len: int
    prefix: int | None
    max_tokens: int
    sent: float = 0.0  # seconds after the window start
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


async def send_one(client: httpx.AsyncClient, base_url: str, item: Item, start: float) -> Result:
    delay = start + item.arrival - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    res = Result(item.index, len(item.prompt), item.prefix, item.max_tokens)
    body = {
        "model": "tiny",
        "prompt": item.prompt,
        "max_tokens": item.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    res.sent = sent - start
    first = last = None
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return res
                if chunk.get("choices"):
                    first = now if first is None else first
                    last = now
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    if first is None or last is None or usage is None:
        res.error = "stream ended without tokens or usage"
        return res
    res.output_tokens = int(usage.get("completion_tokens", 0))
    res.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    res.ttft = first - sent
    res.e2e = last - sent
    if res.output_tokens > 1:
        res.tpot = (last - first) / (res.output_tokens - 1)
    if res.output_tokens != item.max_tokens:
        res.error = f"got {res.output_tokens} tokens, asked {item.max_tokens} with ignore_eos"
    return res


# Metrics polling -------------------------------------------------------------------------------
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


def parse_metrics(text: str) -> dict[str, dict[str, Any]]:
    """worker name -> {"role": ..., series key -> value} from the gateway's Prometheus text."""
    workers: dict[str, dict[str, Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = WORKER_SERIES.get(sample.name)
            worker = sample.labels.get("worker")
            if key is None or worker is None:
                continue
            entry = workers.setdefault(worker, {"role": sample.labels.get("role", "")})
            entry[key] = entry.get(key, 0.0) + sample.value
    return workers


async def fetch_metrics(client: httpx.AsyncClient, base_url: str) -> dict[str, dict[str, Any]]:
    resp = await client.get(f"{base_url}/metrics", timeout=10)
    resp.raise_for_status()
    return parse_metrics(resp.text)


async def poll_metrics(
    client: httpx.AsyncClient,
    base_url: str,
    interval: float,
    start: float,
    stop: asyncio.Event,
    samples: list[tuple[float, dict[str, dict[str, Any]]]],
) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        with contextlib.suppress(httpx.HTTPError):
            samples.append((t - start, await fetch_metrics(client, base_url)))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=max(0.0, interval - (time.perf_counter() - t)))


def time_average(points: list[tuple[float, float]], a: float, b: float) -> float | None:
    """Sample-and-hold average of (t, value) points over [a, b] (time covered by samples only)."""
    total = covered = 0.0
    for i, (t, v) in enumerate(points):
        end = min(points[i + 1][0] if i + 1 < len(points) else b, b)
        begin = max(t, a)
        if end > begin:
            total += v * (end - begin)
            covered += end - begin
    return total / covered if covered > 0 else None


def max_over_mean(values: list[float]) -> float | None:
    if not values:
        return None
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else None


# One phase -------------------------------------------------------------------------------------
def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    arr = np.array(values)
    return {
        "p50": float(np.percentile(arr, 50)),
        "p90": float(np.percentile(arr, 90)),
        "p99": float(np.percentile(arr, 99)),
        "mean": float(arr.mean()),
    }


async def run_phase(
    name: str, server: ServeProcess, items: list[Item], args: argparse.Namespace
) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=len(items) + 16, max_keepalive_connections=len(items) + 16)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with (
        httpx.AsyncClient(limits=limits, timeout=timeout) as client,
        httpx.AsyncClient(timeout=10.0) as poller,
    ):
        # Warm-up: two waves, so that every rank of a pool sees prompts of several shapes.
        warm = warmup_items(args.warmup_requests, args.seed)
        started = time.perf_counter()
        half = (len(warm) + 1) // 2
        warm_results: list[Result] = []
        for wave in (warm[:half], warm[half:]):
            warm_results += await asyncio.gather(*(send_one(client, server.base_url, it, 0.0) for it in wave))
        warm_errors = [r.error for r in warm_results if r.error]
        progress(
            f"[{name}] warm-up: {len(warm)} requests in {time.perf_counter() - started:.1f} s"
            f" ({len(warm_errors)} failed{': ' + warm_errors[0] if warm_errors else ''})"
        )
        await asyncio.sleep(1.2)  # let every rank's next heartbeat carry the warm-up's counters
        before = await fetch_metrics(poller, server.base_url)

        start = time.perf_counter()
        load_start = os.getloadavg()
        samples: list[tuple[float, dict[str, dict[str, Any]]]] = []
        stop = asyncio.Event()
        poll_task = asyncio.create_task(
            poll_metrics(poller, server.base_url, args.poll_interval, start, stop, samples)
        )
        tasks = [asyncio.create_task(send_one(client, server.base_url, it, start)) for it in items]
        progress(f"[{name}] measuring: {len(items)} requests at {args.rate} req/s")
        next_report = start + args.progress_interval
        while not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=0.25)
            now = time.perf_counter()
            if now >= next_report:
                sent = sum(start + it.arrival <= now for it in items)
                done = [t.result() for t in tasks if t.done()]
                failed = sum(r.error is not None for r in done)
                progress(f"[{name}] t={now - start:5.1f}s sent {sent}/{len(items)} done {len(done)} failed {failed}")
                next_report += args.progress_interval
        results = [t.result() for t in tasks]
        stop.set()
        await poll_task
        load_end = os.getloadavg()
        await asyncio.sleep(1.2)
        after = await fetch_metrics(poller, server.base_url)

    ok = [r for r in results if r.error is None]
    window_end = max((r.sent + r.e2e for r in results if r.e2e is not None), default=0.0)
    duration = window_end
    out_tokens = sum(r.output_tokens for r in ok)
    progress(
        f"[{name}] done: {len(ok)}/{len(results)} ok in {duration:.1f} s,"
        f" {out_tokens / duration if duration else 0:.0f} output tok/s"
    )
    return {
        "name": name,
        "server_command": shlex.join(server.argv[1:]),
        "warmup_errors": warm_errors,
        "load_avg_during": {"start": list(load_start), "end": list(load_end)},
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:10],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else None,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / duration if duration else None,
        "input_tok_s": sum(r.prompt_len for r in ok) / duration if duration else None,
        "cached_prompt_tokens_client": sum(r.cached_tokens for r in ok),
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "e2e_s": percentiles([r.e2e for r in ok if r.e2e is not None]),
        "load": rank_load(before, after, samples, 0.0, window_end),
        "requests": [asdict(r) for r in results],
        "metric_samples": [
            {
                "t": round(t, 3),
                "workers": {
                    w: [v.get("running", 0), v.get("waiting", 0), round(v.get("kv", 0.0), 5)]
                    for w, v in snap.items()
                },
            }
            for t, snap in samples
        ],
    }


def rank_load(
    before: dict[str, dict[str, Any]],
    after: dict[str, dict[str, Any]],
    samples: list[tuple[float, dict[str, dict[str, Any]]]],
    a: float,
    b: float,
) -> dict[str, Any]:
    per_rank: dict[str, dict[str, Any]] = {}
    for worker in sorted(after):
        end, begin = after[worker], before.get(worker, {})
        queue = [(t, s[worker].get("running", 0) + s[worker].get("waiting", 0)) for t, s in samples if worker in s]
        kv = [(t, s[worker].get("kv", 0.0)) for t, s in samples if worker in s]
        prompt = end.get("prompt_tokens", 0) - begin.get("prompt_tokens", 0)
        hits = end.get("hit_tokens", 0) - begin.get("hit_tokens", 0)
        per_rank[worker] = {
            "role": end["role"],
            "prompt_tokens": prompt,
            "prefix_hit_tokens": hits,
            "computed_prompt_tokens": prompt - hits,
            "transfers": end.get("transfers", 0) - begin.get("transfers", 0),
            "transfer_bytes": end.get("transfer_bytes", 0) - begin.get("transfer_bytes", 0),
            "avg_running_waiting": time_average(queue, a, b),
            "avg_kv_usage": time_average(kv, a, b),
            "peak_kv_usage": max((v for _, v in kv), default=None),
            "samples": len(queue),
        }
    roles: dict[str, dict[str, Any]] = {}
    for role in sorted({r["role"] for r in per_rank.values()}):
        ranks = [r for r in per_rank.values() if r["role"] == role]

        def ratio(key: str, ranks: list[dict[str, Any]] = ranks) -> float | None:
            values = [r[key] for r in ranks]
            return None if any(v is None for v in values) else max_over_mean(values)

        roles[role] = {
            "ranks": len(ranks),
            "prompt_tokens_max_over_mean": ratio("prompt_tokens"),
            "computed_prompt_tokens_max_over_mean": ratio("computed_prompt_tokens"),
            "avg_running_waiting_max_over_mean": ratio("avg_running_waiting"),
            "avg_kv_usage_max_over_mean": ratio("avg_kv_usage"),
            "prefix_hit_rate": (
                sum(r["prefix_hit_tokens"] for r in ranks) / sum(r["prompt_tokens"] for r in ranks)
                if sum(r["prompt_tokens"] for r in ranks)
                else None
            ),
        }
    return {"per_rank": per_rank, "per_role": roles}


# Machine and report ----------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"online_cpus": os.cpu_count(), "python": platform.python_version()}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        info["cpu_model"] = fields.get("Model name", "").strip()
        info["cores_per_socket"] = fields.get("Core(s) per socket", "").strip()
        info["threads_per_core"] = fields.get("Thread(s) per core", "").strip()
    with contextlib.suppress(OSError, ValueError):
        mem = Path("/proc/meminfo").read_text().split("\n")[0].split()
        info["mem_total_gib"] = round(int(mem[1]) / (1 << 20), 1)
    info["kernel"] = platform.release()
    return info


def git_commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}{' (uncommitted changes)' if dirty else ''}"


def fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:,.{digits}f}"


def markdown(report: dict[str, Any]) -> str:
    m, cfg, wl = report["machine"], report["config"], report["workload"]
    lines = [
        "# PD serving: load balancers vs round-robin, PD vs one colocated engine",
        "",
        f"- Machine: {m.get('cpu_model', '?')}, {m['online_cpus']} cores, {m.get('mem_total_gib', '?')} GiB;"
        f" load average {report['load_avg_start'][0]:.2f} at start, {report['load_avg_end'][0]:.2f} at end"
        " (shared machine: expect noise)",
        f"- dsinfer {report['git_commit']}; date {report['date']}",
        f"- Command: `{report['command']}`",
        f"- Servers: tiny preset, dummy weights, float32, CPU, {cfg['threads_per_rank']} thread(s) per rank,"
        f" KV {cfg['kv_cache_memory']} per rank, default chunking; PD = prefill pool of 2 ranks + decode pool"
        " of 2 ranks; colocated = one rank",
        f"- Workload (seed {cfg['seed']}): {wl['num_requests']} requests, Poisson {cfg['rate']} req/s"
        f" (arrivals over {wl['arrival_span_s']:.1f} s); prompts {wl['prompt_len']['min']}..{wl['prompt_len']['max']}"
        f" tokens (p50 {wl['prompt_len']['p50']:.0f}, mean {wl['prompt_len']['mean']:.0f},"
        f" p90 {wl['prompt_len']['p90']:.0f}); {wl['requests_with_shared_prefix']} start with one of"
        f" {cfg['num_prefixes']} shared {cfg['prefix_len']}-token prefixes (requests per prefix:"
        f" {', '.join(map(str, wl['requests_per_prefix']))}); outputs {cfg['min_output']}..{cfg['max_output']}"
        f" tokens (mean {wl['output_len_mean']:.0f}), ignore_eos, temperature 0",
        "",
        "## Latency and throughput",
        "",
        "| server | ok / failed | req/s | output tok/s | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms)"
        " | E2E p50 / p99 (s) |",
        "|---|---|---:|---:|---|---|---|",
    ]
    for p in report["phases"]:
        t, o, e = p["ttft_s"], p["tpot_s"], p["e2e_s"]
        lines.append(
            f"| {p['name']} | {p['completed']} / {p['failed']} | {fmt(p['request_throughput'])}"
            f" | {fmt(p['output_tok_s'], digits=0)}"
            f" | {fmt(t['p50'], 1e3, 0)} / {fmt(t['p90'], 1e3, 0)} / {fmt(t['p99'], 1e3, 0)}"
            f" | {fmt(o['p50'], 1e3, 1)} / {fmt(o['p90'], 1e3, 1)} / {fmt(o['p99'], 1e3, 1)}"
            f" | {fmt(e['p50'])} / {fmt(e['p99'])} |"
        )
    lines += [
        "",
        "## Per-rank load balance (max/mean across the ranks of a role; 1.00 = even)",
        "",
        "| server | role | prompt tokens | computed prompt tokens | avg running+waiting | avg KV usage"
        " | prefix hit rate |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for p in report["phases"]:
        for role, r in p["load"]["per_role"].items():
            if r["ranks"] < 2:
                continue
            lines.append(
                f"| {p['name']} | {role} | {fmt(r['prompt_tokens_max_over_mean'])}"
                f" | {fmt(r['computed_prompt_tokens_max_over_mean'])}"
                f" | {fmt(r['avg_running_waiting_max_over_mean'])} | {fmt(r['avg_kv_usage_max_over_mean'])}"
                f" | {fmt(r['prefix_hit_rate'], 100, 1)}% |"
            )
    lines += [
        "",
        "## Per rank (measurement window)",
        "",
        "| server | worker | prompt tokens | prefix-hit tokens | computed | avg running+waiting | avg KV usage"
        " | peak KV usage |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in report["phases"]:
        for worker, r in p["load"]["per_rank"].items():
            lines.append(
                f"| {p['name']} | {worker} | {r['prompt_tokens']:,.0f} | {r['prefix_hit_tokens']:,.0f}"
                f" | {r['computed_prompt_tokens']:,.0f} | {fmt(r['avg_running_waiting'])}"
                f" | {fmt(r['avg_kv_usage'], 100, 1)}% | {fmt(r['peak_kv_usage'], 100, 1)}% |"
            )
    lines += [
        "",
        "TTFT = send to the first streamed chunk with a choice; TPOT = (last - first chunk) / (tokens - 1);"
        " throughput over first send to last response end. Prompt tokens = admitted by the rank during"
        " the window (`dsinfer_worker_prompt_tokens_total`); computed = less prefix-cache hits. Averages"
        " are sample-and-hold over the gateway's `/metrics`, polled every"
        f" {cfg['poll_interval']} s (workers report every 0.5 s).",
        "",
    ]
    return "\n".join(lines)


# Main ------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--configs", default=",".join(CONFIG_NAMES), help="servers to run, in this order")
    p.add_argument("--num-requests", type=int, default=160, help="measured requests per server")
    p.add_argument("--rate", type=float, default=2.0, help="Poisson arrival rate, requests/s")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload")
    p.add_argument("--prompt-median", type=float, default=200.0, help="median of the lognormal lengths")
    p.add_argument("--prompt-sigma", type=float, default=1.0, help="sigma of the lognormal lengths")
    p.add_argument("--min-prompt", type=int, default=16, help="shortest prompt (or suffix), tokens")
    p.add_argument("--max-prompt", type=int, default=1500, help="longest prompt, tokens")
    p.add_argument("--num-prefixes", type=int, default=4, help="shared prefixes (Zipf popularity)")
    p.add_argument("--prefix-len", type=int, default=512, help="tokens per shared prefix")
    p.add_argument("--prefix-fraction", type=float, default=0.33, help="share of requests with a prefix")
    p.add_argument("--min-output", type=int, default=16, help="fewest output tokens")
    p.add_argument("--max-output", type=int, default=128, help="most output tokens")
    p.add_argument("--threads-per-rank", type=int, default=1, help="torch threads per rank")
    p.add_argument("--kv-cache-memory", default="256MiB", help="KV cache per rank")
    p.add_argument("--warmup-requests", type=int, default=8, help="warm-up requests per server")
    p.add_argument("--poll-interval", type=float, default=0.25, help="seconds between /metrics polls")
    p.add_argument("--progress-interval", type=float, default=5.0, help="seconds between progress lines")
    p.add_argument("--request-timeout", type=float, default=300.0, help="client timeout per request, s")
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds for a server to get healthy")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/pd_serving_logs"), help="server logs")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/pd_serving.json", help="JSON results")
    p.add_argument(
        "--markdown", type=Path, default=REPO / "benchmarks/results/pd_serving.md", help="markdown tables"
    )
    args = p.parse_args(argv)
    for name in args.configs.split(","):
        topology_flags(name)
    if not 0 < args.min_prompt <= args.max_prompt or args.prefix_len >= args.max_prompt:
        p.error("need 0 < --min-prompt <= --max-prompt and --prefix-len < --max-prompt")
    if not 1 <= args.min_output <= args.max_output:
        p.error("need 1 <= --min-output <= --max-output")
    return args


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # stop the servers on SIGTERM too
    args.log_dir.mkdir(parents=True, exist_ok=True)
    items = make_workload(args)
    report: dict[str, Any] = {
        "benchmark": "pd_serving",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": shlex.join([Path(sys.executable).as_posix(), *sys.argv]),
        "git_commit": git_commit(),
        "machine": machine_info(),
        "load_avg_start": list(os.getloadavg()),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "engine_flags": engine_flags(args),
        "workload": workload_summary(items, args),
        "phases": [],
    }
    wl = report["workload"]
    progress(
        f"workload: {wl['num_requests']} requests over {wl['arrival_span_s']:.1f} s, prompt tokens p50"
        f" {wl['prompt_len']['p50']:.0f} mean {wl['prompt_len']['mean']:.0f} max {wl['prompt_len']['max']},"
        f" {wl['requests_with_shared_prefix']} with a shared prefix {wl['requests_per_prefix']};"
        f" load average {report['load_avg_start'][0]:.2f}"
    )
    for name in args.configs.split(","):
        flags = [*topology_flags(name), *engine_flags(args)]
        with serve(flags, args.log_dir, name, args.startup_timeout) as server:
            report["phases"].append(asyncio.run(run_phase(name, server, items, args)))
    report["load_avg_end"] = list(os.getloadavg())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    args.markdown.write_text(markdown(report))
    progress(f"wrote {args.out} and {args.markdown}; load average {report['load_avg_end'][0]:.2f}")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
