"""Stage ``kernels``: benchmarks/kernels/bench_kernels.py ``--quick`` (no torch-reference timings):
copy and matmul ceilings measured in the same run, MLA decode (batch 64 and 128, 4K contexts, 16
and 128 heads, 1 and 2 query tokens; the pointer kernel beside the TMA kernel where the TMA kernel
is the default), V3.2's sparse kernels (indexer logits over the FP8 key cache, sparse MLA decode),
the dense and grouped FP8 GEMMs at V3 shapes in both layouts, the gate; FlashMLA and DeepGEMM
beside them where they import. Every kernel's output is checked against its torch reference; a
mismatch (a library's included) or an error of dsinfer's kernels fails the stage, while a library
that raised is listed under ``library_errors``. The targets (80% of copy bandwidth, 60% of the
roofline or of the fp8 rate) are reported, not enforced."""

from __future__ import annotations

import json
import sys
from typing import Any

from .common import StageContext, StageResult, run_logged

BENCH = "benchmarks/kernels/bench_kernels.py"
SECTIONS = ("mla", "dense_gemm", "grouped_gemm", "gate", "sparse")
# A case's entries beside its main one (bench_kernels.py's TRITON_ENTRIES and LIBRARY_ENTRIES).
TRITON_ENTRIES = ("triton_pointer", "indexer", "indexer_topk", "sparse_mla")
LIBRARY_ENTRIES = ("flashmla", "deepgemm", "ops_deepgemm")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _measured(r: dict[str, Any], key: str) -> dict[str, Any] | None:
    """``r[key]`` when it was timed (not absent, skipped or failed)."""
    e = r.get(key)
    return e if isinstance(e, dict) and "median_us" in e else None


def _time(r: dict[str, Any], key: str, label: str, fraction: str | None = None, of: str = "") -> str:
    """``, label X us (Y of ...)`` for a timed entry, else nothing."""
    e = _measured(r, key)
    if e is None:
        return ""
    part = f", {label} {e['median_us']:.1f} us"
    return part + (f" ({_pct(e.get(fraction))} of {of})" if fraction else "")


def _mla(r: dict[str, Any]) -> str:
    launch = r.get("launch") or {}
    return (
        f"{r['triton']['median_us']:.1f} us ({launch.get('kernel')}), cache "
        f"{_pct(r.get('cache_fraction_of_copy'))} of copy, {_pct(r.get('roofline_fraction'))} of "
        f"roofline, target met: {r.get('target_met')}"
        + _time(r, "triton_pointer", "pointer", "roofline_fraction", "roofline")
        + _time(r, "flashmla", "FlashMLA", "roofline_fraction", "roofline")
    )


def _gemm(r: dict[str, Any]) -> str:
    return (
        f"{r['triton']['median_us']:.1f} us, {_pct(r.get('fraction_of_fp8'))} of fp8"
        + (f", target met: {r['target_met']}" if "target_met" in r else "")
        + _time(r, "deepgemm", "DeepGEMM", "fraction_of_fp8", "fp8")
        + _time(r, "ops_deepgemm", "DeepGEMM adapter")
    )


def _sparse(r: dict[str, Any]) -> str:
    parts = [
        _time(r, "indexer", "indexer", "key_fraction_of_copy", "copy"),
        _time(r, "indexer_topk", "indexer_topk"),
        _time(r, "deepgemm", "DeepGEMM indexer_topk"),
        _time(r, "sparse_mla", "sparse MLA", "roofline_fraction", "roofline"),
        _time(r, "flashmla", "FlashMLA sparse", "roofline_fraction", "roofline"),
    ]
    return "".join(parts).removeprefix(", ") or "nothing timed"


def _library(info: dict[str, Any]) -> str:
    return f"absent: {info['absent']}" if "absent" in info else f"{info.get('version')} ({info.get('file')})"


def _mismatched(r: dict[str, Any]) -> list[str]:
    """The case's checks that failed: its own, its Triton entries', its libraries' (an entry that
    raised has no check: it is an error, counted elsewhere)."""
    bad = ["kernel"] if r.get("check") and not r["check"].get("ok") else []
    for key in (*TRITON_ENTRIES, *LIBRARY_ENTRIES):
        e = r.get(key)
        if isinstance(e, dict) and e.get("check") and not e["check"].get("ok"):
            bad.append(key)
    return [f"{r['case']} {key}" for key in bad]


def _library_errors(section: str, r: dict[str, Any]) -> list[str]:
    return [
        f"{section} {r['case']} {key}: {r[key]['error']}"
        for key in LIBRARY_ENTRIES
        if isinstance(r.get(key), dict) and "error" in r[key]
    ]


def figures(data: dict[str, Any], result: StageResult) -> list[dict[str, Any]]:
    """The figures of bench_kernels.py's JSON; returns its case records."""
    ceil = data.get("ceilings") or {}
    f = result.figures
    f["copy_tb_per_s"] = round(ceil.get("copy_tb_per_s", 0.0), 3)
    f["bf16_tflops"] = round(ceil.get("bf16_tflops", 0.0), 1)
    f["fp8_tflops"] = round(ceil.get("fp8_tflops", 0.0), 1)
    f["fp8_source"] = ceil.get("fp8_source")
    f["libraries"] = {
        name: _library(info) for name, info in (data.get("meta", {}).get("libraries") or {}).items()
    }
    ok = {key: [r for r in data.get(key, []) if "error" not in r] for key in SECTIONS}
    f["mla"] = {r["case"]: _mla(r) for r in ok["mla"]}
    for key in ("dense_gemm", "grouped_gemm"):
        f[key] = {r["case"]: _gemm(r) for r in ok[key]}
    f["gate"] = {r["case"]: f"{r['triton']['median_us']:.1f} us" for r in ok["gate"]}
    f["sparse"] = {r["case"]: _sparse(r) for r in ok["sparse"]}
    f["library_errors"] = [e for key in SECTIONS for r in ok[key] for e in _library_errors(key, r)]
    return [r for key in SECTIONS for r in data.get(key, [])]


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
    records = figures(data, result)
    f = result.figures
    mismatched = [name for r in records for name in _mismatched(r)]
    errors = [f"{e['section']} {e['case']}: {e['error']}" for e in data.get("errors", [])]
    result.check("every kernel equals its torch reference", not mismatched, ", ".join(mismatched))
    result.check("no case raised", not errors, "; ".join(errors)[:1000])
    result.check("the benchmark finished", code == 0, f"exit {code}")
    usage = data.get("jit_usage") or []
    if usage:  # the launched builds (the JIT's own specialization): reported, not judged
        result.figures["jit registers/spills"] = sorted({
            f"{u['kernel']} {'x'.join(u['constexprs'].get(k, '') for k in ('BLOCK_M', 'BLOCK_N') if k in u['constexprs'])}"
            f" w{u['num_warps']}: {u['registers']} regs, {u['spills']} spills"
            for u in usage
        })  # fmt: skip
    met = [r.get("target_met") for r in records if "target_met" in r]
    result.summary = (
        f"copy {f['copy_tb_per_s']} TB/s, bf16 {f['bf16_tflops']} / fp8 {f['fp8_tflops']} TFLOP/s; "
        f"{len(records)} cases, {len(mismatched)} mismatched, {len(errors)} errors, "
        f"{len(f['library_errors'])} library errors; targets met {sum(bool(m) for m in met)}/{len(met)}"
    )
