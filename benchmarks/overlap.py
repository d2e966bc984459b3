"""Step time of expert-parallel pools with and without two-micro-batch overlap (``--enable-overlap``).

For each pool size (default 2 and 4 rank processes on this machine: gloo over TCP, one torch
thread and one numba thread per rank) and each setting (overlap off; on, with
``overlap_min_tokens=0`` so that every step of two or more sequences splits), the script starts
an engine-level pool stepping in lockstep as the serving loop does (``engine.plan_step()``, the
one agreement all-reduce ``engine.agree()``, then ``engine.run_step()``), with dummy weights of the tiny preset's config grown
to the sizes below, float32. Three phases run one after the other on the same pool:

- warm-up (not reported): a few prompts and decode steps, so numba and the allocator are warm;
- prefill: ``--prefill-prompts`` fresh prompts of ``--prefill-len`` tokens per rank, one output
  token each (every step is a prefill step of ``--max-batched-tokens`` tokens per rank);
- decode: ``--decode-seqs`` prompts of ``--decode-len`` tokens per rank, ``--decode-steps``
  output tokens each with ``ignore_eos`` (after the prompts' prefill, steady decode steps).

Every rank times every step; the pool's step time is the max over ranks per step index (they
run in lockstep). Reported per phase: median pool step time and tokens per second over the
phase's steps of its kind (a prefill-phase step with a prefill chunk on some rank; a
decode-phase step with decodes only, pool-wide). The overlap runs also write a Chrome trace per
rank (``--trace``): from it, per schedule, the communication time per step (each dispatch or
combine from its post to its completion), the fraction of it that ran while the other
micro-batch computed (its chunk spans less the time they spent blocked in waits and in the
synchronous counts exchange), and the time the compute thread spent blocked. Settings alternate
order per repeat (off, on, then on, off) so that a drift in the machine's load hits both.

    /work/venv/bin/python benchmarks/overlap.py \\
        --out benchmarks/results/overlap.json --markdown benchmarks/results/overlap.md

Internal: ``overlap.py --rank-child SPEC_JSON`` is one rank of a pool.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.plots import plot_result
from harness.provenance import git_commit, machine_info
from harness.rank_pool import exit_on_sigterm, grown_preset, join_pool, random_prompts, run_pool
from harness.results import report_header, save_report

PHASES = ("warmup", "prefill", "decode")

# overrides of the tiny preset's config.json
MODEL: dict[str, Any] = {
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "n_routed_experts": 32,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 128,
    "num_nextn_predict_layers": 0,
}


# The rank child --------------------------------------------------------------------------------
def rank_main(spec: dict[str, Any]) -> int:
    import logging

    import torch.distributed as dist

    from dsinfer.base.sampling_params import SamplingParams
    from dsinfer.engine.args import EngineArgs
    from dsinfer.engine.engine import LLMEngine
    from dsinfer.engine.scheduler import ScheduledBatch
    from dsinfer.parallel.ep import TorchEPGroup

    logging.basicConfig(level=logging.WARNING)
    if not join_pool(spec):
        return 1
    rank = spec["rank"]
    engine = LLMEngine(EngineArgs(model=spec["model"], **spec["engine"]), ep_group=TorchEPGroup())
    batches: list[dict[str, Any]] = []  # what each runner step held on this rank
    run = engine.runner.run

    def recorded_run(batch: ScheduledBatch, *args: Any) -> Any:
        prefill = any(not s.is_decode for s in batch.seqs)
        batches.append({"seqs": len(batch.seqs), "tokens": batch.num_tokens, "prefill": prefill})
        return run(batch, *args)

    engine.runner.run = recorded_run  # type: ignore[method-assign]
    phases: dict[str, Any] = {}
    for phase in PHASES:
        work = spec["phases"][phase]
        params = SamplingParams(temperature=0, max_tokens=work["max_tokens"], ignore_eos=True)
        for i, ids in enumerate(work["prompts"]):
            engine.add_request(f"{phase}-{rank}-{i}", ids, params)
        dist.barrier()
        first, seconds = len(batches), []
        while True:
            plan = engine.plan_step()
            agreed = engine.agree(plan.votes)
            if not agreed.has_work:
                break
            t = time.perf_counter()
            engine.run_step(plan, agreed)
            seconds.append(time.perf_counter() - t)
        phases[phase] = {"first_step": first, "seconds": seconds, "batches": batches[first:]}
        if rank == 0:
            print(f"    {spec['label']}: {phase} done, {len(seconds)} steps", file=sys.stderr, flush=True)
    Path(spec["out"]).write_text(
        json.dumps(
            {"rank": rank, "phases": phases, "two_micro_batch_steps": engine.runner.two_micro_batch_steps}
        )
    )
    dist.barrier()
    engine.close()  # flushes the trace
    dist.destroy_process_group()
    return 0


# The parent: pools -----------------------------------------------------------------------------
def run(
    args: argparse.Namespace, world: int, model: Path, overlap: bool, label: str, tmp: Path
) -> tuple[list[dict[str, Any]], Path | None]:
    """One pool: ``world`` rank processes; their results rank by rank, and the trace folder."""
    trace = tmp / f"trace-{label.replace(' ', '_')}" if overlap else None
    engine: dict[str, Any] = {
        "load_format": "dummy",
        "dtype": "float32",
        "kv_cache_memory": "256MiB",
        "max_num_batched_tokens": args.max_batched_tokens,
        "max_num_seqs": max(args.decode_seqs, args.prefill_prompts),
        "enable_prefix_caching": False,
        "enable_overlap": overlap,
        "overlap_min_tokens": 0,
        "trace_dir": str(trace) if trace else None,
        "trace_flush_steps": 1000,
    }

    def work(rank: int) -> dict[str, Any]:
        seed = 1000 * rank + args.seed
        return {
            "warmup": {"prompts": random_prompts(4, 64, seed), "max_tokens": 4},
            "prefill": {
                "prompts": random_prompts(args.prefill_prompts, args.prefill_len, seed + 1),
                "max_tokens": 1,
            },
            "decode": {
                "prompts": random_prompts(args.decode_seqs, args.decode_len, seed + 2),
                "max_tokens": args.decode_steps,
            },
        }

    def specs(init: str) -> list[dict[str, Any]]:
        name = label.replace(" ", "_")
        shared = {"world": world, "init": init, "label": label, "model": str(model), "engine": engine}
        return [
            {"rank": r, **shared, "phases": work(r), "out": str(tmp / f"{name}-rank{r}.json")}
            for r in range(world)
        ]

    return run_pool(Path(__file__).resolve(), specs, label, args.run_timeout, attempts=1), trace


# Analysis --------------------------------------------------------------------------------------
def pool_steps(ranks: list[dict[str, Any]], phase: str) -> list[dict[str, Any]]:
    """Per step index: the pool's time (max over ranks), tokens (sum) and kind."""
    per_rank = [r["phases"][phase] for r in ranks]
    counts = {len(p["seconds"]) for p in per_rank}
    if len(counts) != 1:
        raise RuntimeError(f"ranks ran different step counts in {phase}: {sorted(counts)}")
    steps = []
    for i in range(counts.pop()):
        batches = [p["batches"][i] for p in per_rank]
        kind = "prefill" if any(b["prefill"] for b in batches) else "decode"
        steps.append(
            {
                "seconds": max(p["seconds"][i] for p in per_rank),
                "tokens": sum(b["tokens"] for b in batches),
                "kind": kind,
            }
        )
    return steps


