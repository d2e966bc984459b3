"""A lone request's latency and a burst's throughput through ``dsinfer serve``, on two commits.

An idle rank that gets requests may wait for the rest of their burst before its first step, so
that a burst of clients starts in one prefill (dsinfer/workers/step_loop.py); a lone request must
not pay for that wait. Each (commit, topology) serves the bench checkpoint
(benchmarks/make_bench_checkpoint.py) on a clean ``git archive`` of the commit
(``harness.provenance.export_commit``), is warmed with one burst, then measured:

- burst: ``--burst`` completions of ``--input-len`` random token ids sent at once, ``--output-len``
  tokens each (greedy, ``ignore_eos``, not streamed); output tok/s over the pass's wall time,
  the median of ``--passes`` passes;
- lone: ``--lone`` completions of one token each, one after another; the median wall time of a
  request (what a client waits for its first token, prefill and the PD handoff included).

Topologies: ``pd`` (the default all-in-one server: a prefill and a decode rank, KV over the
transfer library) and ``colocated``. Commits alternate order from one repeat to the next.

    .venv/bin/python benchmarks/lone_and_burst.py --commits f16c222,HEAD --repeats 2 \\
        --out benchmarks/results/lone_and_burst.json --markdown benchmarks/results/lone_and_burst.md
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from harness.clients import completion_body
from harness.progress import progress
from harness.provenance import export_commit, load_average, run_machine
from harness.results import add_output_args, jsonable_args, machine_lines, save_report, table
from harness.server import serve

TOPOLOGIES = {"pd": [], "colocated": ["--colocated"]}


async def _burst(url: str, model: str, prompts: list[list[int]], output_len: int) -> float:
    async with httpx.AsyncClient(timeout=300) as client:
        started = time.perf_counter()
        answers = await asyncio.gather(
            *(
                client.post(
                    f"{url}/v1/completions", json=completion_body(p, output_len, model=model, stream=False)
                )
                for p in prompts
            )
        )
        seconds = time.perf_counter() - started
    for answer in answers:
        answer.raise_for_status()
    return sum(a.json()["usage"]["completion_tokens"] for a in answers) / seconds


def _lone(url: str, model: str, prompts: list[list[int]]) -> float:
    times = []
    with httpx.Client(timeout=60) as client:
        for prompt in prompts:
            started = time.perf_counter()
            client.post(
                f"{url}/v1/completions", json=completion_body(prompt, 1, model=model, stream=False)
            ).raise_for_status()
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(2, args.vocab_size) for _ in range(args.input_len)] for _ in range(args.burst)]
    model = args.model.name
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        commits = [
            (rev, *export_commit(rev, Path(tmp) / f"src{i}")) for i, rev in enumerate(args.commits.split(","))
        ]
        for repeat in range(args.repeats):
            order = commits if repeat % 2 == 0 else commits[::-1]
            for topology in args.topologies.split(","):
                for rev, sha, source in order:
                    flags = ["--model", str(args.model), "--dtype", args.dtype, *TOPOLOGIES[topology]]
                    load_before = load_average()
                    with serve(flags, Path(tmp), startup_timeout=args.start_timeout, source=source) as server:
                        url = server.base_url
                        asyncio.run(_burst(url, model, prompts, args.output_len))  # warm-up
                        bursts = [
                            asyncio.run(_burst(url, model, prompts, args.output_len))
                            for _ in range(args.passes)
                        ]
                        lone_ms = _lone(url, model, prompts[: args.lone])
                    entry = {
                        "repeat": repeat, "topology": topology, "commit": rev, "sha": sha,
                        "burst_tok_s": statistics.median(bursts), "burst_passes": bursts, "lone_ms": lone_ms,
                        "load_before": load_before, "load_after": load_average(),
                    }  # fmt: skip
                    runs.append(entry)
                    progress(
                        f"{repeat} {topology} {rev}: burst {entry['burst_tok_s']:.0f} tok/s, lone {lone_ms:.1f} ms"
                    )
    rows = []
    for topology in args.topologies.split(","):
        for rev, sha, _ in commits:
            mine = [r for r in runs if r["topology"] == topology and r["commit"] == rev]
            rows.append(
                {
                    "topology": topology, "commit": rev, "sha": sha[:12],
                    "burst_tok_s": statistics.median(r["burst_tok_s"] for r in mine),
                    "lone_ms": statistics.median(r["lone_ms"] for r in mine),
                }
            )  # fmt: skip
    return {"rows": rows, "runs": runs}


def markdown(result: dict[str, Any]) -> str:
    args = result["args"]
    rows = [
        (r["topology"], f"{r['commit']} ({r['sha']})", f"{r['burst_tok_s']:,.0f}", f"{r['lone_ms']:.1f}")
        for r in result["rows"]
    ]
    return "\n".join(
        [
            "# A lone request's latency and a burst's throughput (dsinfer serve, two commits)",
            "",
            *machine_lines(result["machine"]),
            f"- checkpoint `{args['model']}` in {args['dtype']}; burst: {args['burst']} completions of "
            f"{args['input_len']} tokens in, {args['output_len']} out, sent at once ({args['passes']} passes); "
            f"lone: {args['lone']} one-token completions one after another",
            f"- {args['repeats']} repeats, commits alternating; medians over the repeats",
            "",
            *table(("topology", "commit", "burst output tok/s", "lone request ms"), rows, "llrr"),
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--commits", default="HEAD~1,HEAD")
    parser.add_argument("--topologies", default="pd,colocated")
    parser.add_argument("--model", type=Path, default=Path("/work/bench-scratch/ckpt/tiny-f32"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--burst", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--lone", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-timeout", type=float, default=300)
    add_output_args(parser)
    args = parser.parse_args()
    machine = run_machine()
    result = {"machine": machine, "args": jsonable_args(args), **run(args)}
    machine["load_after"] = load_average()
    save_report(result, markdown(result), args.out, args.markdown)


if __name__ == "__main__":
    main()
