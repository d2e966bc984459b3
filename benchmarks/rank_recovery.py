r"""Time from a rank's kill -9 to the next delivered token: migration alone, elastic EP, and a
whole-pool restart, for expert-parallel pools of 2 and 4 ranks.

Each (mode, pool size) runs one all-in-one ``dsinfer serve`` of colocated pools (the built-in tiny
model with dummy weights, float32, CPU, one torch thread per rank; colocated keeps the process
count down: a decode rank of a PD pair recovers the same way, its continuation prefilled on a
prefill rank instead):

- ``restart`` (what dsinfer did before migration and elastic EP): one pool of N ranks,
  ``--no-elastic-ep --max-migrations 0``: the pool restarts whole and the streams it held end
  with an error; the next token is the first one of a new request, sent every 0.1 s after the
  kill (each gets 503 until the restarted pool registers).
- ``migration``: two pools of N ranks, ``--no-elastic-ep``: the killed rank's pool restarts
  whole, and every stream it held moves to the other pool as a continuation.
- ``elastic``: one pool of N ranks (elastic EP): the survivors re-form their group and serve on,
  the killed rank's streams move to them as continuations, the rank restarts alone and rejoins.

Per repeat, ``--streams`` streamed completions (``--prompt-len`` random token ids, up to
``--output-len`` tokens, greedy, ``ignore_eos``, ``logprobs=0`` so each chunk says how many tokens
it carries) run; once every stream decodes and ``--kill-after`` s more passed, rank 1 of pool 0
gets SIGKILL. The streams the kill moved are those the gateway's log names as moved after the
kill. Reported: kill to the next token of each moved stream, the first one computed after the
move (tokens already on their way do not count; median and max; ``restart``: kill to the first
token of a new request), the longest gap between tokens in the 10 s after the kill of the
streams that stayed where they were (elastic: the survivors' stall while they re-form), the
streams that ended in an error, and kill to the pool being whole again (the killed rank
restarted, every rank healthy); the next repeat starts once it is. Per (mode, size): medians
over the repeats. The load average is recorded at each kill: compare only numbers taken on a
quiet machine (about 15 min there):

    python benchmarks/rank_recovery.py --repeats 3 \
        --out benchmarks/results/rank_recovery.json --markdown benchmarks/results/rank_recovery.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from harness import results
from harness.clients import Stream, client_for, completion_body, stream_completion
from harness.metrics import GATEWAY, scrape_async, wait_healthy_count
from harness.plots import plot_result
from harness.progress import progress
from harness.provenance import command_line, git, git_commit, machine_info, utc_now
from harness.server import TINY_CPU, Server, add_serving_args, serve

VOCAB_SIZE, FIRST_TOKEN_ID = 4096, 2  # the tiny preset's vocabulary; 0/1 are BOS/EOS
MODES = {
    "restart": (1, ["--no-elastic-ep", "--max-migrations", "0"]),
    "migration": (2, ["--no-elastic-ep"]),
    "elastic": (1, []),
}  # mode -> (pools, flags)
# the gateway's line for each choice it moves (dsinfer/gateway/router.py)
MOVED = re.compile(
    r"(cmpl-[0-9a-f]+)/\d+(?:~\d+)?: .*; moving it as attempt \d+ after (\d+) delivered tokens"
)
STALL_WINDOW = 10.0  # s after the kill in which the unmoved streams' longest gap is taken


def server_flags(args: argparse.Namespace, mode: str, size: int) -> list[str]:
    pools, extra = MODES[mode]
    return [
        *TINY_CPU,
        *("--colocated", "--decode-pools", str(pools), "--decode-pool-size", str(size)),
        *("--threads-per-rank", "1", "--kv-cache-memory", args.kv_cache_memory, "--drain-timeout", "5"),
        *("--max-num-seqs", str(max(args.streams, 8))),
        *extra,
    ]  # fmt: skip


async def stream_one(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, out: Stream | None = None
) -> Stream:
    return await stream_completion(client, url, completion_body(prompt, max_tokens, logprobs=0), out=out)


async def first_new_token(
    client: httpx.AsyncClient, url: str, prompt: list[int], deadline: float
) -> float | None:
    """perf_counter time of the first token of a new request, one sent every 0.1 s until one streams."""
    while time.perf_counter() < deadline:
        got = (await stream_one(client, url, prompt, 2)).token_chunks
        if got:
            return got[0][0]
        await asyncio.sleep(0.1)
    return None


async def whole(client: httpx.AsyncClient, url: str, ranks: int) -> float:
    """perf_counter time once the gateway, after it counted fewer, counts ``ranks`` healthy ranks
    again (started at the kill, beside the streams)."""
    deadline, seen_down = time.perf_counter() + 300.0, False
    while time.perf_counter() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            workers = await scrape_async(client, url)
            healthy = sum(1 for w, m in workers.items() if w != GATEWAY and m.get("healthy") == 1)
            if healthy < ranks:
                seen_down = True
            elif seen_down:
                return time.perf_counter()
        await asyncio.sleep(0.1)
    raise TimeoutError("pool not whole again after 300 s")


def moved_streams(log_path: Path, offset: int) -> dict[str, int]:
    """Completion id -> tokens it had delivered when the gateway moved it, for the first move of
    each that its log names after byte ``offset``."""
    with log_path.open("rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    moved: dict[str, int] = {}
    for m in MOVED.finditer(text):
        moved.setdefault(m.group(1), int(m.group(2)))
    return moved


def longest_gap(stream: Stream, start: float, end: float) -> float | None:
    """The longest wait between tokens from ``start`` (from the stream's last token before it)
    through ``end``."""
    times = [t for t, _ in stream.token_chunks]
    before = [t for t in times if t <= start]
    window = [before[-1]] if before else []
    window += [t for t in times if start < t <= end]
    gaps = [b - a for a, b in itertools.pairwise(window)]
    return max(gaps) if gaps else None


async def one_kill(
    url: str, server: Server, args: argparse.Namespace, mode: str, ranks: int, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)

    def prompt() -> list[int]:
        return [rng.randrange(FIRST_TOKEN_ID, VOCAB_SIZE) for _ in range(args.prompt_len)]

    async with client_for(args.streams) as client:
        await wait_healthy_count(client, url, ranks, 300.0)
        streams = [Stream(time.perf_counter()) for _ in range(args.streams)]
        tasks = [asyncio.create_task(stream_one(client, url, prompt(), args.output_len, s)) for s in streams]
        deadline = time.perf_counter() + 300.0
        while not all(len(s.chunks) >= 2 or s.error for s in streams):  # every stream decodes
            if time.perf_counter() > deadline:
                raise TimeoutError("streams did not start within 300 s")
            await asyncio.sleep(0.05)
        await asyncio.sleep(args.kill_after)
        [victim] = server.rank_pids(pool=0, rank=1)
        load, log_offset = os.getloadavg()[0], server.log_path.stat().st_size
        os.kill(victim, signal.SIGKILL)
        killed = time.perf_counter()
        back_again = asyncio.create_task(whole(client, url, ranks))
        probe = None
        if mode == "restart":
            probe = await first_new_token(client, url, prompt(), killed + 300.0)
        await asyncio.gather(*tasks)
        back = await back_again
    moved = moved_streams(server.log_path, log_offset)
    recovered: list[float] = []  # kill to a moved stream's first token computed after the move
    stalled: list[float] = []  # the unmoved streams' longest gaps after the kill
    for s in streams:
        if s.request_id in moved:
            at = s.time_of_token(moved[s.request_id])
            if at is not None:
                recovered.append(at - killed)
        elif probe is None and (gap := longest_gap(s, killed, killed + STALL_WINDOW)) is not None:
            stalled.append(gap)
    if probe is not None:
        recovered = [probe - killed]
    return {
        "kill_to_token_median_s": statistics.median(recovered) if recovered else None,
        "kill_to_token_max_s": max(recovered) if recovered else None,
        "moved_streams": len(moved),
        "others_max_gap_s": max(stalled) if stalled else None,
        "failed_streams": sum(1 for s in streams if s.error),
        "kill_to_whole_s": back - killed,
        "load_at_kill": load,
    }


SUMMARY_COLUMNS = (
    "mode", "kill to next token, median s", "max s", "streams moved", "others' longest gap s",
    "streams failed", "kill to pool whole again s", "repeats",
)  # fmt: skip
RUN_COLUMNS = (
    "repeat", "mode", "EP", "next token median / max s", "moved", "others' gap s", "failed", "whole again s", "load",
)  # fmt: skip
SUMMARY_FIELDS = (
    "kill_to_token_median_s",
    "kill_to_token_max_s",
    "moved_streams",
    "others_max_gap_s",
    "failed_streams",
    "kill_to_whole_s",
)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def markdown(report: dict[str, Any]) -> str:
    a = report["args"]
    lines = [
        "# Kill -9 of a rank to the next delivered token (benchmarks/rank_recovery.py)",
        "",
        *results.report_header(report),
        f"- workload: {a['streams']} streamed requests, {a['prompt_len']} prompt tokens, up to "
        f"{a['output_len']} output tokens, greedy; rank 1 of pool 0 killed {a['kill_after']:g} s in; "
        f"colocated pools, one torch thread per rank; {a['repeats']} repeat(s)",
        f"- load average (1 min) at the kills: {min(r['load_at_kill'] for r in report['runs']):.2f} to "
        f"{max(r['load_at_kill'] for r in report['runs']):.2f}",
    ]
    summary = [
        (key, _s(r["kill_to_token_median_s"]), _s(r["kill_to_token_max_s"]), f"{r['moved_streams']:g}",
         _s(r["others_max_gap_s"]), f"{r['failed_streams']:g}", _s(r["kill_to_whole_s"]), r["repeats"])
        for key, r in report["summary"].items()
    ]  # fmt: skip
    lines += ["", *results.table(SUMMARY_COLUMNS, summary, "lrrrrrrr")]
    lines += [
        "",
        "`restart`: kill to the first token of a new request (the streams of the killed pool fail); "
        "`migration` and `elastic`: kill to the next token of each stream the gateway moved. "
        "Others' longest gap: the longest wait between two tokens, in the 10 s after the kill, of "
        "the streams that stayed on their rank (elastic: they wait while the survivors re-form).",
        "",
        "Runs (in order):",
        "",
    ]
    runs = [
        (r["repeat"], r["mode"], r["ep"], f"{_s(r['kill_to_token_median_s'])} / {_s(r['kill_to_token_max_s'])}",
         r["moved_streams"], _s(r["others_max_gap_s"]), r["failed_streams"], _s(r["kill_to_whole_s"]),
         f"{r['load_at_kill']:.2f}")
        for r in report["runs"]
    ]  # fmt: skip
    lines += results.table(RUN_COLUMNS, runs, "rlrlrrrrr")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--sizes", default="2,4", help="ranks per pool (EP sizes)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--kill-after", type=float, default=2.0, help="seconds after every stream decodes")
    add_serving_args(parser, output_len=400)
    args = parser.parse_args(argv)
    modes = results.choose(parser, args.modes, MODES, "mode")
    runs = []
    with tempfile.TemporaryDirectory(prefix="rank_recovery-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        for size in (int(s) for s in args.sizes.split(",")):
            for mode in modes:
                name = f"{mode}-ep{size}"
                ranks = MODES[mode][0] * size
                with serve(
                    server_flags(args, mode, size), log_dir, name=name, startup_timeout=300.0
                ) as server:
                    for repeat in range(args.repeats):
                        result = asyncio.run(
                            one_kill(server.base_url, server, args, mode, ranks, args.seed + repeat)
                        )
                        progress(
                            f"[{name} r{repeat}] next token {_s(result['kill_to_token_median_s'])} s "
                            f"(max {_s(result['kill_to_token_max_s'])}), {result['failed_streams']} failed, "
                            f"whole again {result['kill_to_whole_s']:.2f} s, load {result['load_at_kill']:.2f}"
                        )
                        runs.append({"repeat": repeat, "mode": mode, "ep": size, **result})
    report = {
        "date": utc_now(),
        "machine": machine_info(),
        "commit": git_commit(),
        "command": command_line(),
        "args": results.jsonable_args(args),
        "runs": runs,
        "summary": results.summarize_runs(
            runs,
            lambda r: (r["mode"], r["ep"]),
            SUMMARY_FIELDS,
            name=lambda k: f"{k[0]} EP{k[1]}",
            order=lambda k: (k[1], list(MODES).index(str(k[0]))),
        ),
    }
    results.save_report(report, markdown(report), args.out, args.markdown)
    plot_result(args.out)
    return 0


if __name__ == "__main__":
    git("rev-parse", "HEAD")
    sys.exit(main())
