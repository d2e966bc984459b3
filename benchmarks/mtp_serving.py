"""MTP through ``dsinfer serve``: output tok/s of the all-in-one PD server with and without
``--speculative-mtp`` (``--num-steps N``: with ``--speculative-num-steps N``), at one stream and at 16.

The built-in model (``tiny-chat``) in float32, served the default way (one prefill and one
decode pool, KV over the transfer library). The workload: chat completions of the model's
worked multiplications (``mul``: replies of about 40 tokens its MTP layer drafts at about 100%),
greedy, to EOS, not streamed. Both servers run at once (the one not being timed is idle), each
warmed with one pass; then, per concurrency, ``--repeats`` pairs of passes, one on each server
back to back (which goes first alternates). The speed-up is the median of the pairs' ratios, so
that a drift of the shared machine, which moves both passes of a pair alike, falls out of it.
``--rounds`` starts both servers afresh that many times. A pass at concurrency C sends
``C * --requests-per-stream`` requests, C in flight; output tok/s = completion tokens (from each
response's usage) over the pass's wall time. The MTP server's acceptance comes from its
``/metrics`` (dsinfer_spec_decode_*).

    .venv/bin/python benchmarks/mtp_serving.py --out benchmarks/results/mtp_serving.json \\
        --markdown benchmarks/results/mtp_serving.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
import shlex
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from dsinfer.evals.tasks import make_question
from harness.progress import progress
from harness.provenance import load_average, run_machine
from harness.results import add_output_args, machine_lines, save_report, table
from harness.server import Server, serve

MAX_TOKENS = 256
MODES = ("plain", "mtp")


def _flags(mode: str, num_steps: int, extra: str) -> list[str]:
    mtp = ["--speculative-mtp", "--speculative-num-steps", str(num_steps)]
    return ["--dtype", "float32", *shlex.split(extra), *(mtp if mode == "mtp" else [])]


async def _one(client: httpx.AsyncClient, url: str, question: str) -> int:
    body = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
    }
    resp = await client.post(f"{url}/v1/chat/completions", json=body)
    resp.raise_for_status()
    return int(resp.json()["usage"]["completion_tokens"])


async def _pass(url: str, questions: list[str], concurrency: int) -> dict[str, float]:
    pending = list(questions)
    tokens: list[int] = []

    async def stream(client: httpx.AsyncClient) -> None:
        while pending:
            tokens.append(await _one(client, url, pending.pop()))

    async with httpx.AsyncClient(timeout=300) as client:
        start = time.perf_counter()
        await asyncio.gather(*(stream(client) for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return {"tokens": sum(tokens), "seconds": seconds, "tok_s": sum(tokens) / seconds}


def _acceptance(server: Server) -> tuple[float, float]:
    text = server.metrics()
    counts = [
        sum(float(v) for v in re.findall(rf"^{name}_total\{{[^}}]*\}} (\S+)$", text, re.M))
        for name in ("dsinfer_spec_decode_draft_tokens", "dsinfer_spec_decode_accepted_tokens")
    ]
    return counts[0], counts[1]


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    questions = [
        make_question("mul", rng).prompt for _ in range(max(concurrencies) * args.requests_per_stream)
    ]
    passes: list[dict[str, Any]] = []
    ratios: dict[int, list[float]] = {c: [] for c in concurrencies}
    drafts = [0.0, 0.0]
    log_dir = Path(tempfile.mkdtemp(prefix="mtp-serving-"))
    for round_ in range(args.rounds):
        with contextlib.ExitStack() as stack:
            servers = {
                mode: stack.enter_context(
                    serve(
                        _flags(mode, args.num_steps, args.server_flags),
                        log_dir,
                        startup_timeout=args.start_timeout,
                        say=progress,
                    )
                )
                for mode in MODES
            }
            for server in servers.values():  # warm-up
                asyncio.run(_pass(server.base_url, questions[: max(concurrencies)], max(concurrencies)))
            before = _acceptance(servers["mtp"])
            for concurrency in concurrencies:
                count = concurrency * args.requests_per_stream
                for rep in range(args.repeats):
                    pair = {}
                    for mode in MODES if (rep + round_) % 2 == 0 else MODES[::-1]:
                        pair[mode] = asyncio.run(
                            _pass(servers[mode].base_url, questions[:count], concurrency)
                        )
                        passes.append(
                            {"mode": mode, "concurrency": concurrency, "round": round_, **pair[mode]}
                        )
                    ratios[concurrency].append(pair["mtp"]["tok_s"] / pair["plain"]["tok_s"])
                    progress(
                        f"C={concurrency} pair {rep}: plain {pair['plain']['tok_s']:.0f}, "
                        f"MTP {pair['mtp']['tok_s']:.0f} tok/s ({ratios[concurrency][-1]:.2f}x)"
                    )
            after = _acceptance(servers["mtp"])
            drafts = [d + a - b for d, a, b in zip(drafts, after, before, strict=True)]
    rows = []
    for concurrency in concurrencies:
        tok_s = {
            mode: statistics.median(p["tok_s"] for p in passes if p["mode"] == mode and p["concurrency"] == concurrency)
            for mode in MODES
        }  # fmt: skip
        paired = ratios[concurrency]
        rows.append(
            {
                "concurrency": concurrency,
                **tok_s,
                "speedup": statistics.median(paired),
                "speedup_range": [min(paired), max(paired)],
            }
        )
    return {"rows": rows, "passes": passes, "acceptance": drafts[1] / drafts[0] if drafts[0] else None}


def markdown(result: dict[str, Any]) -> str:
    rows = [
        (
            r["concurrency"],
            f"{r['plain']:,.0f}",
            f"{r['mtp']:,.0f}",
            f"{r['speedup']:.2f}x ({r['speedup_range'][0]:.2f}-{r['speedup_range'][1]:.2f})",
        )
        for r in result["rows"]
    ]
    acceptance = result["acceptance"]
    return "\n".join(
        [
            f"# MTP through dsinfer serve (all-in-one PD, tiny-chat, float32, {result.get('num_steps', 1)} "
            "draft(s) a step)",
            "",
            *machine_lines(result["machine"]),
            f"- device {result.get('device', 'cpu')}"
            + (f"; both servers with `{result['server_flags']}`" if result.get("server_flags") else ""),
            f"- both servers up at once, {result['rounds']} round(s) of fresh servers, {result['repeats']} "
            f"pairs of passes per concurrency each (one pass per server, back to back); MTP acceptance "
            f"{acceptance:.1%}"
            if acceptance is not None
            else "- no drafts seen",
            "",
            "Output tok/s (medians of the passes); speed-up: the median of the pairs' ratios (their range):",
            "",
            *table(("streams", "plain", "MTP", "speed-up"), rows, "rrrr"),
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--requests-per-stream", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-timeout", type=float, default=300)
    parser.add_argument(
        "--server-flags",
        default="",
        help="more flags for both servers, e.g. '--kv-cache-memory 2GiB' when both share one GPU",
    )
    parser.add_argument("--num-steps", type=int, default=1, help="the MTP server's --speculative-num-steps")
    add_output_args(parser)
    args = parser.parse_args()
    machine = run_machine()
    result = {
        "machine": machine,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "num_steps": args.num_steps,
        "server_flags": args.server_flags,
        # the servers' --device auto, unless their flags say otherwise
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        **run(args),
    }
    machine["load_after"] = load_average()
    save_report(result, markdown(result), args.out, args.markdown)


if __name__ == "__main__":
    main()