def phase_stats(steps: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    chosen = [s for s in steps if s["kind"] == kind]
    seconds = [s["seconds"] for s in chosen]
    total = sum(seconds)
    return {
        "steps": len(chosen),
        "median_ms": 1e3 * statistics.median(seconds) if seconds else None,
        "mean_ms": 1e3 * total / len(seconds) if seconds else None,
        "tokens_per_s": sum(s["tokens"] for s in chosen) / total if total else None,
    }


def _subtract(span: tuple[float, float], holes: list[tuple[float, float]]) -> list[tuple[float, float]]:
    pieces, start = [], span[0]
    for a, b in sorted(holes):
        if b <= start or a >= span[1]:
            continue
        if a > start:
            pieces.append((start, a))
        start = max(start, b)
    if start < span[1]:
        pieces.append((start, span[1]))
    return pieces


def _overlap(a: tuple[float, float], pieces: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a[1], b) - max(a[0], x)) for x, b in pieces)


def trace_stats(trace_dir: Path, ranks: list[dict[str, Any]], phase: str) -> dict[str, Any]:
    """Per schedule, over the phase's two-micro-batch steps of every rank: communication time per
    step, the fraction of it under the other micro-batch's compute, blocked time per step."""
    from dsinfer.base.trace import load_trace

    acc: dict[str, dict[str, float]] = {}
    for result in ranks:
        [path] = trace_dir.glob(f"trace-rank{result['rank']}-*.json")
        first = result["phases"][phase]["first_step"]
        last = first + len(result["phases"][phase]["seconds"])
        by_step: dict[int, list[dict[str, Any]]] = {}
        for e in load_trace(path):
            if first <= e["args"]["step"] < last:
                by_step.setdefault(e["args"]["step"], []).append(e)
        for events in by_step.values():
            chunks = [e for e in events if e["cat"] == "chunk"]
            if not chunks:
                continue
            order = chunks[0]["args"]["order"]
            a = acc.setdefault(order, {"steps": 0, "comm": 0.0, "hidden": 0.0, "wait": 0.0, "post": 0.0})
            a["steps"] += 1
            waits = [e for e in events if e["cat"] == "wait"]
            a["wait"] += sum(e["dur"] for e in waits if e["name"].startswith("wait"))
            a["post"] += sum(e["dur"] for e in waits if e["name"].startswith("post"))
            compute: dict[int, list[tuple[float, float]]] = {0: [], 1: []}
            for c in chunks:
                mb = c["args"]["mb"]
                holes = [(w["ts"], w["ts"] + w["dur"]) for w in waits if w["args"]["mb"] == mb]
                compute[mb] += _subtract((c["ts"], c["ts"] + c["dur"]), holes)
            for comm in (e for e in events if e["cat"] == "comm"):
                span = (comm["ts"], comm["ts"] + comm["dur"])
                a["comm"] += comm["dur"]
                a["hidden"] += _overlap(span, compute[1 - comm["args"]["mb"]])
    return {
        order: {
            "rank_steps": a["steps"],
            "comm_ms_per_step": a["comm"] / a["steps"] / 1e3,
            "hidden_fraction": a["hidden"] / a["comm"] if a["comm"] else None,
            "blocked_in_waits_ms_per_step": a["wait"] / a["steps"] / 1e3,
            "counts_exchange_ms_per_step": a["post"] / a["steps"] / 1e3,
        }
        for order, a in acc.items()
    }


