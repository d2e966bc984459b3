r"""Accuracy of the built-in trained model (tiny-chat) through dsinfer and vLLM, with throughput.

The held-out questions of every task (dsinfer.evals.tasks, fixed seed) are answered greedily by:

- ``dsinfer-offline``: the offline ``LLM`` API, all questions submitted at once;
- ``dsinfer-offline-mtp``: the same with ``speculative_mtp`` (MTP acceptance rate and mean
  accepted length);
- ``dsinfer-serve``: ``dsinfer serve`` all-in-one (a prefill pool and a decode pool of one rank
  each, KV over NIXL), chat completions at ``--concurrency`` requests in flight; afterwards its
  ``GET /expert_load`` (tokens per expert per MoE layer, per role) is saved to
  ``--expert-load-out`` for benchmarks/eplb_balance.py;
- ``dsinfer-colocated``: ``dsinfer serve --colocated`` (one pool of one rank that prefills and decodes);
- ``vllm-serve``: vLLM's OpenAI server (CPU build, run by ``--vllm-python``) on the same checkpoint
  directory, same requests and concurrency. Its rotary-embedding custom op is switched off
  (``custom_ops: ["all", "-rotary_embedding"]``; the op is wrong for 3-D queries on CPU) and it
  reserves no core for its scheduler (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``).

Every engine runs in ``--dtype`` (default bfloat16: vLLM's default CPU attention backend takes
only bf16; float32 makes vLLM use its CPU_MLA backend). Each row: exact match per task, requests,
prompt and output tokens per second over the whole set (wall time from the first request to the
last answer, after a warm-up request). Results go to ``--out`` (markdown) and the same name .json.

    python benchmarks/accuracy.py --vllm-python /work/peers/vllm/bin/python \
        --out benchmarks/results/accuracy.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsinfer import LLM
from dsinfer.base.presets import DEFAULT_MODEL, resolve_model
from dsinfer.base.processes import free_port
from dsinfer.base.protocol import EXPERT_LOAD_INTERVAL
from dsinfer.evals.runner import EndpointClient, EvalReport, OfflineClient, run_eval
from dsinfer.evals.tasks import HELD_OUT_SEED, HELD_OUT_SIZE, TASKS
from harness.plots import plot_result
from harness.progress import progress
from harness.provenance import REPO, git, machine_info, source_env
from harness.server import Server, dsinfer_command, running

MODES = ("dsinfer-offline", "dsinfer-offline-mtp", "dsinfer-serve", "dsinfer-colocated", "vllm-serve")


def dsinfer_argv(args: argparse.Namespace, model: Path, port: int, colocated: bool) -> list[str]:
    argv = dsinfer_command("serve", "--port", str(port), "--model", str(model))
    argv += ["--dtype", args.dtype, "--kv-cache-memory", "1GiB", "--threads-per-rank"]
    argv += ["2", "--colocated", "--decode-pool-size", "1"] if colocated else ["1"]
    return argv


def vllm_argv(args: argparse.Namespace, model: Path, port: int) -> list[str]:
    argv = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    argv += ["--served-model-name", DEFAULT_MODEL, "--port", str(port), "--dtype", args.dtype]
    argv += [
        "--max-model-len",
        "2048",
        "--compilation-config",
        json.dumps({"custom_ops": ["all", "-rotary_embedding"]}),
    ]
    if args.dtype == "float32":
        argv += ["--attention-backend", "CPU_MLA"]
    return argv


def vllm_env(scratch: Path) -> dict[str, str]:
    return {
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "TMPDIR": str(scratch),
        "VLLM_CACHE_ROOT": str(scratch / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor"),
    }


def evaluate_endpoint(base_url: str, args: argparse.Namespace) -> EvalReport:
    client = EndpointClient(base_url, concurrency=args.concurrency)
    run_eval(client, ["add"], 1)  # warm-up
    return run_eval(client, args.tasks, args.limit)


def run_mode(mode: str, args: argparse.Namespace, model: Path, scratch: Path) -> EvalReport:
    if mode.startswith("dsinfer-offline"):
        llm = LLM(str(model), dtype=args.dtype, kv_cache_memory="1GiB", speculative_mtp=mode.endswith("mtp"))
        try:
            client = OfflineClient(llm, mode)
            run_eval(client, ["add"], 1)  # warm-up (its drafts are counted from here on)
            client = OfflineClient(llm, mode)
            return run_eval(client, args.tasks, args.limit)
        finally:
            llm.engine.close()
    port = free_port()
    if mode == "vllm-serve":
        argv, env, timeout = vllm_argv(args, model, port), vllm_env(scratch), 600.0
    else:
        argv, env, timeout = dsinfer_argv(args, model, port, mode == "dsinfer-colocated"), {}, 180.0
    server = Server(argv, port, scratch / f"{mode}.log")
    with running(server, timeout, env=source_env(None, env), say=lambda msg: progress(f"[{mode}] {msg}")):
        report = evaluate_endpoint(server.base_url, args)
        if mode == "dsinfer-serve" and args.expert_load_out is not None:
            args.expert_load_out.write_text(json.dumps(reported_expert_load(server.base_url)) + "\n")
            plot_result(args.expert_load_out)
            progress(f"[{mode}] wrote the router's expert load to {args.expert_load_out}")
        return report


def reported_expert_load(base_url: str) -> dict[str, Any]:
    """GET /expert_load once the ranks' counts have reached the gateway (they come with a load
    report every EXPERT_LOAD_INTERVAL seconds, so right after a short run they are still zero)."""
    deadline = time.monotonic() + 4 * EXPERT_LOAD_INTERVAL
    while True:
        with urllib.request.urlopen(f"{base_url}/expert_load", timeout=30) as response:
            doc = json.loads(response.read())
        counted = any(
            any(c > 0 for c in counts) for role in doc["roles"].values() for counts in role.values()
        )
        if counted or time.monotonic() > deadline:
            return doc
        time.sleep(1.0)


def vllm_version(python: str) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            [python, "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        return out.stdout.strip().splitlines()[-1] if out.returncode == 0 else "not importable"
    return "not found"


def _load(averages: Sequence[float]) -> str:
    return "/".join(f"{a:.1f}" for a in averages)


def markdown(runs: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    tasks, machine = meta["tasks"], meta["machine"]
    lines = [
        "# Accuracy of the built-in trained model (tiny-chat), dsinfer and vLLM",
        "",
        f"- Command: `{meta['command']}`",
        f"- Held-out set: {meta['limit']} questions per task, seed {HELD_OUT_SEED} (dsinfer/evals/tasks.py); "
        f"greedy; dtype {meta['dtype']}; servers at {meta['concurrency']} concurrent chat completions",
        f"- Machine: {machine['online_cpus']} CPUs ({machine['cpu_model']}), {machine['mem_total_gib']} GiB; "
        f"load average (1/5/15 min) at start {_load(meta['load_start'])}, at end {_load(meta['load_end'])}",
        f"- Versions: dsinfer {meta['commit']}, vLLM {meta['vllm']}, Python {meta['python']}",
        "",
        "| mode | "
        + " | ".join(tasks)
        + " | wall s | req/s | prompt tok/s | output tok/s | MTP accepted | same tokens as first row |",
        "|---|" + "---|" * (len(tasks) + 6),
    ]
    for mode, run in runs.items():
        if "error" in run:
            lines.append(f"| {mode} | " + " | ".join("-" for _ in tasks) + f" | {run['error']} | | | | | |")
            continue
        acc = " | ".join(f"{run['accuracy'][t]:.1%}" for t in tasks)
        mtp = run.get("mtp")
        mtp_cell = (
            f"{mtp['acceptance_rate']:.1%} (mean length {mtp['mean_accepted_length']:.2f})" if mtp else "-"
        )
        seconds = run["seconds"]
        prompt_tokens = sum(t["mean_prompt_tokens"] * t["total"] for t in run["tasks"])
        lines.append(
            f"| {mode} | {acc} | {seconds:.1f} | {run['requests'] / seconds:.1f} | "
            f"{prompt_tokens / seconds:.0f} | {run['output_tokens'] / seconds:.0f} | {mtp_cell} | "
            f"{run['same_tokens_as_first']:.1%} |"
        )
    lines += [
        "",
        "Mean prompt tokens per task (the chat template included): "
        + ", ".join(
            f"{t['task']} {t['mean_prompt_tokens']:.0f}" for t in next(iter(runs.values())).get("tasks", [])
        ),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint directory or preset")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--limit", type=int, default=HELD_OUT_SIZE)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--vllm-python", default="/work/peers/vllm/bin/python")
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/dsinfer-accuracy"))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "accuracy.md")
    parser.add_argument(
        "--expert-load-out",
        type=Path,
        default=REPO / "benchmarks" / "results" / "tiny_chat_expert_load.json",
        help="dsinfer-serve's GET /expert_load after the evaluation (benchmarks/eplb_balance.py reads it)",
    )
    args = parser.parse_args(argv)
    args.tasks = args.tasks.split(",")
    model = resolve_model(args.model)[0].resolve()
    args.scratch.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": "python "
        + " ".join(["benchmarks/accuracy.py", *(argv if argv is not None else sys.argv[1:])]),
        "tasks": args.tasks,
        "limit": args.limit,
        "dtype": args.dtype,
        "concurrency": args.concurrency,
        "machine": machine_info(),
        "load_start": os.getloadavg(),
        "commit": git("rev-parse", "--short", "HEAD"),
        "vllm": vllm_version(args.vllm_python),
        "python": platform.python_version(),
    }
    runs: dict[str, dict[str, Any]] = {}
    for mode in args.modes.split(","):
        progress(f"[{mode}] evaluating {args.limit} questions per task")
        try:
            report = run_mode(mode, args, model, args.scratch)
        except (RuntimeError, TimeoutError, OSError) as e:
            progress(f"[{mode}] failed: {e}")
            runs[mode] = {"error": str(e).splitlines()[0][:200]}
            continue
        runs[mode] = report.to_json()
        reference = next(iter(runs.values()))
        same = sum(
            a == b
            for t in args.tasks
            for a, b in zip(reference["token_ids"][t], report.token_ids[t], strict=True)
        )
        runs[mode]["same_tokens_as_first"] = same / report.requests
        progress(f"[{mode}]\n{report.table()}")
    meta["load_end"] = os.getloadavg()
    args.out.write_text(markdown(runs, meta))
    for run in runs.values():
        run.pop("token_ids", None)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1) + "\n")
    plot_result(args.out.with_suffix(".json"))
    progress(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
