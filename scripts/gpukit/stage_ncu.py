"""Stage ``ncu``: one Nsight Compute launch each of MLA decode (B128 x 4K, 128 heads, the default
TMA kernel) and of the masked grouped FP8 GEMM (8 experts x 256 rows, w13), driven by
benchmarks/kernels/one_kernel.py: speed of light (SM and memory throughput against the peaks),
memory and compute workload, occupancy and launch statistics, as ``ncu_<kernel>.txt`` with the
headline metrics in the figures. Clocks are left as they are (``--clock-control none``).

Without ncu (or under ``--cpu-smoke``) the driver runs unprofiled at tiny shapes and the
profiling is reported skipped."""

from __future__ import annotations

import glob
import re
import shutil
import sys
from pathlib import Path

from .common import StageContext, StageResult, run_logged

DRIVER = "benchmarks/kernels/one_kernel.py"
TARGETS = {"mla": "_mla_decode_tma_kernel", "masked": "_masked_kernel"}  # driver kernel -> name regex
SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "ComputeWorkloadAnalysis", "Occupancy", "LaunchStats")
METRICS = (
    "Duration",
    "Memory Throughput",
    "DRAM Throughput",
    "Compute (SM) Throughput",
    "Registers Per Thread",
    "Theoretical Occupancy",
    "Achieved Occupancy",
    "Dynamic Shared Memory Per Block",
)


def find_ncu() -> str | None:
    found = shutil.which("ncu")
    if found:
        return found
    candidates = sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu") + glob.glob("/usr/local/cuda*/bin/ncu"))
    return candidates[-1] if candidates else None


def headline(text: str) -> dict[str, str]:
    """The METRICS rows of ncu's text report: ``name  unit  value`` lines."""
    found = {}
    for line in text.splitlines():
        for name in METRICS:
            if name not in found and line.strip().startswith(name):
                parts = re.split(r"\s{2,}", line.strip())
                if len(parts) >= 3:
                    found[name] = f"{parts[-1]} {parts[-2]}"
    return found


def run(ctx: StageContext, result: StageResult) -> None:
    ncu = None if ctx.cpu_smoke else find_ncu()
    share = ctx.budget_s * 0.45
    for kernel, regex in TARGETS.items():
        driver = [sys.executable, DRIVER, "--kernel", kernel]
        if ctx.cpu_smoke:
            driver += ["--device", "cpu", "--tiny", "--launches", "2"]
        if ncu is None:
            code, tail = run_logged(
                driver, ctx.out / f"{kernel}.log", share, {"TRITON_INTERPRET": "1"} if ctx.cpu_smoke else None
            )
            result.check(f"{kernel}: the driver runs", code == 0, tail[-300:] if code else "")
            continue
        argv = [ncu, "--target-processes", "all", "--clock-control", "none", "--kernel-name", f"regex:{regex}",
                "--launch-skip", "2", "--launch-count", "1"]  # fmt: skip
        for section in SECTIONS:
            argv += ["--section", section]
        report = ctx.out / f"ncu_{kernel}.txt"
        code, tail = run_logged([*argv, *driver], report, share)
        text = Path(report).read_text(errors="replace")
        figures = headline(text)
        result.figures[kernel] = figures or tail[-400:]
        result.check(f"{kernel}: ncu profiled one launch", code == 0 and bool(figures), f"exit {code}")
    if ncu is None:
        result.skipped = "no ncu here (or CPU smoke): the drivers ran unprofiled"
        result.summary = result.skipped
        return
    result.summary = "; ".join(
        f"{k}: {v.get('Duration', '?')}, SM {v.get('Compute (SM) Throughput', '?')}, memory {v.get('Memory Throughput', '?')}"
        for k, v in result.figures.items()
        if isinstance(v, dict)
    )
