"""Overload drills on the all-in-one server (default pools, the built-in model): no accepted
request may fail for being queued, and the gateway's memory must come back.

    python benchmarks/overload.py --out benchmarks/results/overload

- bursts: 1,000 and 1,100 concurrent streams of 24 tokens, sent at once;
- sustained: open-loop streams for ``--sustain`` s at 2x and 4x the rate the server completes
  requests (measured first, by a closed loop of ``--probe-concurrency`` streams);
- big prompts: ``--big-prompts`` prompts of 7.9 MB at once, timed to their refusal, with
  ``/health`` timed meanwhile.

Each drill repeats ``--repeats`` times. A request ends: completed, refused before its stream
started (429/503 with Retry-After: allowed), failed after it was accepted (an error status past
admission or an error event in its stream: a defect), or hung. The gateway's resident memory is
sampled idle, after each drill and after ``--settle`` s idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

from harness.clients import Stream, client_for, completion_body, stream_completion
from harness.plots import plot_result
from harness.progress import progress
from harness.provenance import provenance
from harness.results import fmt, percentile, report_header, save_report, table
from harness.server import Server, serve

REFUSED = ("HTTP 429", "HTTP 503")  # refused up front, with Retry-After
BIG_PROMPT_CHARS = 7_900_000


def verdict(stream: Stream) -> str:
    if stream.error is None:
        return "completed"
    if stream.error.startswith(REFUSED) and not stream.chunks:
        return "refused"
    return "failed"


async def burst(server: Server, concurrency: int, max_tokens: int, hang_after: float) -> dict[str, Any]:
    """``concurrency`` streams sent at once."""
    async with client_for(concurrency, timeout=hang_after) as client:
        body = completion_body("Tell me about the sea.", max_tokens, model="tiny-chat")
        start = time.perf_counter()
        streams = await asyncio.gather(
            *(stream_completion(client, server.base_url, body) for _ in range(concurrency))
        )
        seconds = time.perf_counter() - start
    return _summary(streams, seconds)


async def sustained(
    server: Server, rate: float, seconds: float, max_tokens: int, hang_after: float
) -> dict[str, Any]:
    """Open loop: a stream every ``1 / rate`` s for ``seconds`` s."""
    total = int(rate * seconds)
    async with client_for(total, timeout=hang_after) as client:
        body = completion_body("Tell me about the sea.", max_tokens, model="tiny-chat")
        start, tasks = time.perf_counter(), []
        for i in range(total):
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(stream_completion(client, server.base_url, body)))
        streams = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return {**_summary(list(streams), elapsed), "rate": rate}


async def completion_rate(server: Server, concurrency: int, seconds: float, max_tokens: int) -> float:
    """Requests per second the server completes with ``concurrency`` streams always open."""
    done = 0
    deadline = time.perf_counter() + seconds
    async with client_for(concurrency) as client:
        body = completion_body("Tell me about the sea.", max_tokens, model="tiny-chat")

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                if (await stream_completion(client, server.base_url, body)).error is None:
                    done += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - start)


async def big_prompts(server: Server, count: int, at_once: bool) -> dict[str, Any]:
    """``count`` 7.9 MB prompts, one after the other or all at once: seconds to each refusal (the
    body encoded once, ahead), and /health's latency meanwhile."""
    body = json.dumps(
        {"model": "tiny-chat", "prompt": "a " * (BIG_PROMPT_CHARS // 2), "max_tokens": 8}
    ).encode()
    health: list[float] = []
    async with httpx.AsyncClient(timeout=120) as client:

        async def one() -> tuple[int, float]:
            t = time.perf_counter()
            r = await client.post(
                f"{server.base_url}/v1/completions",
                content=body,
                headers={"content-type": "application/json"},
            )
            return r.status_code, time.perf_counter() - t

        async def probe(stop: asyncio.Event) -> None:
            while not stop.is_set():
                t = time.perf_counter()
                await client.get(f"{server.base_url}/health")
                health.append(time.perf_counter() - t)
                await asyncio.sleep(0.02)

        stop = asyncio.Event()
        prober = asyncio.create_task(probe(stop))
        if at_once:
            answers = await asyncio.gather(*(one() for _ in range(count)))
        else:
            answers = [await one() for _ in range(count)]
        stop.set()
        await prober
    seconds = [s for _, s in answers]
    return {
        "at_once": at_once,
        "statuses": dict(Counter(str(c) for c, _ in answers)),
        "refusal_p50_ms": 1000 * statistics.median(seconds),
        "refusal_max_ms": 1000 * max(seconds),
        "health_p99_ms": 1000 * (percentile(health, 99) or 0.0),
        "health_max_ms": 1000 * max(health, default=0.0),
    }


def _summary(streams: list[Stream], seconds: float) -> dict[str, Any]:
    verdicts = Counter(verdict(s) for s in streams)
    ttfts = [s.ttft for s in streams if s.error is None and s.ttft is not None]
    failures = Counter((s.error or "")[:120] for s in streams if verdict(s) == "failed")
    return {
        "requests": len(streams),
        "completed": verdicts["completed"],
        "refused": verdicts["refused"],
        "failed": verdicts["failed"],
        "failures": dict(failures.most_common(5)),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "seconds": seconds,
    }


def gateway_rss_mib(server: Server) -> float:
    pid = server.pids().get("gateway", [None])[0]
    return psutil.Process(pid).memory_info().rss / 2**20 if pid else float("nan")


async def drills(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {
        "memory_mib": {"idle": gateway_rss_mib(server)},
        "bursts": [],
        "sustained": [],
        "big_prompts": [],
    }
    for repeat in range(args.repeats):
        for concurrency in args.bursts:
            result = await burst(server, concurrency, args.max_tokens, args.hang_after)
            out["bursts"].append({"concurrency": concurrency, "repeat": repeat, **result})
            progress(
                f"burst {concurrency} #{repeat}: {result['completed']} completed, {result['refused']} refused, {result['failed']} failed"
            )
    out["memory_mib"]["after_bursts"] = gateway_rss_mib(server)
    await asyncio.sleep(args.settle)
    out["memory_mib"]["after_bursts_settled"] = gateway_rss_mib(server)
    sustainable = await completion_rate(server, args.probe_concurrency, args.probe_seconds, args.max_tokens)
    out["sustainable_rate"] = sustainable
    progress(f"the server completes {sustainable:.2f} requests/s at {args.probe_concurrency} open streams")
    for repeat in range(args.repeats):
        for factor in (2, 4):
            result = await sustained(
                server, factor * sustainable, args.sustain, args.max_tokens, args.hang_after
            )
            out["sustained"].append({"factor": factor, "repeat": repeat, **result})
            progress(
                f"sustained {factor}x #{repeat}: {result['completed']} completed, {result['refused']} refused, {result['failed']} failed"
            )
            await asyncio.sleep(args.settle)  # the queue drains before the next
    for repeat in range(args.repeats):
        for at_once in (False, True):
            result = await big_prompts(server, args.big_prompts, at_once)
            out["big_prompts"].append({"repeat": repeat, **result})
            progress(f"big prompts #{repeat}: {result}")
    out["memory_mib"]["after_big_prompts"] = gateway_rss_mib(server)
    await asyncio.sleep(args.settle)
    out["memory_mib"]["after_settle"] = gateway_rss_mib(server)
    return out


OUTCOMES = ["completed", "refused (429/503)", "failed after accepted", "TTFT p50 s", "TTFT p99 s"]


def _outcomes(run: dict[str, Any]) -> tuple[Any, ...]:
    return (run["completed"], run["refused"], run["failed"], fmt(run["ttft_p50_s"]), fmt(run["ttft_p99_s"]))


def markdown(report: dict[str, Any]) -> list[str]:
    r = report["results"]
    lines = ["# Overload drills", "", *report_header(report), "", "## Bursts", ""]
    bursts = [(b["concurrency"], b["repeat"], *_outcomes(b)) for b in r["bursts"]]
    lines += table(["concurrent", "repeat", *OUTCOMES], bursts, "rrrrrrr")
    sustain, rate = report["args"]["sustain"], r["sustainable_rate"]
    lines += ["", f"## Sustained load ({sustain:g} s each; the server completes {rate:.2f} requests/s)", ""]
    runs = [(f"{s['factor']}x", s["repeat"], fmt(s["rate"]), *_outcomes(s)) for s in r["sustained"]]
    lines += table(["load", "repeat", "requests/s", *OUTCOMES], runs, "lrrrrrrr")
    lines += [
        "",
        f"## Big prompts ({report['args']['big_prompts']} of 7.9 MB, one after the other or at once)",
        "",
    ]
    cells = ("refusal_p50_ms", "refusal_max_ms", "health_p99_ms", "health_max_ms")
    big = [
        (
            b["repeat"],
            "at once" if b["at_once"] else "one by one",
            b["statuses"],
            *(fmt(b[c], digits=0) for c in cells),
        )
        for b in r["big_prompts"]
    ]
    lines += table(
        [
            "repeat",
            "sent",
            "statuses",
            "refusal p50 ms",
            "refusal max ms",
            "/health p99 ms",
            "/health max ms",
        ],
        big,
        "rllrrrr",
    )
    m = r["memory_mib"]
    lines += ["", "## Gateway resident memory (MiB)", ""]
    settle = f"{report['args']['settle']:g} s idle"
    lines += table(
        ["idle", "after the bursts", f"then {settle}", "after everything", f"then {settle}"],
        [
            tuple(
                fmt(m[k], digits=0)
                for k in ("idle", "after_bursts", "after_bursts_settled", "after_big_prompts", "after_settle")
            )
        ],
        "rrrrr",
    )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="directory for overload.json and overload.md")
    p.add_argument("--bursts", type=int, nargs="+", default=[1000, 1100])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--sustain", type=float, default=60.0, help="seconds of each sustained run")
    p.add_argument("--probe-concurrency", type=int, default=64)
    p.add_argument("--probe-seconds", type=float, default=30.0)
    p.add_argument("--big-prompts", type=int, default=10)
    p.add_argument("--hang-after", type=float, default=900.0, help="a stream with no end this long is hung")
    p.add_argument("--settle", type=float, default=30.0, help="seconds idle between drills and at the end")
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[], help="more dsinfer serve flags")
    args = p.parse_args()
    with (
        tempfile.TemporaryDirectory() as logs,
        serve(args.serve_args, Path(logs), startup_timeout=300, say=progress) as server,
    ):
        results = asyncio.run(drills(server, args))
    report = {
        **provenance(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    save_report(
        report, "\n".join(markdown(report)) + "\n", args.out / "overload.json", args.out / "overload.md"
    )
    plot_result(args.out / "overload.json")


if __name__ == "__main__":
    main()
