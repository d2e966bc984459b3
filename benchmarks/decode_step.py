r"""Per-step time of a 2-rank decode pool, served for real, on two commits (before and after a change).

Each run starts an all-in-one ``dsinfer serve`` (gateway, a prefill pool of one rank, a decode pool
of two ranks; the built-in tiny model with dummy weights, float32, CPU, one torch thread per rank)
on a clean ``git archive`` of the commit (``harness.provenance.export_commit``), warms it up, then sends
``--concurrency`` streamed completions at once (prompts of ``--prompt-len`` random token ids,
``--output-len`` tokens with ``ignore_eos``, greedy, ``logprobs=0`` so each chunk says how many
tokens it carries). While every request is decoding (from the last first token to the first last
token) each decode step gives each request one token, so the gaps between a request's token chunks
are the pool's step period: everything a step costs, the forward and the rank loop around it (the
per-step agreement, control messages). Reported per run: the median and p90 of those gaps (ms per
step) and output tokens/s over that window; per (commit, setting) the median over repeats.

Settings (``--settings``): ``default``; ``overlap`` (``--enable-overlap``: before issue 16 the
model runner agreed on the micro-batches in an all-reduce of its own every step, besides the
rank loop's flags). Commits and settings alternate order from one repeat to the next, so a drift
in the machine's load does not always favour the same one. The load average is recorded at the
start and end of every run: compare only numbers taken on a quiet machine.

    /work/venv/bin/python benchmarks/decode_step.py --commits main,HEAD --repeats 3 \
        --out benchmarks/results/decode_step.json --markdown benchmarks/results/decode_step.md
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness import results
from harness.clients import Stream, client_for, completion_body, stream_all
from harness.metrics import wait_healthy_count
from harness.plots import plot_result
from harness.progress import progress
from harness.provenance import command_line, export_commit, git, machine_info, utc_now
from harness.server import TINY_CPU, add_serving_args, serve

VOCAB_SIZE, FIRST_TOKEN_ID = 4096, 2  # the tiny preset's vocabulary; 0/1 are BOS/EOS
RANKS = 3  # prefill/0/0, decode/0/0, decode/0/1
SETTINGS = {"default": [], "overlap": ["--enable-overlap"]}


def server_flags(args: argparse.Namespace, setting: str) -> list[str]:
    return [
        *TINY_CPU,
        *("--prefill-pool-size", "1", "--decode-pool-size", "2"),
        *("--threads-per-rank", "1", "--kv-cache-memory", args.kv_cache_memory, "--drain-timeout", "5"),
        *("--max-num-seqs", str(max(args.concurrency, 8))),
        *SETTINGS[setting],
    ]  # fmt: skip


def step_gaps(streams: list[Stream]) -> tuple[list[float], float, float]:
    """Per-token gaps inside the window where every request decodes -> (gaps, window s, tokens)."""
    chunks = [s.token_chunks for s in streams]
    start = max(c[0][0] for c in chunks)
    end = min(c[-1][0] for c in chunks)
    gaps, tokens = [], 0
    for c in chunks:
        for (t0, _), (t1, n) in itertools.pairwise(c):
            if start <= t0 and t1 <= end:
                gaps += [(t1 - t0) / n] * n
                tokens += n
    return gaps, end - start, tokens


async def measure(url: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)

    def body(max_tokens: int) -> dict[str, Any]:
        prompt = [rng.randrange(FIRST_TOKEN_ID, VOCAB_SIZE) for _ in range(args.prompt_len)]
        return completion_body(prompt, max_tokens, logprobs=0)

    async with client_for(args.concurrency) as client:
        await wait_healthy_count(client, url, RANKS, 300.0)
        for _ in range(2):  # warm-up: both decode ranks compile and run a batch
            warm = await stream_all(client, url, [body(8) for _ in range(4)])
            if any(s.error for s in warm):
                raise RuntimeError(f"warm-up failed: {next(s.error for s in warm if s.error)}")
        load_start = os.getloadavg()[0]
        streams = await stream_all(client, url, [body(args.output_len) for _ in range(args.concurrency)])
        load_end = os.getloadavg()[0]
    errors = [s.error for s in streams if s.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    gaps, window, tokens = step_gaps(streams)
    if len(gaps) < 10:
        raise RuntimeError(f"only {len(gaps)} steps inside the steady window ({window:.2f} s)")
    ordered = sorted(gaps)
    return {
        "step_ms_median": 1e3 * statistics.median(gaps),
        "step_ms_p90": 1e3 * ordered[int(0.9 * (len(ordered) - 1))],
        "steady_window_s": window,
        "output_tok_s": tokens / window if window > 0 else None,
        "gaps": len(gaps),
        "load_start": load_start,
        "load_end": load_end,
    }


def markdown(report: dict[str, Any]) -> str:
    a = report["args"]
    lines = [
        "# Per-step time of a 2-rank decode pool (benchmarks/decode_step.py)",
        "",
        *results.report_header(report),
        "- commits: " + ", ".join(f"{c['label']} = {c['sha']}" for c in report["commits"]),
        f"- workload: {a['concurrency']} streamed requests at once, {a['prompt_len']} prompt tokens, "
        f"{a['output_len']} output tokens, greedy; one torch thread per rank; {a['repeats']} repeat(s)",
        f"- load average (1 min) over the runs: {min(r['load_start'] for r in report['runs']):.2f} to "
        f"{max(r['load_end'] for r in report['runs']):.2f}",
    ]
    summary = [
        (
            *key.split(" ", 1),
            f"{r['step_ms_median']:.1f}",
            f"{r['step_ms_p90']:.1f}",
            f"{r['output_tok_s']:.0f}",
            r["repeats"],
        )
        for key, r in report["summary"].items()
    ]
    lines += [
        "",
        *results.table(
            ("commit", "setting", "step ms (median)", "step ms (p90)", "output tok/s", "repeats"),
            summary,
            "llrrrr",
        ),
    ]
    runs = [
        (r["repeat"], r["label"], r["setting"], f"{r['step_ms_median']:.1f}", f"{r['step_ms_p90']:.1f}",
         f"{r['load_start']:.2f} / {r['load_end']:.2f}")
        for r in report["runs"]
    ]  # fmt: skip
    lines += ["", "Runs (in order):", ""]
    lines += results.table(
        ("repeat", "commit", "setting", "step ms", "p90", "load start/end"), runs, "rllrrl"
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--commits", default="main,HEAD", help="comma-separated revisions (first = before)")
    parser.add_argument("--settings", default="default,overlap")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    add_serving_args(parser, output_len=96)
    args = parser.parse_args(argv)
    settings = results.choose(parser, args.settings, SETTINGS, "setting")
    with tempfile.TemporaryDirectory(prefix="decode_step-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        commits = []
        for i, rev in enumerate(args.commits.split(",")):
            sha, source = export_commit(rev, Path(tmp) / f"src{i}")
            commits.append({"label": f"{rev}", "sha": sha, "source": source})
        runs = []
        for repeat in range(args.repeats):
            order = [(c, s) for s in settings for c in commits]
            for commit, setting in order if repeat % 2 == 0 else order[::-1]:
                name = f"{commit['label']}-{setting}-r{repeat}"
                flags = server_flags(args, setting)
                with serve(
                    flags, log_dir, name=name, startup_timeout=300.0, source=commit["source"]
                ) as server:
                    result = asyncio.run(measure(server.base_url, args, args.seed + repeat))
                progress(
                    f"[{name}] step {result['step_ms_median']:.1f} ms (p90 {result['step_ms_p90']:.1f}), "
                    f"load {result['load_start']:.2f} -> {result['load_end']:.2f}"
                )
                runs.append({"repeat": repeat, "label": commit["label"], "setting": setting, **result})
    report = {
        "date": utc_now(),
        "machine": machine_info(),
        "command": command_line(),
        "commits": [{"label": c["label"], "sha": c["sha"]} for c in commits],
        "args": results.jsonable_args(args),
        "runs": runs,
        "summary": results.summarize_runs(
            runs, lambda r: (r["label"], r["setting"]), ("step_ms_median", "step_ms_p90", "output_tok_s")
        ),
    }
    results.save_report(report, markdown(report), args.out, args.markdown)
    plot_result(args.out)
    return 0


if __name__ == "__main__":
    git("rev-parse", "HEAD")  # a checkout is needed for the exports
    sys.exit(main())
