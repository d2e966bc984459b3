r"""PD serving: the load balancers against round-robin, and PD against one colocated engine.

One seeded workload is replayed against three all-in-one ``dsinfer serve`` servers, one after the
other, each started fresh and stopped at the end of its phase:

- ``pd-load``: a prefill pool of 2 ranks and a decode pool of 2 ranks, ``--balancer load``;
- ``pd-round-robin``: the same with ``--balancer round_robin``;
- ``colocated``: one colocated pool of one rank (prefill and decode on the same rank).

Every server runs the built-in tiny model with dummy weights in float32 on the CPU, the same
``--threads-per-rank`` and the same KV budget per rank (``--kv-cache-memory``).

Workloads (``--workload``), prompts sent as lists of token ids (ids 2..vocab-1, so neither BOS nor
EOS) in the ``prompt`` of ``/v1/completions``, ``ignore_eos``, temperature 0, streamed (SSE):

- ``random`` (default; Poisson arrivals at ``--rate`` req/s): a fraction ``--prefix-fraction``
  starts with one of ``--num-prefixes`` shared prefixes of ``--prefix-len`` tokens (Zipf weights
  1, 1/2, 1/3, ...: one hot prefix), followed by a lognormal suffix; the others are lognormal
  (median ``--prompt-median``, sigma ``--prompt-sigma``) clipped to ``--min-prompt``..``--max-prompt``
  tokens. Outputs are uniform in ``--min-output``..``--max-output`` tokens.
- ``alternating`` (deterministic; fixed gaps of 1 / ``--rate`` s unless ``--arrivals poisson``):
  heavy, light, heavy, light, ... with heavy = ``--heavy-prompt`` prompt / ``--heavy-output``
  output tokens (1200 / 128) and light = ``--light-prompt`` / ``--light-output`` (40 / 16), random
  ids and no shared prefix (the seed picks only the ids). With 2 ranks per role, round-robin sends
  every heavy request to the same prefill rank and the same decode rank.

Client metrics per request: TTFT = send to the first chunk carrying a choice; TPOT = (last
choice chunk - first) / (completion tokens - 1), tokens from the final usage chunk; E2E = send
to the last choice chunk. Reported: p50/p90/p99 (also per request kind), request throughput and
output tokens/s over the measurement window (first send to last response end).

Per-rank load, from the gateway's ``/metrics`` polled every ``--poll-interval`` s during the
window (workers report every 0.5 s, so each sample is up to one heartbeat old):

- prefill ranks: prompt tokens admitted during the window (``dsinfer_worker_prompt_tokens_total``
  delta), the same less prefix-cache hits (the tokens actually computed), and the time averages
  of running + waiting requests and of KV usage (pages of prompts in flight);
- decode ranks: the same totals, and time averages of ``dsinfer_kv_cache_usage_ratio`` and of
  running + waiting;
- for each: max/mean across the ranks of the role (1.0 = perfectly even), and for the time
  series also E[max over ranks] / E[mean over ranks] over the polls (the momentary imbalance).

Also per phase: CPU seconds over the window per rank, for the whole server and for the machine
(/proc), each rank's thread count and OMP/NUMBA thread settings, and counts of the server log's
rank-health lines (missed heartbeats, unreachable, resent, pool down) with the ranks' warm-up times.

Each server is warmed up (rounds of ``--warmup-requests`` requests of assorted lengths, unrelated
to the workload's prefixes, until a round has no failure) before the measured requests.
``--repeats N`` runs every server on N workloads (seeds ``--seed`` .. ``--seed``+N-1), odd repeats
in reverse server order (``--order alternate``) so that drift in the machine's load does not
always favour the same server. Servers run in their own process group and are always stopped
(SIGINT, bounded wait, then SIGKILL of the group and of every process recorded under it), also on
errors, Ctrl-C and SIGTERM.

``--commit REV`` (default HEAD, resolved at start) runs the servers on a clean ``git archive`` of
REV, so that others' edits to the checkout during the run do not leak in; ``--commit worktree``
snapshots the checkout's dsinfer/, kernels/ and configs/ as they are (uncommitted changes
included) and records HEAD + a hash of ``git diff HEAD``; ``--commit checkout`` runs the live
checkout. The results file keeps one run per workload (a run replaces the previous run of its
workload). The runs of record:

    # random workload, at 65fcaa6 (before expert parallelism), numba's pool capped by hand
    /work/venv/bin/python benchmarks/pd_serving.py --commit 65fcaa63c3d3efa551ced3ee8ebbc492d5832d78 \
        --numba-threads 1 --rate 4.5 --repeats 2
    # alternating workload; HEAD a057190 could not start a rank (see benchmarks/README.md)
    /work/venv/bin/python benchmarks/pd_serving.py --commit worktree --workload alternating \
        --num-requests 36 --rate 1.2 --repeats 2
    # -> benchmarks/results/pd_serving.json and pd_serving.md; server logs under --log-dir
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

from harness.clients import Stream, client_for, completion_body, stream_completion
from harness.metrics import (
    GATEWAY,
    GATEWAY_SERIES,
    Workers,
    cpu_seconds,
    machine_cpu,
    poll,
    scrape_async,
    wait_healthy_count,
)
from harness.plots import plot_result
from harness.progress import progress
from harness.provenance import REPO, command_line, export_commit, git_commit, machine_info, utc_now
from harness.results import fmt, percentiles, write_json
from harness.server import TINY_CPU, Server, serve

VOCAB_SIZE = 4096  # the tiny preset's vocabulary
FIRST_TOKEN_ID = 2  # 0 is BOS and 1 is EOS in the tiny preset: prompts avoid both
CONFIG_NAMES = ("pd-load", "pd-round-robin", "colocated")


# Server configurations -------------------------------------------------------------------------
def topology_flags(name: str) -> list[str]:
    if name == "pd-load":
        return ["--prefill-pool-size", "2", "--decode-pool-size", "2", "--balancer", "load"]
    if name == "pd-round-robin":
        return ["--prefill-pool-size", "2", "--decode-pool-size", "2", "--balancer", "round_robin"]
    if name == "colocated":
        return ["--colocated", "--decode-pools", "1", "--decode-pool-size", "1"]
    raise ValueError(f"unknown configuration {name!r}; choose from {', '.join(CONFIG_NAMES)}")


def server_env(args: argparse.Namespace) -> dict[str, str]:
    """Environment the servers get on top of this one's."""
    return {"NUMBA_NUM_THREADS": str(args.numba_threads)} if args.numba_threads else {}