def analyze(ranks: list[dict[str, Any]], trace: Path | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prefill": phase_stats(pool_steps(ranks, "prefill"), "prefill"),
        "decode": phase_stats(pool_steps(ranks, "decode"), "decode"),
        "two_micro_batch_steps": [r["two_micro_batch_steps"] for r in ranks],
    }
    if trace is not None:
        out["trace"] = {phase: trace_stats(trace, ranks, phase) for phase in ("prefill", "decode")}
    return out


# Report ----------------------------------------------------------------------------------------
def _f(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (world, setting): medians over repeats of the per-run numbers."""
    out: dict[str, Any] = {}
    for run in runs:
        key = f"{run['world']} {run['setting']}"
        out.setdefault(key, []).append(run["result"])
    summary = {}
    for key, results in out.items():
        row: dict[str, Any] = {}
        for phase in ("prefill", "decode"):
            for field in ("median_ms", "tokens_per_s"):
                values = [r[phase][field] for r in results if r[phase][field] is not None]
                row[f"{phase}_{field}"] = statistics.median(values) if values else None
        traces = [r["trace"] for r in results if "trace" in r]
        for phase, order in (("prefill", "prefill"), ("decode", "decode")):
            fields = (
                "comm_ms_per_step",
                "hidden_fraction",
                "blocked_in_waits_ms_per_step",
                "counts_exchange_ms_per_step",
            )
            for field in fields:
                values = [t[phase][order][field] for t in traces if order in t[phase]]
                values = [v for v in values if v is not None]
                row[f"{order}_{field}"] = statistics.median(values) if values else None
        summary[key] = row
    return summary


def markdown(report: dict[str, Any]) -> str:
    a = report["args"]
    lines = [
        "# Two-micro-batch overlap: EP pool step time with and without `--enable-overlap`",
        "",
        *report_header(report),
        f"- load average (1 min) at start / end: {report['load_start']:.2f} / {report['load_end']:.2f}",
        f"- model: tiny preset grown to {json.dumps(MODEL)}, dummy weights, float32",
        f"- per rank: prefill {a['prefill_prompts']} x {a['prefill_len']} tokens (budget {a['max_batched_tokens']} "
        f"per step), decode {a['decode_seqs']} sequences of {a['decode_len']} prompt tokens x "
        f"{a['decode_steps']} steps; {a['repeats']} repeat(s), medians over repeats",
        "- pool step = max over ranks per step; overlap runs: `overlap_min_tokens=0` (every step of >= 2 "
        "sequences splits), with tracing on",
        "",
        "| ranks | overlap | prefill step ms (median) | prefill tok/s | decode step ms (median) | decode tok/s |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    s = report["summary"]
    for world in a["worlds"]:
        for setting in ("off", "on"):
            r = s[f"{world} {setting}"]
            lines.append(
                f"| {world} | {setting} | {_f(r['prefill_median_ms'])} | {_f(r['prefill_tokens_per_s'], 0)} "
                f"| {_f(r['decode_median_ms'])} | {_f(r['decode_tokens_per_s'], 0)} |"
            )
    lines += [
        "",
        "From the overlap runs' traces (all ranks): communication = each dispatch/combine from its post to its "
        "completion; hidden = the part of it during the other micro-batch's compute (its chunks less their "
        "waits and counts exchanges); blocked = compute thread waiting for a transfer; counts exchange = "
        "compute thread blocked in the synchronous row-count all-to-all before each dispatch.",
        "",
        "| ranks | schedule | comm ms / step | hidden under the other's compute | blocked in waits ms / step "
        "| counts exchange ms / step |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for world in a["worlds"]:
        r = s[f"{world} on"]
        for order in ("prefill", "decode"):
            hidden = r[f"{order}_hidden_fraction"]
            lines.append(
                f"| {world} | {order} | {_f(r[f'{order}_comm_ms_per_step'], 2)} | "
                f"{'n/a' if hidden is None else f'{100 * hidden:.0f}%'} | "
                f"{_f(r[f'{order}_blocked_in_waits_ms_per_step'], 2)} | "
                f"{_f(r[f'{order}_counts_exchange_ms_per_step'], 2)} |"
            )
    lines += ["", "Per run (in execution order):", ""]
    lines += [
        "| ranks | overlap | repeat | prefill ms | decode ms | load avg before |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for run in report["runs"]:
        r = run["result"]
        lines.append(
            f"| {run['world']} | {run['setting']} | {run['repeat']} | {_f(r['prefill']['median_ms'])} "
            f"| {_f(r['decode']['median_ms'])} | {run['load_before']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank-child", help=argparse.SUPPRESS)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prefill-prompts", type=int, default=8)
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--max-batched-tokens", type=int, default=1024)
    parser.add_argument("--decode-seqs", type=int, default=32)
    parser.add_argument("--decode-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-timeout", type=float, default=900)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.rank_child:
        return rank_main(json.loads(args.rank_child))
    exit_on_sigterm()
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(torch=True),
        "commit": git_commit(short=True),
        "command": "python benchmarks/overlap.py " + " ".join(sys.argv[1:]),
        "load_start": os.getloadavg()[0],
        "args": {k: v for k, v in vars(args).items() if k not in ("rank_child", "out", "markdown")},
        "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="dsinfer-overlap-") as tmp_name:
        tmp = Path(tmp_name)
        model, _ = grown_preset(MODEL, tmp / "model")
        for world in args.worlds:
            for repeat in range(args.repeats):
                settings = ("off", "on") if repeat % 2 == 0 else ("on", "off")
                for setting in settings:
                    label = f"ep{world} overlap {setting} r{repeat}"
                    print(f"  {label} (load {os.getloadavg()[0]:.2f}) ...", flush=True)
                    load_before = os.getloadavg()[0]
                    t = time.perf_counter()
                    ranks, trace = run(args, world, model, setting == "on", label, tmp)
                    result = analyze(ranks, trace)
                    print(
                        f"  {label}: {time.perf_counter() - t:.0f} s; prefill {_f(result['prefill']['median_ms'])} ms, "
                        f"decode {_f(result['decode']['median_ms'])} ms per step",
                        flush=True,
                    )
                    report["runs"].append(
                        {
                            "world": world,
                            "setting": setting,
                            "repeat": repeat,
                            "load_before": load_before,
                            "result": result,
                        }
                    )
    report["load_end"] = os.getloadavg()[0]
    report["summary"] = summarize(report["runs"])
    save_report(report, markdown(report), args.out, args.markdown, indent=1)
    plot_result(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
