"""Stage ``kernels``: benchmarks/kernels/bench_kernels.py ``--quick`` (no torch-reference timings):
copy and matmul ceilings measured in the same run, MLA decode (batch 64 and 128, 4K contexts, 16
and 128 heads, 1 and 2 query tokens), the dense and grouped FP8 GEMMs at V3 shapes in both
layouts, the gate. Every kernel's output is checked against its torch reference; a mismatch or an
error fails the stage. The targets (80% of copy bandwidth, 60% of the roofline or of the fp8
rate) are reported, not enforced."""

from __future__ import annotations

import json
import sys
from typing import Any

from scripts.gpukit.common import StageContext, StageResult, run_logged

BENCH = "benchmarks/kernels/bench_kernels.py"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def run(ctx: StageContext, result: StageResult) -> None:
    out = ctx.out / "kernels.json"
    argv = [
        sys.executable,
        BENCH,
        "--quick",
        "--no-torch",
        "--out",
        str(out),
        "--markdown",
        str(ctx.out / "kernels.md"),
    ]
    if ctx.cpu_smoke:
        argv += ["--device", "cpu", "--tiny", "--iters", "2", "--warmup", "0", "--max-seconds", "1"]
    code, tail = run_logged(argv, ctx.out / "bench.log", ctx.budget_s * 0.95)
    if not out.is_file():
        result.error = f"{BENCH} wrote no results (exit {code}):\n{tail}"
        return
    data: dict[str, Any] = json.loads(out.read_text())
    ceil = data.get("ceilings") or {}
    f = result.figures
    f["copy_tb_per_s"] = round(ceil.get("copy_tb_per_s", 0.0), 3)
    f["bf16_tflops"] = round(ceil.get("bf16_tflops", 0.0), 1)
    f["fp8_tflops"] = round(ceil.get("fp8_tflops", 0.0), 1)
    f["fp8_source"] = ceil.get("fp8_source")
    f["mla"] = {
        r[
            "case"
        ]: f"{r['triton']['median_us']:.1f} us, cache {_pct(r.get('cache_fraction_of_copy'))} of copy, "
        f"{_pct(r.get('roofline_fraction'))} of roofline, target met: {r.get('target_met')}"
        for r in data.get("mla", [])
        if "error" not in r
    }
    for key in ("dense_gemm", "grouped_gemm"):
        f[key] = {
            r["case"]: f"{r['triton']['median_us']:.1f} us, {_pct(r.get('fraction_of_fp8'))} of fp8"
            + (f", target met: {r['target_met']}" if "target_met" in r else "")
            for r in data.get(key, [])
            if "error" not in r
        }
    f["gate"] = {
        r["case"]: f"{r['triton']['median_us']:.1f} us" for r in data.get("gate", []) if "error" not in r
    }
    records = [r for key in ("mla", "dense_gemm", "grouped_gemm", "gate") for r in data.get(key, [])]
    mismatched = [r["case"] for r in records if r.get("check") and not r["check"].get("ok")]
    errors = [f"{e['section']} {e['case']}: {e['error']}" for e in data.get("errors", [])]
    result.check("every kernel equals its torch reference", not mismatched, ", ".join(mismatched))
    result.check("no case raised", not errors, "; ".join(errors)[:1000])
    result.check("the benchmark finished", code == 0, f"exit {code}")
    met = [r.get("target_met") for r in records if "target_met" in r]
    result.summary = (
        f"copy {f['copy_tb_per_s']} TB/s, bf16 {f['bf16_tflops']} / fp8 {f['fp8_tflops']} TFLOP/s; "
        f"{len(records)} cases, {len(mismatched)} mismatched, {len(errors)} errors; "
        f"targets met {sum(bool(m) for m in met)}/{len(met)}"
    )