def num_ranks(name: str) -> int:
    return 1 if name == "colocated" else 4


def engine_flags(args: argparse.Namespace) -> list[str]:
    return [
        *TINY_CPU,
        "--threads-per-rank",
        str(args.threads_per_rank),
        "--kv-cache-memory",
        args.kv_cache_memory,
        "--drain-timeout",
        "5",
    ]


# Workload --------------------------------------------------------------------------------------
@dataclass
class Item:
    index: int
    arrival: float  # seconds after the first request
    prompt: list[int]
    prefix: int | None  # which shared prefix the prompt starts with
    max_tokens: int
    kind: str = "random"  # "random", or "heavy" / "light" in the alternating workload


def lognormal_len(rng: np.random.Generator, median: float, sigma: float, low: int, high: int) -> int:
    return int(min(max(round(rng.lognormal(math.log(median), sigma)), low), high))


def random_ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(FIRST_TOKEN_ID, VOCAB_SIZE, size=n).tolist()


def arrival_times(rng: np.random.Generator, args: argparse.Namespace) -> list[float]:
    """Poisson (exponential gaps) or fixed gaps of 1 / ``--rate``, the first at 0."""
    if args.arrivals == "fixed":
        return [i / args.rate for i in range(args.num_requests)]
    gaps = rng.exponential(1.0 / args.rate, size=args.num_requests)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist()


def make_workload(args: argparse.Namespace) -> list[Item]:
    if args.workload == "alternating":
        return make_alternating(args)
    rng = np.random.default_rng(args.seed)
    prefixes = [random_ids(rng, args.prefix_len) for _ in range(args.num_prefixes)]
    weights = np.array([1.0 / (k + 1) for k in range(args.num_prefixes)])
    weights /= weights.sum()
    arrivals = arrival_times(rng, args)
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


