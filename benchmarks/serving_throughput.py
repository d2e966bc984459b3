"""Serving throughput over HTTP: dsinfer colocated, dsinfer all-in-one PD and vLLM's OpenAI server.

One run, one client, one checkpoint (benchmarks/make_bench_checkpoint.py: the tiny preset's
shapes, random weights), the same cores (`taskset -c`), the same workload: N concurrent
`/v1/completions` requests of random token ids (prompt given as ids), greedy, a fixed output
length with `ignore_eos`, not streamed. For each server: start it, wait until it answers, one
warm-up pass of the whole workload, then `--repeats` timed passes; output tok/s = completion
tokens (from each response's `usage`) / wall time of the pass. The engines' offline figures are
taken in the same run by benchmarks/offline_throughput.py (`--offline-repeats` runs of dsinfer
and vLLM, the same workload), so the server / offline ratios compare like with like.

Besides tok/s, each pass records the CPU seconds every process of the server spent in it (utime +
stime from /proc, grouped by role: gateway, rank, vLLM's API server and engine core...) and the
load average: the work counts stay meaningful when the machine is shared; the tok/s do not.

    python benchmarks/serving_throughput.py --out benchmarks/results/serving_throughput.json \\
        --markdown benchmarks/results/serving_throughput.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from dsinfer.base.processes import free_port
from harness.clients import client_for, complete, completion_body
from harness.metrics import cpu_seconds, rss_mib
from harness.plots import plot_result
from harness.progress import progress
from harness.provenance import REPO, command_line, git_state, load_average, machine_info, parse_cpu_list
from harness.results import write_json
from harness.server import Server, dsinfer_command, engine_env, role_of

BENCH_DIR = REPO / "benchmarks"
SERVERS = ("dsinfer-colocated", "dsinfer-pd", "vllm")
VLLM_COMPILATION = json.dumps({"custom_ops": ["all", "-rotary_embedding"]})  # peers.md


# Server processes -------------------------------------------------------------------------------
def server_command(name: str, args: argparse.Namespace, port: int) -> tuple[list[str], dict[str, str]]:
    model, dtype = str(args.model), args.dtype
    max_len = args.input_len + args.output_len + 64
    if name == "vllm":
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
        cmd += ["--dtype", dtype, "--port", str(port), "--host", "127.0.0.1", "--seed", "0"]
        cmd += ["--max-model-len", str(max_len), "--max-num-seqs", str(args.num_requests)]
        cmd += ["--compilation-config", VLLM_COMPILATION]  # 0.32 logs no requests by default
        if dtype == "float32":
            cmd += ["--attention-backend", "CPU_MLA"]
        env = engine_env("vllm", args.scratch, args.cores, args.kv_cache_gb, args.vllm_reserved_cpus)
    else:
        cmd = dsinfer_command("serve", "--model", model, "--dtype", dtype, python=args.python)
        cmd += ["--port", str(port), "--host", "127.0.0.1"]
        if name == "dsinfer-colocated":
            cmd.append("--colocated")
        cmd += shlex.split(args.dsinfer_flags)
        env = engine_env("dsinfer", args.scratch, args.cores, args.kv_cache_gb, None)
        env.pop("OMP_NUM_THREADS", None)  # the pool launchers give each rank its threads
    return ["taskset", "-c", args.cores, *cmd], env


def process_tree(server: Server) -> dict[int, str]:
    """pid -> role (``role_of``) of the server and every process below it."""
    return {p.pid: role_of(p.cmdline()) for p in server.tree()}


def rss_mib_by_role(tree: dict[int, str]) -> dict[str, list[float]]:
    """Resident memory of each process of the tree, MiB, grouped by role."""
    out: dict[str, list[float]] = {}
    for pid, mib in rss_mib(tree).items():
        out.setdefault(tree[pid], []).append(round(mib, 1))
    return out


# Client -----------------------------------------------------------------------------------------
def make_prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [
        [rng.randrange(2, args.vocab_size) for _ in range(args.input_len)] for _ in range(args.num_requests)
    ]


def body(model: str, prompt: list[int], n: int) -> dict[str, Any]:
    return completion_body(prompt, n, model=model, stream=False, temperature=0)


async def one_pass(server: Server, model: str, prompts: list[list[int]], n: int) -> dict[str, Any]:
    tree = process_tree(server)
    before = cpu_seconds(tree)
    load = load_average()
    async with client_for(len(prompts), timeout=600) as client:
        start = time.perf_counter()
        bodies = await asyncio.gather(
            *(complete(client, server.base_url, body(model, p, n)) for p in prompts)
        )
        wall = time.perf_counter() - start
    after = cpu_seconds(tree)
    tokens = sum(b["usage"]["completion_tokens"] for b in bodies)
    cpu: dict[str, float] = {}
    for pid, role in tree.items():
        if pid in before and pid in after:
            cpu[role] = round(cpu.get(role, 0.0) + after[pid] - before[pid], 2)
    return {
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall,
        "cpu_s_by_role": cpu,
        "load_average_before": load,
        "load_average_after": load_average(),
    }


def start_server(name: str, args: argparse.Namespace, log_dir: Path) -> tuple[Server, float]:
    """The server started and answering a completion -> (it, seconds to that)."""
    port = free_port()
    cmd, env = server_command(name, args, port)
    server = Server(cmd, port, log_dir / f"{name}.log")
    progress(f"[{name}] start: {shlex.join(cmd)} (log {server.log_path})")
    server.start(env, cwd=REPO)
    model = str(args.model) if name == "vllm" else args.model.name

    def answers() -> bool:
        url = f"{server.base_url}/v1/completions"
        return httpx.post(url, json=body(model, [5, 6, 7], 1), timeout=30).status_code == 200

    return server, server.wait_ready(args.start_timeout, answers)


async def run_server(name: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    model = str(args.model) if name == "vllm" else args.model.name
    server: Server | None = None
    try:
        server, ready_s = start_server(name, args, log_dir)
        progress(f"[{name}] ready after {ready_s:.1f} s; warm-up pass")
        prompts = make_prompts(args)
        warm = await one_pass(server, model, prompts, args.output_len)
        progress(f"[{name}] warm-up {warm['output_tok_s']:.0f} tok/s")
        passes = []
        for i in range(args.repeats):
            p = await one_pass(server, model, prompts, args.output_len)
            progress(
                f"[{name}] pass {i + 1}: {p['output_tok_s']:.0f} output tok/s, CPU s {p['cpu_s_by_role']}"
            )
            passes.append(p)
        rss = rss_mib_by_role(process_tree(server))
        progress(f"[{name}] resident memory after the passes, MiB: {rss}")
        expected = args.num_requests * args.output_len
        bad = [p["output_tokens"] for p in passes if p["output_tokens"] != expected]
        if bad:
            raise RuntimeError(f"{name}: {bad[0]} completion tokens, expected {expected}")
        return {
            "server": name,
            "status": "ok",
            "ready_s": ready_s,
            "rss_mib_by_role": rss,
            "passes": passes,
            "median_output_tok_s": statistics.median(p["output_tok_s"] for p in passes),
        }
    except Exception as e:
        progress(f"[{name}] FAILED: {e}")
        return {"server": name, "status": "failed", "reason": str(e), "log": str(log_dir / f"{name}.log")}
    finally:
        if server is not None:
            server.stop(30.0)


def run_offline(args: argparse.Namespace, log_dir: Path) -> dict[str, list[float]]:
    """Output tok/s of dsinfer's and vLLM's offline engines, ``--offline-repeats`` runs each."""
    figures: dict[str, list[float]] = {"dsinfer": [], "vllm": []}
    for i in range(args.offline_repeats):
        out = log_dir / f"offline_{i}.json"
        cmd = [args.python, str(BENCH_DIR / "offline_throughput.py"), "--engines", "vllm,dsinfer"]
        cmd += ["--dtypes", args.dtype, "--vllm-modes", "compile", "--vllm-reserved-cpus", "0"]
        cmd += ["--num-prompts", str(args.num_requests), "--input-len", str(args.input_len)]
        cmd += ["--output-len", str(args.output_len), "--model", str(args.model), "--cores", args.cores]
        cmd += ["--scratch", str(args.scratch), "--python", args.python, "--vllm-python", args.vllm_python]
        cmd += ["--compare-prompts", "0", "--out", str(out)]
        progress(f"offline run {i + 1}: {shlex.join(cmd)}")
        subprocess.run(cmd, cwd=REPO, check=False, stdout=(log_dir / f"offline_{i}.log").open("w"))
        if not out.exists():
            progress(f"offline run {i + 1} wrote no results (see {log_dir}/offline_{i}.log)")
            continue
        for r in json.loads(out.read_text())["results"]:
            if r.get("status") == "ok":
                figures[r["engine"]].append(r["timed"]["output_tok_s"])
        progress(f"offline run {i + 1}: {figures}")
    return figures


# Report -----------------------------------------------------------------------------------------
def markdown(report: dict[str, Any]) -> str:
    offline = {k: statistics.median(v) if v else None for k, v in report["offline_output_tok_s"].items()}
    by_name = {r["server"]: r for r in report["servers"]}
    vllm_server = by_name.get("vllm", {}).get("median_output_tok_s")
    lines = [
        f"# Serving throughput, {report['date']}",
        "",
        f"- Workload: {report['workload']}",
        f"- Machine: {report['machine']['cpu_model']}, cores {report['machine']['cores_used']}; "
        f"load average at start {report['load_average_start']}, at end {report['load_average_end']}",
        f"- dsinfer commit {report['git']['commit'][:12]}{' (modified)' if report['git']['dirty'] else ''}",
        f"- Command: `{report['command']}`",
        "",
        "| server | offline tok/s (median) | server tok/s per pass | median | server / offline | / vLLM server |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for name in SERVERS:
        r = by_name.get(name)
        if r is None:
            continue
        engine = "vllm" if name == "vllm" else "dsinfer"
        off = offline.get(engine)
        if r["status"] != "ok":
            lines.append(f"| {name} | {off or '-'} | failed: {r['reason'][:80]} | | | |")
            continue
        med = r["median_output_tok_s"]
        per_pass = ", ".join(f"{p['output_tok_s']:,.0f}" for p in r["passes"])
        ratio = f"{med / off:.2f}" if off else "-"
        vs = f"{med / vllm_server:.2f}" if vllm_server else "-"
        lines.append(
            f"| {name} | {off:,.0f} | {per_pass} | {med:,.0f} | {ratio} | {vs} |"
            if off
            else f"| {name} | - | {per_pass} | {med:,.0f} | - | {vs} |"
        )
    lines += ["", "CPU seconds per timed pass, by process role (median pass):", ""]
    for r in report["servers"]:
        if r["status"] == "ok":
            mid = sorted(r["passes"], key=lambda p: p["output_tok_s"])[len(r["passes"]) // 2]
            lines.append(
                f"- {r['server']}: {mid['cpu_s_by_role']} (wall {mid['wall_s']:.2f} s, ready after "
                f"{r['ready_s']:.1f} s; resident MiB after the passes {r['rss_mib_by_role']})"
            )
    return "\n".join(lines) + "\n"


def write_report(
    args: argparse.Namespace,
    load_start: list[float],
    servers: list[dict[str, Any]],
    offline: dict[str, list[float]],
) -> str:
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "command": command_line(Path(sys.executable).name),
        "workload": f"{args.num_requests} concurrent /v1/completions, {args.input_len} prompt tokens (ids), "
        f"{args.output_len} output tokens, greedy, ignore_eos, not streamed, {args.dtype}; "
        f"warm-up pass then {args.repeats} timed passes per server",
        "machine": {**machine_info(), "cores_used": parse_cpu_list(args.cores)},
        "git": git_state(("dsinfer",)),
        "load_average_start": load_start,
        "load_average_end": load_average(),
        "servers": servers,
        "offline_output_tok_s": offline,
    }
    text = markdown(report)
    if args.out:
        write_json(args.out, report)
        plot_result(args.out)
    if args.markdown:
        args.markdown.write_text(text)
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", default=",".join(SERVERS))
    p.add_argument("--model", type=Path, default=Path("/work/bench-scratch/ckpt/tiny-f32"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--offline-repeats", type=int, default=3, help="0: no offline figures")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cores", default="0,1")
    p.add_argument("--python", default=sys.executable, help="dsinfer's python")
    p.add_argument("--vllm-python", default="/work/peers/vllm/bin/python")
    p.add_argument("--vllm-reserved-cpus", type=int, default=0, help="VLLM_CPU_NUM_OF_RESERVED_CPU")
    p.add_argument("--kv-cache-gb", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--dsinfer-flags", default="", help="extra flags for dsinfer serve")
    p.add_argument("--scratch", type=Path, default=Path("/work/bench-scratch"))
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--out", type=Path)
    p.add_argument("--markdown", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (args.model / "config.json").exists():
        progress(f"building the checkpoint {args.model}")
        subprocess.run(
            [args.python, str(BENCH_DIR / "make_bench_checkpoint.py"), "--out", str(args.model)], check=True
        )
    for sub in ("tmp", "logs"):
        (args.scratch / sub).mkdir(parents=True, exist_ok=True)
    log_dir = args.scratch / "logs" / f"serving-{time.strftime('%Y%m%d-%H%M%S')}"
    log_dir.mkdir(parents=True)
    load_start = load_average()
    servers: list[dict[str, Any]] = []
    offline: dict[str, list[float]] = {"dsinfer": [], "vllm": []}
    names = args.servers.split(",")
    unknown = [n for n in names if n not in SERVERS]
    if unknown:
        raise SystemExit(f"unknown server {unknown[0]!r}; choose from {', '.join(SERVERS)}")
    for name in names:  # the report is rewritten after each server: a cut run keeps what it has
        servers.append(asyncio.run(run_server(name, args, log_dir)))
        write_report(args, load_start, servers, offline)
    if args.offline_repeats > 0:
        offline.update(run_offline(args, log_dir))
    print(write_report(args, load_start, servers, offline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
