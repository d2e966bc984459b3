"""``scripts/gpu-check``: the GPU acceptance kit (docs/gpu.md).

Runs the selected stages one after another, each in its own process under a time limit (one
failing, hanging or crashing does not stop the rest), and writes ``summary.json`` and
``summary.md`` to ``--out`` after every stage, so a run cut short keeps what it had. Exits 0 when
no stage failed, 1 otherwise, 2 when it cannot start (no CUDA without ``--cpu-smoke``, bad
arguments, wheels that do not install).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .common import RESULT_FILE, ROOT, StageContext, log, run_logged
from .stages import BY_NAME, STAGES, Stage

MIN_STAGE_S = 20.0  # a stage with less time than this left is skipped, not started


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scripts/gpu-check",
        description="GPU acceptance of dsinfer in one command: stages, each bounded in time; JSON and "
        "markdown summary to --out (docs/gpu.md).",
    )
    p.add_argument(
        "--out", type=Path, required=True, help="folder for summary.json, summary.md, one folder per stage"
    )
    p.add_argument("--cpu-smoke", action="store_true", help="every stage's plumbing on CPU at tiny sizes")
    p.add_argument(
        "--stages",
        default="all",
        help=f"comma-separated stages to run, in that order (default all, in this order): {','.join(BY_NAME)}",
    )
    p.add_argument("--skip", default="", help="comma-separated stages not to run")
    p.add_argument(
        "--budget-s",
        default="",
        help="time limits in seconds: N for every stage, or STAGE=N,... (defaults in --list)",
    )
    p.add_argument(
        "--deadline-s",
        type=float,
        default=1500.0,
        help="the whole run's limit (default 1500); a stage gets at most what is left, and none "
        f"starts with less than {MIN_STAGE_S:.0f} s",
    )
    p.add_argument(
        "--wheels",
        type=Path,
        default=None,
        help="install these wheels (pip --no-index --find-links) and dsinfer (editable) first: "
        "what scripts/gpu-wheels downloaded",
    )
    p.add_argument("--list", action="store_true", help="print the stages and their time limits, and exit")
    args = p.parse_args(argv)
    names = (
        list(BY_NAME) if args.stages == "all" else [s.strip() for s in args.stages.split(",") if s.strip()]
    )
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = [s for s in [*names, *skip] if s not in BY_NAME]
    if unknown:
        p.error(f"unknown stage {unknown[0]!r}; stages: {','.join(BY_NAME)}")
    args.selected = [BY_NAME[n] for n in dict.fromkeys(names) if n not in skip]  # in the order given
    try:
        args.budgets = _budgets(args.budget_s)
    except ValueError as exc:
        p.error(str(exc))
    return args


def _budgets(spec: str) -> dict[str, float]:
    """``"300"`` -> every stage 300 s; ``"kernels=400,parity=200"`` -> those two."""
    if not spec.strip():
        return {}
    if "=" not in spec:
        return dict.fromkeys(BY_NAME, float(spec))
    out = {}
    for part in spec.split(","):
        name, _, value = part.partition("=")
        if name.strip() not in BY_NAME:
            raise ValueError(f"--budget-s names unknown stage {name.strip()!r}")
        out[name.strip()] = float(value)
    return out


def cuda_missing() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch does not import"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    return None


def install_wheels(folder: Path, log_path: Path) -> str | None:
    """The carried wheels, then dsinfer itself (editable, no dependencies fetched). -> why not, or None."""
    wheels = sorted(str(w) for w in folder.glob("*.whl"))
    if not wheels:
        return f"no wheels in {folder}"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(folder)]
    for argv in ([*pip, *wheels], [*pip, "--no-deps", "--no-build-isolation", "-e", str(ROOT)]):
        code, tail = run_logged(argv, log_path, timeout=600)
        if code != 0:
            return f"{shlex.join(argv[:8])} ... failed ({code}): {tail[-800:]}"
    return None


def run_stage(stage: Stage, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    out = args.out / stage.name
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULT_FILE).unlink(missing_ok=True)
    budget = args.budgets.get(stage.name, stage.smoke_budget_s if args.cpu_smoke else stage.budget_s)
    left = deadline - time.monotonic()
    if left < MIN_STAGE_S:
        return _synthetic(stage, "skip", f"not started: {left:.0f} s left of --deadline-s", 0.0)
    budget = min(budget, left)
    ctx = StageContext(stage.name, out, budget, args.cpu_smoke, "cpu" if args.cpu_smoke else "cuda")
    log(f"{stage.name}: start (limit {budget:.0f} s)")
    start = time.monotonic()
    env = {"TRITON_INTERPRET": "1"} if args.cpu_smoke else {}
    code, tail = run_logged(
        [sys.executable, "-m", "scripts.gpukit.run_stage", ctx.to_json()], out / "stage.log", budget, env
    )
    seconds = round(time.monotonic() - start, 1)
    result_path = out / RESULT_FILE
    if result_path.is_file():
        result = json.loads(result_path.read_text())
        if result.get("partial"):  # killed (or crashed) after some checks: keep them, fail the stage
            ended = f"killed at its {budget:.0f} s limit" if code is None else f"exited with {code}"
            result.update(status="fail", seconds=seconds, error=tail or None,
                          summary=f"{ended} after {len(result['checks'])} checks (kept): {result.get('summary') or ''}")  # fmt: skip
    elif code is None:
        result = _synthetic(stage, "fail", f"killed at its {budget:.0f} s limit", seconds, tail)
    else:
        result = _synthetic(stage, "fail", f"exited with {code} and no result", seconds, tail)
    log(
        f"{stage.name}: {result['status']} in {seconds:.0f} s: {result.get('summary') or result.get('skipped') or ''}"
    )
    return result


def _synthetic(stage: Stage, status: str, why: str, seconds: float, tail: str = "") -> dict[str, Any]:
    return {
        "stage": stage.name,
        "status": status,
        "summary": why,
        "figures": {},
        "checks": [],
        "skipped": why if status == "skip" else None,
        "error": tail or None if status == "fail" else None,
        "seconds": seconds,
    }


def git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def render_markdown(summary: dict[str, Any]) -> str:
    meta = summary["meta"]
    mode = "CPU smoke: every stage's plumbing at tiny sizes, nothing measured" if meta["cpu_smoke"] else "GPU"
    lines = [
        f"# gpu-check ({mode})",
        "",
        f"{meta['date']}, commit {meta['commit']}, {meta['host']}, python {meta['python']}",
        f"`{meta['command']}`",
        "",
        "| stage | status | s | summary |",
        "|---|---|---:|---|",
    ]
    for r in summary["stages"]:
        text = str(r.get("summary") or r.get("skipped") or "").replace("|", "/").replace("\n", " ")
        lines.append(f"| {r['stage']} | {r['status'].upper()} | {r['seconds']:.0f} | {text} |")
    for r in summary["stages"]:
        lines += ["", f"## {r['stage']}: {r['status']}", ""]
        for key, value in r.get("figures", {}).items():
            lines.append(f"- {key}: {_short(value)}")
        for c in r.get("checks", []):
            lines.append(
                f"- {'ok' if c['ok'] else 'FAILED'}: {c['name']}"
                + (f" ({c['detail']})" if c["detail"] else "")
            )
        if r.get("error"):
            lines += ["", "```", str(r["error"])[-1500:].strip(), "```"]
    return "\n".join(lines) + "\n"


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if isinstance(value, dict | list) else str(value)
    return text if len(text) <= 1200 else text[:1197] + "..."


def write_summary(args: argparse.Namespace, meta: dict[str, Any], results: list[dict[str, Any]]) -> None:
    summary = {"meta": meta, "stages": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    (args.out / "summary.md").write_text(render_markdown(summary))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.list:
        for s in STAGES:
            print(f"{s.name:15} {s.budget_s:5.0f} s (smoke {s.smoke_budget_s:.0f} s)  {s.proves}")
        return 0
    deadline = time.monotonic() + args.deadline_s
    if args.wheels is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        why = install_wheels(args.wheels, args.out / "wheels.log")
        if why is not None:
            print(f"gpu-check: the wheels do not install: {why}", file=sys.stderr)
            return 2
    if not args.cpu_smoke:
        why = cuda_missing()
        if why is not None:
            print(
                f"gpu-check: no CUDA GPU here ({why}); run it on a GPU machine, or add --cpu-smoke for the plumbing on CPU"
            )
            return 2
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["scripts/gpu-check", *argv]),
        "commit": git_commit(),
        "host": platform.node(),
        "python": platform.python_version(),
        "cpu_smoke": args.cpu_smoke,
        "stages_selected": [s.name for s in args.selected],
    }
    results: list[dict[str, Any]] = []
    for stage in args.selected:
        results.append(run_stage(stage, args, deadline))
        write_summary(args, meta, results)
    write_summary(args, meta, results)
    failed = [r["stage"] for r in results if r["status"] == "fail"]
    log(
        f"summary in {args.out / 'summary.md'}; "
        + (f"FAILED: {', '.join(failed)}" if failed else "no stage failed")
    )
    return 1 if failed else 0