def make_alternating(args: argparse.Namespace) -> list[Item]:
    """Heavy, light, heavy, light, ...: even requests have ``--heavy-prompt`` prompt tokens and
    ``--heavy-output`` output tokens, odd ones ``--light-prompt`` and ``--light-output``. Prompts are
    random ids (no shared prefix); the seed only picks the ids (and Poisson gaps, if asked). With
    2 ranks per role, a round-robin balancer sends every heavy request to the same prefill rank and
    the same decode rank (as long as requests reach the gateway in arrival order)."""
    rng = np.random.default_rng(args.seed)
    arrivals = arrival_times(rng, args)
    items = []
    for i in range(args.num_requests):
        heavy = i % 2 == 0
        n = args.heavy_prompt if heavy else args.light_prompt
        out = args.heavy_output if heavy else args.light_output
        items.append(
            Item(i, float(arrivals[i]), random_ids(rng, n), None, out, "heavy" if heavy else "light")
        )
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
    kinds = {kind: sum(it.kind == kind for it in items) for kind in sorted({it.kind for it in items})}
    return {
        "workload": args.workload,
        "arrivals": args.arrivals,
        "rate": args.rate,
        "requests_per_kind": kinds,
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
    kind: str = "random"
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
    res = Result(item.index, len(item.prompt), item.prefix, item.max_tokens, item.kind)
    body = completion_body(item.prompt, item.max_tokens, stream_options={"include_usage": True})
    stream = Stream()
    res.sent = stream.sent - start
    await stream_completion(client, base_url, body, out=stream)
    if stream.error is not None:
        res.error = stream.error
        return res
    if not stream.chunks or stream.usage is None:
        res.error = "stream ended without tokens or usage"
        return res
    res.output_tokens = stream.completion_tokens
    res.cached_tokens = int((stream.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    res.ttft, res.e2e, res.tpot = stream.ttft, stream.e2e, stream.tpot
    if res.output_tokens != item.max_tokens:
        res.error = f"got {res.output_tokens} tokens, asked {item.max_tokens} with ignore_eos"
    return res


# Rank processes and server log -----------------------------------------------------------------
def rank_processes(server: Server) -> list[dict[str, Any]]:
    """pid, thread count and thread-related environment of every rank process under the server."""
    found = []
    for pid, spec in server.ranks():
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            environ = proc.environ()
            found.append(
                {
                    "pid": pid,
                    "role": (spec.get("pool") or {}).get("role"),
                    "rank": spec.get("rank"),
                    "threads": proc.num_threads(),
                    **{
                        k: environ.get(k) for k in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS")
                    },
                }
            )
    return sorted(found, key=lambda r: (str(r["role"]), r["rank"] if r["rank"] is not None else -1))


def cpu_window(
    before: tuple[dict[int, float], tuple[float, float]],
    after: tuple[dict[int, float], tuple[float, float]],
    ranks: list[dict[str, Any]],
    wall: float,
) -> dict[str, Any]:
    """CPU seconds over the measurement window: per rank, for the whole server (gateway,
    supervisor, launchers and ranks), and for the machine (every process, others' jobs included)."""
    (procs0, (busy0, _)), (procs1, (busy1, _)) = before, after
    used = {pid: procs1[pid] - procs0[pid] for pid in procs0 if pid in procs1}
    return {
        "wall_s": wall,
        "per_rank_s": {f"{r['role']}/{r['rank']}": used.get(r["pid"]) for r in ranks},
        "server_s": sum(used.values()),
        "machine_busy_s": busy1 - busy0,
        "cores": os.cpu_count(),
    }


LOG_EVENTS = {
    "missed_heartbeats": "missed heartbeats",
    "back_in_rotation": "back in rotation",
    "unreachable": "cannot reach",
    "resent": "sending it again",
    "pool_down": "down:",
    "restart": ": restart ",
    "warmup_done": "warm-up done",
}


def log_events(path: Path) -> dict[str, Any]:
    """Counts of the server log's lines about rank health, and the ranks' warm-up times."""
    text = path.read_text(errors="replace") if path.exists() else ""
    lines = text.splitlines()
    events: dict[str, Any] = {
        key: sum(needle in line for line in lines) for key, needle in LOG_EVENTS.items()
    }
    events["warmup_s"] = [
        float(line.rsplit("warm-up done in ", 1)[1].split()[0])
        for line in lines
        if "warm-up done in " in line
    ]
    return events


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
async def warm_up(
    name: str,
    client: httpx.AsyncClient,
    poller: httpx.AsyncClient,
    base_url: str,
    ranks: int,
    args: argparse.Namespace,
) -> list[str]:
    """Rounds of two waves (so every rank of a pool sees prompts of several shapes) until one
    round has no failure: a rank compiling its numba kernels on a cold cache can miss heartbeats
    long enough for the gateway to fail its requests (see the results' notes). -> every error."""
    warm = warmup_items(args.warmup_requests, args.seed)
    half = (len(warm) + 1) // 2
    errors: list[str] = []
    for round_ in range(1, args.warmup_rounds + 1):
        await wait_healthy_count(poller, base_url, ranks, 120.0)
        started = time.perf_counter()
        results: list[Result] = []
        for wave in (warm[:half], warm[half:]):
            results += await asyncio.gather(*(send_one(client, base_url, it, 0.0) for it in wave))
        failed = [r.error for r in results if r.error]
        errors += [f"round {round_}: {e}" for e in failed]
        progress(
            f"[{name}] warm-up round {round_}: {len(warm)} requests in {time.perf_counter() - started:.1f} s,"
            f" {len(failed)} failed{' (' + failed[0] + ')' if failed else ''}"
        )
        if not failed:
            await wait_healthy_count(poller, base_url, ranks, 120.0)
            return errors
    raise RuntimeError(f"[{name}] warm-up failed in each of {args.warmup_rounds} rounds: {errors[-1]}")


async def run_phase(
    name: str, ranks: int, server: Server, items: list[Item], args: argparse.Namespace
) -> dict[str, Any]:
    async with (
        client_for(len(items), args.request_timeout) as client,
        httpx.AsyncClient(timeout=10.0) as poller,
    ):
        warm_errors = await warm_up(name, client, poller, server.base_url, ranks, args)
        rank_procs = rank_processes(server)
        await asyncio.sleep(1.2)  # let every rank's next heartbeat carry the warm-up's counters
        before = await scrape_async(poller, server.base_url)

        tree = [server.pid, *(p.pid for p in server.processes())]
        cpu_before = cpu_seconds(tree), machine_cpu()
        start = time.perf_counter()
        load_start = os.getloadavg()
        samples: list[tuple[float, Workers]] = []
        stop = asyncio.Event()
        poll_task = asyncio.create_task(
            poll(poller, server.base_url, args.poll_interval, start, stop, samples)
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
                progress(
                    f"[{name}] t={now - start:5.1f}s sent {sent}/{len(items)} done {len(done)} failed {failed}"
                )
                next_report += args.progress_interval
        results = [t.result() for t in tasks]
        stop.set()
        await poll_task
        load_end = os.getloadavg()
        cpu_after = cpu_seconds(tree), machine_cpu()
        window_wall = time.perf_counter() - start
        await asyncio.sleep(1.2)
        after = await scrape_async(poller, server.base_url)

    ok = [r for r in results if r.error is None]
    window_end = max((r.sent + r.e2e for r in results if r.e2e is not None), default=0.0)
    duration = window_end
    out_tokens = sum(r.output_tokens for r in ok)
    progress(
        f"[{name}] done: {len(ok)}/{len(results)} ok in {duration:.1f} s,"
        f" {out_tokens / duration if duration else 0:.0f} output tok/s"
    )
    return {
        "server_command": shlex.join([*(f"{k}={v}" for k, v in server_env(args).items()), *server.argv]),
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
        "by_kind": {
            kind: {
                "completed": sum(r.kind == kind for r in ok),
                "failed": sum(r.kind == kind and r.error is not None for r in results),
                "ttft_s": percentiles([r.ttft for r in ok if r.kind == kind and r.ttft is not None]),
                "tpot_s": percentiles([r.tpot for r in ok if r.kind == kind and r.tpot is not None]),
                "e2e_s": percentiles([r.e2e for r in ok if r.kind == kind and r.e2e is not None]),
            }
            for kind in sorted({r.kind for r in results})
        },
        "rank_processes": rank_procs,
        "cpu": cpu_window(cpu_before, cpu_after, rank_procs, window_wall),
        "load": rank_load(before, after, samples, 0.0, window_end),
        "requests": [asdict(r) for r in results],
        "metric_samples": [
            {
                "t": round(t, 3),
                "workers": {
                    w: [v.get("running", 0), v.get("waiting", 0), round(v.get("kv", 0.0), 5)]
                    for w, v in snap.items()
                    if w != GATEWAY
                },
                "gateway_queue": snap.get(GATEWAY, {}).get("queue"),
            }
            for t, snap in samples
        ],
    }


def rank_load(
    before: Workers,
    after: Workers,
    samples: list[tuple[float, Workers]],
    a: float,
    b: float,
) -> dict[str, Any]:
    per_rank: dict[str, dict[str, Any]] = {}
    for worker in sorted(w for w in after if w != GATEWAY):
        end, begin = after[worker], before.get(worker, {})
        queue = [
            (t, s[worker].get("running", 0) + s[worker].get("waiting", 0)) for t, s in samples if worker in s
        ]
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

        names = [w for w, r in per_rank.items() if r["role"] == role]
        roles[role] = {
            "ranks": len(ranks),
            "inst_running_waiting_max_over_mean": instantaneous_ratio(
                samples, names, lambda v: v.get("running", 0) + v.get("waiting", 0), a, b
            ),
            "inst_kv_usage_max_over_mean": instantaneous_ratio(
                samples, names, lambda v: v.get("kv", 0.0), a, b
            ),
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
    gateway = {
        key: time_average([(t, s[GATEWAY].get(key, 0)) for t, s in samples if GATEWAY in s], a, b)
        for key in GATEWAY_SERIES.values()
    }
    return {"per_rank": per_rank, "per_role": roles, "gateway_avg": gateway}


def instantaneous_ratio(
    samples: list[tuple[float, Workers]],
    workers: list[str],
    value: Callable[[dict[str, Any]], float],
    a: float,
    b: float,
) -> float | None:
    """time average of (max over ``workers``) / time average of (mean over ``workers``): how much
    the busiest rank holds at a moment against the average, weighted by how much there is."""
    top, mean = [], []
    for t, snap in samples:
        if all(w in snap for w in workers):
            values = [value(snap[w]) for w in workers]
            top.append((t, max(values)))
            mean.append((t, sum(values) / len(values)))
    avg_top, avg_mean = time_average(top, a, b), time_average(mean, a, b)
    return avg_top / avg_mean if avg_top is not None and avg_mean else None


def p3(stats: dict[str, float | None], scale: float, digits: int) -> str:
    return " / ".join(fmt(stats[k], scale, digits) for k in ("p50", "p90", "p99"))


def workload_line(seed: int, wl: dict[str, Any], cfg: dict[str, Any]) -> str:
    pl = wl["prompt_len"]
    gaps = "fixed gaps at" if cfg.get("arrivals") == "fixed" else "Poisson"
    if cfg.get("workload", "random") == "alternating":
        return (
            f"- Workload seed {seed}: {wl['num_requests']} requests alternating heavy ({cfg['heavy_prompt']}"
            f" prompt / {cfg['heavy_output']} output tokens) and light ({cfg['light_prompt']} /"
            f" {cfg['light_output']}), heavy first; {gaps} {cfg['rate']} req/s (arrivals over"
            f" {wl['arrival_span_s']:.1f} s); {wl['prompt_tokens_total']:,} prompt and"
            f" {wl['output_tokens_total']:,} output tokens in all; random token ids (no shared prefix; the"
            " seed picks only the ids), ignore_eos, temperature 0"
        )
    return (
        f"- Workload seed {seed}: {wl['num_requests']} requests, {gaps} {cfg['rate']} req/s (arrivals over"
        f" {wl['arrival_span_s']:.1f} s); prompts {pl['min']}..{pl['max']} tokens (p50 {pl['p50']:.0f}, mean"
        f" {pl['mean']:.0f}, p90 {pl['p90']:.0f}, {wl['prompt_tokens_total']:,} in all);"
        f" {wl['requests_with_shared_prefix']} start with one of {cfg['num_prefixes']} shared"
        f" {cfg['prefix_len']}-token prefixes (requests per prefix: {', '.join(map(str, wl['requests_per_prefix']))});"
        f" outputs {cfg['min_output']}..{cfg['max_output']} tokens (mean {wl['output_len_mean']:.0f}), ignore_eos,"
        " temperature 0"
    )


def run_markdown(workload: str, report: dict[str, Any]) -> list[str]:
    """One run (one workload) as a markdown section."""
    m, cfg = report["machine"], report["config"]
    phases = report["phases"]
    load_end = report.get("load_avg_end") or [float("nan")]
    procs = next((p["rank_processes"] for p in phases if p.get("rank_processes")), [])
    lines = [
        f"## Workload `{workload}`: dsinfer {report['git_commit']}",
        "",
        f"- Date {report['date']}. Machine: {m.get('cpu_model', '?')}, {m['online_cpus']} cores,"
        f" {m.get('mem_total_gib', '?')} GiB; load average {report['load_avg_start'][0]:.2f} at start,"
        f" {load_end[0]:.2f} at end (1-minute; shared machine: expect noise)",
        f"- Command: `{report['command']}`",
        f"- Servers: tiny preset, dummy weights, float32, CPU, {cfg['threads_per_rank']} thread(s) per rank,"
        f" KV {cfg['kv_cache_memory']} per rank, default chunking; PD = prefill pool of 2 ranks + decode pool"
        " of 2 ranks; colocated = one rank; environment added:"
        f" {' '.join(f'{k}={v}' for k, v in report['server_env'].items()) or 'nothing'}",
        *(workload_line(int(seed), wl, cfg) for seed, wl in report["workloads"].items()),
        "- Phase order: "
        + "; ".join(
            f"seed {seed}: " + ", ".join(p["name"] for p in phases if p["seed"] == int(seed))
            for seed in report["workloads"]
        ),
        "- Warm-up failures before the measurements (retried until a round passed): "
        + ", ".join(f"{p['name']} seed {p['seed']}: {len(p['warmup_errors'])}" for p in phases),
    ]
    if any("log_events" in p for p in phases):
        lines.append(
            "- Server logs, per phase (missed-heartbeat / unreachable / resent / pool-down lines; ranks'"
            " warm-up s): "
            + ", ".join(
                f"{p['name']} seed {p['seed']}: {e['missed_heartbeats']}/{e['unreachable']}/{e['resent']}/"
                f"{e['pool_down']} ({', '.join(f'{w:.1f}' for w in e['warmup_s'])})"
                for p in phases
                if (e := p.get("log_events"))
            )
        )
    if procs:
        lines.append(
            "- Rank processes (first phase with ranks): "
            + "; ".join(
                f"{r['role']} rank {r['rank']}: {r['threads']} threads, OMP_NUM_THREADS={r['OMP_NUM_THREADS']},"
                f" NUMBA_NUM_THREADS={r['NUMBA_NUM_THREADS']}"
                for r in procs
            )
        )
    lines += [
        "",
        "### Latency and throughput",
        "",
        "| server | seed | ok / failed | req/s | output tok/s | TTFT p50 / p90 / p99 (ms)"
        " | TPOT p50 / p90 / p99 (ms) | E2E p50 / p99 (s) | load avg (start-end) | cores busy: server / machine |",
        "|---|---:|---|---:|---:|---|---|---|---|---|",
    ]
    for p in phases:
        e, la, cpu = p["e2e_s"], p["load_avg_during"], p.get("cpu")
        busy = (
            f"{cpu['server_s'] / cpu['wall_s']:.2f} / {cpu['machine_busy_s'] / cpu['wall_s']:.2f}"
            if cpu
            else "-"
        )
        lines.append(
            f"| {p['name']} | {p['seed']} | {p['completed']} / {p['failed']} | {fmt(p['request_throughput'])}"
            f" | {fmt(p['output_tok_s'], digits=0)} | {p3(p['ttft_s'], 1e3, 0)} | {p3(p['tpot_s'], 1e3, 1)}"
            f" | {fmt(e['p50'])} / {fmt(e['p99'])} | {la['start'][0]:.1f}-{la['end'][0]:.1f} | {busy} |"
        )
    if any(len(p.get("by_kind", {})) > 1 for p in phases):
        lines += [
            "",
            "### Latency by request kind",
            "",
            "| server | seed | kind | ok / failed | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms)"
            " | E2E p50 / p99 (s) |",
            "|---|---:|---|---|---|---|---|",
        ]
        for p in phases:
            for kind, k in p["by_kind"].items():
                lines.append(
                    f"| {p['name']} | {p['seed']} | {kind} | {k['completed']} / {k['failed']}"
                    f" | {p3(k['ttft_s'], 1e3, 0)} | {p3(k['tpot_s'], 1e3, 1)}"
                    f" | {fmt(k['e2e_s']['p50'])} / {fmt(k['e2e_s']['p99'])} |"
                )
    lines += [
        "",
        "### Per-rank load balance: max/mean across the 2 ranks of a role (1.00 = even)",
        "",
        "Totals over the window: prompt tokens admitted, and those less prefix-cache hits (computed)."
        " Time-averaged: the max/mean of each rank's time average (`avg`), and the time average of the"
        " max over the time average of the mean at each poll (`inst`, the momentary imbalance). Awaiting"
        " first token: the gateway's `dsinfer_queue_length` (requests without a first token yet), time-averaged.",
        "",
        "| server | seed | role | prompt tokens | computed tokens | running+waiting avg / inst"
        " | KV usage avg / inst | prefix hit rate | awaiting first token (avg) |",
        "|---|---:|---|---:|---:|---|---|---:|---:|",
    ]
    for p in phases:
        for role, r in p["load"]["per_role"].items():
            if r["ranks"] < 2:
                continue
            lines.append(
                f"| {p['name']} | {p['seed']} | {role} | {fmt(r['prompt_tokens_max_over_mean'])}"
                f" | {fmt(r['computed_prompt_tokens_max_over_mean'])}"
                f" | {fmt(r['avg_running_waiting_max_over_mean'])} / {fmt(r['inst_running_waiting_max_over_mean'])}"
                f" | {fmt(r['avg_kv_usage_max_over_mean'])} / {fmt(r['inst_kv_usage_max_over_mean'])}"
                f" | {fmt(r['prefix_hit_rate'], 100, 1)}% | {fmt(p['load']['gateway_avg'].get('queue'))} |"
            )
    lines += [
        "",
        "### Per rank (measurement window)",
        "",
        "| server | seed | worker | prompt tokens | prefix-hit tokens | computed | avg running+waiting"
        " | avg KV usage | peak KV usage | CPU s in window |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in phases:
        rank_cpu = (p.get("cpu") or {}).get("per_rank_s", {})
        for worker, r in p["load"]["per_rank"].items():
            role, _, rank = worker.split("/")
            lines.append(
                f"| {p['name']} | {p['seed']} | {worker} | {r['prompt_tokens']:,.0f} | {r['prefix_hit_tokens']:,.0f}"
                f" | {r['computed_prompt_tokens']:,.0f} | {fmt(r['avg_running_waiting'])}"
                f" | {fmt(r['avg_kv_usage'], 100, 1)}% | {fmt(r['peak_kv_usage'], 100, 1)}%"
                f" | {fmt(rank_cpu.get(f'{role}/{rank}'), digits=1)} |"
            )
    lines += [
        "",
        "TTFT = send to the first streamed chunk with a choice; TPOT = (last - first chunk) / (tokens - 1);"
        " E2E = send to the last chunk; throughput over first send to last response end. Prompt tokens ="
        " admitted by the rank during the window (`dsinfer_worker_prompt_tokens_total`); computed = less"
        " prefix-cache hits (`dsinfer_prefix_cache_hit_tokens_total`). Averages are sample-and-hold over the"
        f" gateway's `/metrics`, polled every {cfg['poll_interval']} s (workers report every 0.5 s).",
        "",
    ]
    return lines


def run_workload(report: dict[str, Any]) -> str:
    return str(report["config"].get("workload", "random"))


def load_document(path: Path) -> dict[str, Any]:
    """The results file: {"benchmark", "runs": {workload: report}}; a file from before workloads
    existed (one report, the random workload) becomes runs["random"]."""
    doc: dict[str, Any] = {"benchmark": "pd_serving", "runs": {}}
    with contextlib.suppress(OSError, json.JSONDecodeError):
        old = json.loads(path.read_text())
        if "runs" in old:
            doc["runs"] = dict(old["runs"])
        elif "phases" in old:
            doc["runs"][run_workload(old)] = old
    return doc


def short_commit(described: str) -> str:
    sha = described.split()[0][:12]
    return f"{sha} + uncommitted working tree" if "uncommitted working tree" in described else sha


def markdown(doc: dict[str, Any]) -> str:
    runs = doc["runs"]
    lines = [
        "# PD serving: load balancers vs round-robin, PD vs one colocated engine",
        "",
        "One run per workload (each replaces the previous run of its workload in pd_serving.json);"
        " each section names the dsinfer commit it ran:",
        "",
        *(f"- `{w}`: {r['date']}, dsinfer {short_commit(r['git_commit'])}" for w, r in runs.items()),
        "",
    ]
    for workload, report in runs.items():
        lines += run_markdown(workload, report)
    return "\n".join(lines)


# Main ------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--configs", default=",".join(CONFIG_NAMES), help="servers to run, in this order")
    p.add_argument(
        "--workload",
        choices=("random", "alternating"),
        default="random",
        help="random: lognormal prompts with shared prefixes; alternating: heavy, light, heavy, ...",
    )
    p.add_argument("--num-requests", type=int, default=160, help="measured requests per server")
    p.add_argument("--rate", type=float, default=4.0, help="arrival rate, requests/s")
    p.add_argument(
        "--arrivals",
        choices=("poisson", "fixed"),
        default=None,
        help="Poisson arrivals or fixed gaps of 1/rate (default: poisson for random, fixed for alternating)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the workload (of the first repeat)")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every server on this many workloads (seeds seed, seed+1, ...)",
    )
    p.add_argument(
        "--order",
        choices=("alternate", "fixed"),
        default="alternate",
        help="alternate: odd repeats run the servers in reverse order (fair about machine load drift)",
    )
    p.add_argument(
        "--prompt-median", type=float, default=200.0, help="random: median of the lognormal lengths"
    )
    p.add_argument("--prompt-sigma", type=float, default=1.0, help="random: sigma of the lognormal lengths")
    p.add_argument("--min-prompt", type=int, default=16, help="random: shortest prompt (or suffix), tokens")
    p.add_argument("--max-prompt", type=int, default=1500, help="random: longest prompt, tokens")
    p.add_argument("--num-prefixes", type=int, default=4, help="random: shared prefixes (Zipf popularity)")
    p.add_argument("--prefix-len", type=int, default=512, help="random: tokens per shared prefix")
    p.add_argument(
        "--prefix-fraction", type=float, default=0.33, help="random: share of requests with a prefix"
    )
    p.add_argument("--min-output", type=int, default=16, help="random: fewest output tokens")
    p.add_argument("--max-output", type=int, default=128, help="random: most output tokens")
    for kind, prompt, output in (("heavy", 1200, 128), ("light", 40, 16)):
        for what, tokens in (("prompt", prompt), ("output", output)):
            help_ = f"alternating: {what} tokens of a {kind} request"
            p.add_argument(f"--{kind}-{what}", type=int, default=tokens, help=help_)
    p.add_argument("--threads-per-rank", type=int, default=1, help="torch threads per rank")
    p.add_argument("--kv-cache-memory", default="256MiB", help="KV cache per rank")
    p.add_argument(
        "--numba-threads",
        type=int,
        default=0,
        help="NUMBA_NUM_THREADS for the servers (0: unset). Since 05c8449 the pool launcher sets"
        " NUMBA_NUM_THREADS (and OMP_NUM_THREADS) to --threads-per-rank for every rank itself, which"
        " overrides this; it only matters for older commits, whose idle numba workers spin",
    )
    p.add_argument("--warmup-requests", type=int, default=8, help="warm-up requests per server")
    p.add_argument("--warmup-rounds", type=int, default=4, help="warm-up rounds allowed to fail")
    p.add_argument("--poll-interval", type=float, default=0.25, help="seconds between /metrics polls")
    p.add_argument("--progress-interval", type=float, default=5.0, help="seconds between progress lines")
    p.add_argument("--request-timeout", type=float, default=300.0, help="client timeout per request, s")
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds for a server to get healthy")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/pd_serving_logs"), help="server logs")
    p.add_argument(
        "--commit",
        default="HEAD",
        help="run the servers on a clean export (git archive, under --log-dir) of this commit, resolved"
        " when the benchmark starts; 'worktree': a snapshot copy of the checkout's dsinfer/, kernels/ and"
        " configs/ as they are at the start (uncommitted changes included); 'checkout': the live checkout",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=REPO / "benchmarks/results/pd_serving.json",
        help="JSON results (this workload's run replaces its previous one; other workloads' runs are kept)",
    )
    p.add_argument(
        "--markdown", type=Path, default=REPO / "benchmarks/results/pd_serving.md", help="markdown tables"
    )
    args = p.parse_args(argv)
    if args.arrivals is None:
        args.arrivals = "fixed" if args.workload == "alternating" else "poisson"
    for name in args.configs.split(","):
        topology_flags(name)
    if not 0 < args.min_prompt <= args.max_prompt or args.prefix_len >= args.max_prompt:
        p.error("need 0 < --min-prompt <= --max-prompt and --prefix-len < --max-prompt")
    if not 1 <= args.min_output <= args.max_output:
        p.error("need 1 <= --min-output <= --max-output")
    if min(args.heavy_prompt, args.light_prompt, args.heavy_output, args.light_output) < 1:
        p.error("the alternating workload's lengths must be positive")
    if args.rate <= 0 or args.num_requests < 1 or args.repeats < 1:
        p.error("need --rate > 0, --num-requests >= 1 and --repeats >= 1")
    return args


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def phase_order(configs: list[str], repeat: int, order: str) -> list[str]:
    return configs[::-1] if order == "alternate" and repeat % 2 == 1 else configs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # stop the servers on SIGTERM too
    args.log_dir.mkdir(parents=True, exist_ok=True)
    source: Path | None = None
    commit = git_commit()
    if args.commit != "checkout":
        export = args.log_dir / f"src-{time.strftime('%Y%m%d-%H%M%S')}"
        sha, source = export_commit(args.commit, export)
        commit = f"{sha} (clean export in {export})"
        progress(f"servers run commit {sha} ({args.commit}) from {export}")
    seeds = [args.seed + i for i in range(args.repeats)]
    workloads = {seed: make_workload(argparse.Namespace(**{**vars(args), "seed": seed})) for seed in seeds}
    report: dict[str, Any] = {
        "benchmark": "pd_serving",
        "date": utc_now(),
        "command": command_line(),
        "git_commit": commit,
        "machine": machine_info(),
        "load_avg_start": list(os.getloadavg()),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "engine_flags": engine_flags(args),
        "server_env": server_env(args),
        "workloads": {str(seed): workload_summary(items, args) for seed, items in workloads.items()},
        "phases": [],
    }
    doc = load_document(args.out)
    doc["runs"][args.workload] = report

    def save() -> None:
        write_json(args.out, doc)

    for seed, wl in report["workloads"].items():
        progress(
            f"workload {args.workload} seed {seed}: {wl['num_requests']} requests over {wl['arrival_span_s']:.1f} s,"
            f" prompt tokens p50 {wl['prompt_len']['p50']:.0f} mean {wl['prompt_len']['mean']:.0f} max"
            f" {wl['prompt_len']['max']}, kinds {wl['requests_per_kind']},"
            f" {wl['requests_with_shared_prefix']} with a shared prefix {wl['requests_per_prefix']}"
        )
    progress(f"load average {report['load_avg_start'][0]:.2f}")
    for repeat, seed in enumerate(seeds):
        for position, name in enumerate(phase_order(args.configs.split(","), repeat, args.order)):
            flags = [*topology_flags(name), *engine_flags(args)]
            label = f"{args.workload}-{name}-seed{seed}"
            with serve(
                flags,
                args.log_dir,
                name=f"pd_serving-{label}",
                startup_timeout=args.startup_timeout,
                source=source,
                env=server_env(args),
                give_up_on=": restart 3/",  # a pool restarted 3 times before the server got ready
                stop_grace=30.0,
                say=lambda msg, label=label: progress(f"[{label}] {msg}"),
            ) as server:
                phase = asyncio.run(run_phase(label, num_ranks(name), server, workloads[seed], args))
            events = log_events(server.log_path)
            report["phases"].append(
                {"name": name, "seed": seed, "position": position, "log_events": events, **phase}
            )
            save()  # so far, in case a later phase fails
    report["load_avg_end"] = list(os.getloadavg())
    save()
    plot_result(args.out)
    args.markdown.write_text(markdown(doc))
    progress(f"wrote {args.out} and {args.markdown}; load average {report['load_avg_end'][0]:.2f}")
    print("\n".join(run_markdown(args.workload, report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
