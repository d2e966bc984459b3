r"""Replay of Mooncake's conversation trace against ``dsinfer serve`` with each KV tier setting:
what share of the input tokens each tier serves, next to what the trace allows, and TTFT.

The trace (benchmarks/data/mooncake/, harness/traces.py) names each 512-token prompt block by a
hash id; here each id becomes ``--block-tokens`` tokens (a whole KV page: 64), the same tokens for
the same id, so the replay shares exactly the prefixes the trace shares at 1/8 of its lengths.
The machine cannot prefill the whole trace as fast as it came, so ``--keep N`` plays 1 in N of its
prefix trees (requests whose first block is one of a random 1/N of the first blocks: what they
share among themselves is kept). Requests go out at their timestamps sped up ``--speedup`` times, each a stream of
``--max-tokens`` tokens; a prompt longer than the model's context is cut to fit.

Settings (the all-in-one PD server on the random-weight ``tiny`` model, or ``--checkpoint``; the
decode pool's KV is not what is measured, the prefill ranks' caches are):
- ``off``: ``--no-prefix-caching``;
- ``device``: the prefix cache in the rank's KV pool only (``--kv-cache-memory``, small on
  purpose; ``--kv-host-cache-size 0``);
- ``host``: the same plus the host-memory tier (``--kv-host-cache-size``);
- ``disk``: the same plus the on-disk tier (``--kv-disk-cache-dir``);
- ``shared``: two prefill pools of one rank over one disk directory (the cluster-wide tier), the
  prefill balancer weighing each rank's prefix by tier;
- ``vllm``: vLLM's CPU server (``--vllm-python``) on ``--checkpoint`` with its prefix cache, in
  its smallest KV space (1 GiB; it counts hits in ``vllm:prefix_cache_hits``).

Reported per setting: the share of input tokens served from each tier (the prefill ranks'
``dsinfer_prefix_cache_hit_tokens_total`` by tier over ``dsinfer_worker_prompt_tokens_total``),
TTFT p50 and p90, requests/s; and the trace's ideal share (an unbounded cache) over the same
requests.

    python benchmarks/kv_replay.py --minutes 10 --keep 8 --out benchmarks/results/kv_replay.json \
        --markdown benchmarks/results/kv_replay.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from dsinfer.base.processes import free_port
from harness.aiperf import run_aiperf, write_mooncake_trace
from harness.clients import Stream, client_for, completion_body, outcome, stream_completion
from harness.plots import plot_result
from harness.progress import progress
from harness.provenance import provenance
from harness.results import add_output_args, fmt, percentile, report_header, save_report, table
from harness.server import TINY_CPU, Server, engine_env, running, serve
from harness.traces import TraceRequest, ideal_hit_share, load_trace, replay_prompts, thin

TRACE = Path(__file__).resolve().parent / "data/mooncake/conversation_trace_20min.jsonl"
SETTINGS = ("off", "device", "host", "disk", "shared", "vllm")
TIERS = ("memory", "host", "disk")
VOCAB = range(10, 250)
SERVED = "tiny"  # the model name every setting serves under
AIPERF_HEADROOM = 0.8  # of the context an aiperf prompt is cut to
TINY_TOKENIZER = Path(__file__).resolve().parents[1] / "configs/models/tiny"  # the built-in model's


def _flags(setting: str, args: argparse.Namespace, scratch: Path) -> list[str]:
    model = TINY_CPU if args.checkpoint is None else ["--model", str(args.checkpoint), "--dtype", "float32"]
    flags = [*model, "--max-model-len", str(args.max_model_len), "--kv-cache-memory", args.kv_cache_memory]
    flags += ["--served-model-name", SERVED]
    if setting == "off":
        return [*flags, "--no-prefix-caching"]
    if setting == "device":
        return [*flags, "--kv-host-cache-size", "0"]
    flags += ["--kv-host-cache-size", args.host_size]
    if setting in ("disk", "shared"):
        flags += ["--kv-disk-cache-dir", str(scratch / "disk"), "--kv-disk-cache-size", args.disk_size]
    return [*flags, "--prefill-pools", "2"] if setting == "shared" else flags


@contextlib.contextmanager
def _vllm(args: argparse.Namespace, scratch: Path) -> Iterator[Server]:
    if args.checkpoint is None:
        raise SystemExit("the vllm setting needs --checkpoint (benchmarks/make_bench_checkpoint.py)")
    port = free_port()
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.checkpoint)]
    cmd += ["--served-model-name", SERVED, "--dtype", "float32", "--attention-backend", "CPU_MLA"]
    cmd += [
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--seed",
        "0",
        "--max-model-len",
        str(args.max_model_len),
    ]
    cmd += ["--block-size", str(args.block_tokens), "--enable-prefix-caching"]
    env = engine_env("vllm", scratch, "0,1", 1, 0)
    with running(Server(cmd, port, scratch / "vllm.log"), 600, env=env, say=progress) as server:
        yield server


def _prefill_tokens(base_url: str) -> dict[str, float]:
    """Prompt tokens and hits by tier, summed over the prefill ranks (vLLM: its prefix cache's
    queried and hit tokens, as device hits)."""
    out = dict.fromkeys(("prompt", *TIERS), 0.0)
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:prefix_cache_queries_total":
                out["prompt"] += s.value
            elif s.name == "vllm:prefix_cache_hits_total":
                out["memory"] += s.value
            if s.labels.get("role") != "prefill":
                continue
            if s.name == "dsinfer_worker_prompt_tokens_total":
                out["prompt"] += s.value
            elif s.name == "dsinfer_prefix_cache_hit_tokens_total" and s.labels.get("tier") in TIERS:
                out[s.labels["tier"]] += s.value
    return out


async def _replay(
    base_url: str, requests: list[TraceRequest], prompts: list[list[int]], args: argparse.Namespace
) -> list[Stream]:
    start = time.monotonic()
    t0 = requests[0].timestamp_ms

    async def one(client: Any, request: TraceRequest, prompt: list[int]) -> Stream:
        await asyncio.sleep(
            max(0.0, (request.timestamp_ms - t0) / 1000 / args.speedup - (time.monotonic() - start))
        )
        body = completion_body(prompt, args.max_tokens, model=SERVED, stream_options={"include_usage": True})
        return await stream_completion(client, base_url, body, retries=3)

    async with client_for(256, timeout=600) as client:
        return list(
            await asyncio.gather(*(one(client, r, p) for r, p in zip(requests, prompts, strict=True)))
        )


def _measure(
    setting: str, requests: list[TraceRequest], prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        if setting == "vllm":
            server = stack.enter_context(_vllm(args, tmp))
        else:
            server = stack.enter_context(serve(_flags(setting, args, tmp), tmp, say=progress))
        before = _prefill_tokens(server.base_url)
        if args.client == "aiperf":
            trace = tmp / "trace.jsonl"
            # aiperf sends text: re-encoded, its prompts come out ~13% longer than their token count
            limit = int((args.max_model_len - args.max_tokens) * AIPERF_HEADROOM)
            write_mooncake_trace(
                requests,
                trace,
                block_tokens=args.block_tokens,
                limit=limit,
                max_tokens=args.max_tokens,
                speedup=args.speedup,
            )
            tokenizer = str(args.checkpoint or TINY_TOKENIZER)
            run = run_aiperf(
                args.aiperf,
                server.base_url,
                trace,
                tmp / "aiperf",
                model=SERVED,
                tokenizer=tokenizer,
                block_tokens=args.block_tokens,
                timeout=3600,
            )
        else:
            run = _client_run(server.base_url, requests, prompts, args)
        time.sleep(2.0)  # the last load reports
        after = _prefill_tokens(server.base_url)
    prompt = after["prompt"] - before["prompt"]
    share = {tier: (after[tier] - before[tier]) / prompt if prompt else 0.0 for tier in TIERS}
    return {
        "setting": setting,
        **run,
        "prompt_tokens": prompt,
        "share": share,
        "share_total": sum(share.values()),
    }


def _client_run(
    base_url: str, requests: list[TraceRequest], prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, Any]:
    started = time.monotonic()
    streams = asyncio.run(_replay(base_url, requests, prompts, args))
    seconds = time.monotonic() - started
    ttfts = [s.ttft for s in streams if s.error is None and s.ttft is not None]
    return {
        **outcome(streams, seconds),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
    }


def markdown(report: dict[str, Any]) -> str:
    rows = [
        (
            r["setting"],
            f"{r['share']['memory']:.1%}",
            f"{r['share'].get('host', 0.0):.1%}",
            f"{r['share']['disk']:.1%}",
            f"{r['share_total']:.1%}",
            fmt(r["ttft_p50_s"], 1e3, 0),
            fmt(r["ttft_p90_s"], 1e3, 0),
            fmt(r["requests_per_s"]),
            r["failed"],
        )
        for r in report["runs"]
    ]
    a = report["args"]
    lines = [
        "# Mooncake conversation trace replayed against dsinfer's KV tiers",
        "",
        *report_header(report),
        "",
        f"{report['requests']} requests (1 in {a['keep']} of the prefix trees of the trace's first {a['minutes']:g} "
        f"minutes, at {a['speedup']:g}x its pace), "
        f"prompts at {a['block_tokens']} tokens per trace block; the trace allows {report['ideal_share']:.1%} "
        f"(an unbounded cache). Played by {'aiperf (unmodified, --fixed-schedule)' if a.get('client') == 'aiperf' else 'harness.clients'}.",
        "",
        *table(
            [
                "setting",
                "from device",
                "from host",
                "from disk",
                "served from cache",
                "TTFT p50 ms",
                "TTFT p90 ms",
                "requests/s",
                "failed",
            ],
            rows,
            "lrrrrrrrr",
        ),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--minutes", type=float, default=5.0, help="of the trace, from its start")
    parser.add_argument("--speedup", type=float, default=1.0)
    parser.add_argument(
        "--keep", type=int, default=8, help="play 1 in KEEP of the trace's prefix trees (harness.traces.thin)"
    )
    parser.add_argument("--block-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument(
        "--host-size", default="512MiB", help="the host tier's size in the host and disk settings"
    )
    parser.add_argument("--disk-size", default="8GiB")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument(
        "--checkpoint", type=Path, help="served by dsinfer and vLLM (default: dsinfer's tiny)"
    )
    parser.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    parser.add_argument(
        "--client",
        choices=("harness", "aiperf"),
        default="harness",
        help="who plays the trace (harness.aiperf)",
    )
    parser.add_argument("--aiperf", default="/work/aiperf-venv/bin/aiperf")
    add_output_args(parser)
    args = parser.parse_args()
    requests = thin([r for r in load_trace(args.trace) if r.timestamp_ms < args.minutes * 60_000], args.keep)
    limit = args.max_model_len - args.max_tokens
    prompts = [p[:limit] for p in replay_prompts(requests, args.block_tokens, VOCAB)]
    report: dict[str, Any] = {
        **provenance(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "requests": len(requests),
        "cut_to_context": sum(1 for p in prompts if len(p) == limit),
        "ideal_share": ideal_hit_share(requests),
        "runs": [],
    }
    progress(f"{len(requests)} requests; the trace allows {report['ideal_share']:.1%}")
    for setting in args.settings.split(","):
        run = _measure(setting, requests, prompts, args)
        report["runs"].append(run)
        progress(
            f"{setting}: {run['share_total']:.1%} from cache, TTFT p50 {run['ttft_p50_s']}, {run['failed']} failed"
        )
    save_report(report, markdown(report), args.out, args.markdown)
    plot_result(args.out)


if __name__ == "__main__":
    main()
