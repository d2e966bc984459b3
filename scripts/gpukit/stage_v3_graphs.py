"""Stage ``v3-graphs``: benchmarks/kernels/bench_decode_graph.py on a reduced-depth, full-width
DeepSeek-V3 (4 layers: 1 dense, 3 MoE with 256 FP8 experts): one decode step at batch 1, 32 and
128 over 4K-token contexts, eager, through the static buffers, and replayed from CUDA graphs, with
the kernel backends ``select_ops`` picks (DeepGEMM and FlashMLA where they import); then three
replays of the batch-128 graph under torch.profiler (``profile/kernels.md``: GPU time per kernel
per step; ``profile/trace.json.gz``). Under ``--cpu-smoke``: the tiny preset's sizes, eager and
static only. With ``--mtp`` (every run but where DeepGEMM imports: its JIT compiles the
two-token shapes during capture, which would double the stage's time) the MTP verification step
beside each, from two-token graphs, and its cost relative to the plain step."""

from __future__ import annotations

import importlib.util
import json
import sys

from .common import StageContext, StageResult, run_logged

BENCH = "benchmarks/kernels/bench_decode_graph.py"
GPU_ARGS = [
    "--layers",
    "4",
    "--batch-sizes",
    "1,32,128",
    "--context",
    "4096",
    "--iters",
    "20",
    "--warmup",
    "3",
]
SMOKE_ARGS = [
    "--device", "cpu", "--config", "configs/models/tiny/config.json", "--layers", "2",
    "--batch-sizes", "1,4", "--context", "64", "--iters", "2", "--warmup", "1",
]  # fmt: skip


def run(ctx: StageContext, result: StageResult) -> None:
    out = ctx.out / "decode_graph.json"
    argv = [sys.executable, BENCH, *(SMOKE_ARGS if ctx.cpu_smoke else GPU_ARGS), "--out", str(out)]
    argv += ["--profile", str(ctx.out / "profile")]
    if importlib.util.find_spec("deep_gemm") is None:
        argv.append("--mtp")
    code, tail = run_logged(argv, ctx.out / "bench.log", ctx.budget_s * 0.95)
    if not out.is_file():
        result.error = f"{BENCH} wrote no results (exit {code}):\n{tail}"
        return
    data = json.loads(out.read_text())
    rows = data["results"]
    for r in rows:
        cells = {
            m: f"{r[m]['median_ms']:.2f} ms ({r[m]['tokens_per_s']:.0f} tok/s)"
            for m in ("eager", "static", "graph")
            if m in r
        }
        if "graph_speedup" in r:
            cells["graph speedup"] = f"{r['graph_speedup']:.2f}x"
        if "verify" in r:
            cells["MTP verify"] = (
                f"{r['verify']['median_ms']:.2f} ms ({r['verify_over_plain']:.2f}x the plain step)"
            )
        result.figures[f"B={r['batch_size']}"] = cells
    result.figures["backends"] = data.get("backends")
    profiled = next((r["profile"] for r in rows if "profile" in r), None)
    if profiled is not None:
        result.figures[f"profile B={rows[-1]['batch_size']}"] = {
            "kernel us per step": round(profiled["kernel_us_per_step"], 1),
            "top": [
                f"{t['kernel'][:60]}: {t['us_per_step']:.0f} us ({t['share']:.0%})"
                for t in profiled["top"][:8]
            ],
        }
    result.check("every batch size measured", len(rows) == len(data["args"]["batch_sizes"]))
    if not ctx.cpu_smoke:
        result.check("every batch size replayed from a CUDA graph", all("graph" in r for r in rows))
    best = rows[-1] if rows else {}
    mode = "graph" if "graph" in best else "static"
    result.summary = (
        f"{data['model']['layers']} layers, {data['model']['routed_experts']} experts: "
        + ", ".join(f"B={r['batch_size']} {r.get(mode, r['eager'])['median_ms']:.2f} ms" for r in rows)
        + f" ({mode})"
    )
