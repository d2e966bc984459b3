r"""The cost of tracing: the all-in-one server (the built-in model, PD, default pools) serving the
same load with tracing off and with ``--otlp-traces-endpoint`` on (every request traced, the spans
sent over OTLP/HTTP to a receiver in this process that decodes and counts them, as a collector
would).

One run: a server in each mode, alternated (off, on, on, off, ...) over ``--repeats``; in each,
after a warm-up, rounds of ``--concurrency`` streamed completions of ``--max-tokens`` tokens
(greedy, ignore_eos) for ``--seconds``. Reported per mode: completed requests/s, output tok/s,
TTFT and TPOT p50 (medians over the repeats), the spans received, and on/off ratios. The load
average is recorded: compare only numbers taken on a quiet machine.

    python benchmarks/tracing_cost.py --out benchmarks/results/tracing_cost.json \
        --markdown benchmarks/results/tracing_cost.md
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.clients import Stream, client_for, completion_body, outcome, stream_all
from harness.otlp import TraceReceiver, trace_receiver
from harness.plots import plot_result
from harness.progress import progress
from harness.provenance import load_average, provenance
from harness.results import add_output_args, fmt, median, percentile, ratio, save_report, table
from harness.server import serve

MODES = ("off", "on")


async def _rounds(url: str, concurrency: int, max_tokens: int, seconds: float) -> list[Stream]:
    """Rounds of ``concurrency`` streams at once until ``seconds`` passed (the last one ends)."""
    done: list[Stream] = []
    deadline = time.monotonic() + seconds
    async with client_for(concurrency) as client:
        round_no = 0
        while time.monotonic() < deadline:
            bodies = [
                completion_body(
                    [10 + (7 * i + round_no) % 200 for i in range(24)],
                    max_tokens,
                    model="tiny-chat",
                    stream_options={"include_usage": True},
                )
                for _ in range(concurrency)
            ]
            done += await stream_all(client, url, bodies)
            round_no += 1
    return done


def _measure(mode: str, args: argparse.Namespace, receiver: TraceReceiver, log_dir: Path) -> dict[str, Any]:
    flags = ["--otlp-traces-endpoint", receiver.endpoint] if mode == "on" else []
    with serve(flags, log_dir) as server:
        asyncio.run(_rounds(server.base_url, args.concurrency, args.max_tokens, args.warmup))
        time.sleep(1.0)  # the warm-up's spans are exported (every 0.5 s)
        spans_before = receiver.count
        started = time.monotonic()
        streams = asyncio.run(_rounds(server.base_url, args.concurrency, args.max_tokens, args.seconds))
        elapsed = time.monotonic() - started
    ok = [s for s in streams if s.error is None]
    return {
        "mode": mode,
        **outcome(streams, elapsed),
        "output_tok_s": sum(s.completion_tokens for s in ok) / elapsed,
        "ttft_p50": percentile([s.ttft for s in ok if s.ttft is not None], 50),
        "tpot_p50": percentile([s.tpot for s in ok if s.tpot is not None], 50),
        "spans": receiver.count - spans_before,
    }


def _markdown(report: dict[str, Any]) -> str:
    rows = []
    for mode in MODES:
        m = report["summary"][mode]
        rows.append(
            [
                mode,
                fmt(m["requests_per_s"]),
                fmt(m["output_tok_s"], digits=0),
                fmt(m["ttft_p50"], 1e3, 1),
                fmt(m["tpot_p50"], 1e3, 2),
                f"{m['spans_per_request']:.1f}",
            ]
        )
    r = report["ratios"]
    lines = [
        "# Tracing off vs on (OTLP/HTTP, every request traced)",
        "",
        f"{report['date']}, commit {report['commit']}, {report['machine']['cpu_model']} "
        f"({report['machine']['online_cpus']} CPUs), load average {report['load_avg_start']} -> "
        f"{report['load_average_end']}",
        "",
        f"`{report['command']}`",
        "",
        f"Medians of {report['args']['repeats']} runs per mode (alternated), {report['args']['concurrency']} "
        f"concurrent streams of {report['args']['max_tokens']} tokens for {report['args']['seconds']:g} s each.",
        "",
        *table(
            ["tracing", "requests/s", "output tok/s", "TTFT p50 ms", "TPOT p50 ms", "spans/request"], rows
        ),
        "",
        f"On/off: requests/s x{fmt(r['requests_per_s'], digits=3)}, output tok/s x{fmt(r['output_tok_s'], digits=3)}, "
        f"TTFT p50 x{fmt(r['ttft_p50'], digits=3)}, TPOT p50 x{fmt(r['tpot_p50'], digits=3)}.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    add_output_args(parser)
    args = parser.parse_args()
    report: dict[str, Any] = provenance()
    report["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    runs: list[dict[str, Any]] = []
    with trace_receiver(keep=False) as receiver, tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
                run = _measure(mode, args, receiver, Path(tmp))
                runs.append({**run, "repeat": repeat})
                progress(
                    f"{mode} #{repeat}: {run['requests_per_s']:.2f} req/s, {run['output_tok_s']:.0f} tok/s, "
                    f"{run['failed']} failed, {run['spans']} spans"
                )
    report["runs"] = runs
    report["load_average_end"] = load_average()
    summary = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        summary[mode] = {
            k: median(r[k] for r in mine) for k in ("requests_per_s", "output_tok_s", "ttft_p50", "tpot_p50")
        }
        summary[mode]["spans_per_request"] = sum(r["spans"] for r in mine) / max(
            1, sum(r["requests"] for r in mine)
        )
    report["summary"] = summary
    report["ratios"] = {
        k: ratio(summary["on"][k], summary["off"][k])
        for k in ("requests_per_s", "output_tok_s", "ttft_p50", "tpot_p50")
    }
    save_report(report, _markdown(report), args.out, args.markdown)
    plot_result(args.out)


if __name__ == "__main__":
    main()
