"""Stage ``sweeps``: launch parameters around the defaults, measured.

1. MLA decode at B128 x 4K, one query token, 16 and 128 heads (``bench_kernels.py --only mla
   --sweep-mla``): the TMA kernel's tiles, stages, channel parts and split counts, and the pointer
   kernel's, each timed; the best beside the default launch.
2. The FP8 GEMM tiles (``sweep_gemm.py``) with the time left.

Every timed configuration is checked against the torch reference by the scripts; a failed script
fails the stage, a slow default is reported, not judged."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from .common import StageContext, StageResult, run_logged

MLA_ARGS = ["--only", "mla", "--sweep-mla", "--quick", "--no-torch", "--no-libraries", "--mla-batches", "128",
            "--mla-s-q", "1"]  # fmt: skip
SMOKE = ["--device", "cpu", "--tiny"]
SMOKE_TIMING = ["--iters", "2", "--warmup", "0", "--max-seconds", "1"]


def _mla_figures(data: dict[str, Any]) -> dict[str, str]:
    figures = {}
    for case in data.get("mla", []):
        sweep = [r for r in case.get("sweep", []) if "median_us" in r]
        if not sweep or "triton" not in case:
            continue
        best = sweep[0]
        keys = ("kernel", "block_m", "block_n", "num_warps", "num_stages", "dv_parts", "num_splits")
        launch = " ".join(f"{k}={best[k]}" for k in keys if k in best)
        figures[case["case"]] = (
            f"default {case['triton']['median_us']:.1f} us; best {best['median_us']:.1f} us ({launch})"
        )
    return figures


def run(ctx: StageContext, result: StageResult) -> None:
    start = time.monotonic()
    env = {"TRITON_INTERPRET": "1"} if ctx.cpu_smoke else None
    mla_out = ctx.out / "sweep_mla.json"
    argv = [sys.executable, "benchmarks/kernels/bench_kernels.py", *MLA_ARGS, "--out", str(mla_out),
            "--markdown", str(ctx.out / "sweep_mla.md")]  # fmt: skip
    argv += ["--mla-heads", "16" if ctx.cpu_smoke else "16,128"]
    if ctx.cpu_smoke:
        argv += [*SMOKE, *SMOKE_TIMING]
    code, tail = run_logged(argv, ctx.out / "sweep_mla.log", ctx.budget_s * 0.7, env)
    if mla_out.is_file():
        data = json.loads(mla_out.read_text())
        result.figures["mla"] = _mla_figures(data)
        mismatched = [c["case"] for c in data.get("mla", []) if c.get("check") and not c["check"].get("ok")]
        result.check(
            "MLA: the default launch equals the torch reference", not mismatched, ", ".join(mismatched)
        )
    result.check(
        "MLA sweep finished", code == 0 and mla_out.is_file(), f"exit {code}: {tail[-300:]}" if code else ""
    )

    left = ctx.budget_s * 0.95 - (time.monotonic() - start)
    gemm_out = ctx.out / "sweep_gemm.json"
    argv = [sys.executable, "benchmarks/kernels/sweep_gemm.py", "--out", str(gemm_out),
            "--markdown", str(ctx.out / "sweep_gemm.md"), "--deadline-s", str(max(left - 25, 5))]  # fmt: skip
    if ctx.cpu_smoke:
        argv += [*SMOKE, "--iters", "1"]
    code, tail = run_logged(argv, ctx.out / "sweep_gemm.log", max(left, 10), env)
    if gemm_out.is_file():
        data = json.loads(gemm_out.read_text())
        result.figures["gemm best"] = {
            case["case"]: case["best"]
            for section in ("masked", "contiguous", "dense")
            for case in data.get(section, [])
        }
    result.check(
        "GEMM sweep finished", code == 0 and gemm_out.is_file(), f"exit {code}: {tail[-300:]}" if code else ""
    )
    result.summary = (
        "; ".join(f"{k}: {v}" for k, v in result.figures.get("mla", {}).items()) or "no MLA figures"
    )
