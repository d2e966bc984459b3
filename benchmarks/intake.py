r"""Intake under oversized prompts: /health latency and a short request's latency while multi-MB
prompts arrive at the gateway, on two commits (before and after bounded, non-blocking intake).

Each run starts a gateway process (``dsinfer serve --role gateway``) on a clean ``git archive`` of
the commit (``harness.provenance.export_commit``) and a colocated rank played by this script over the
real control protocol (``harness.played_rank.PlayedRank``, CURVE with the cluster secret where the
commit has it): it registers with a 163840-token context (DeepSeek-V3's, so that MB-sized prompts
are not refused on length before they are tokenized, except by the newer character check) and
answers every request with ``--short-tokens`` tokens, one per 10 ms. No model runs: what is
measured is the gateway.

A run: an idle window (``/health`` every 50 ms and short completions one after the other, for
``--idle-seconds``), then ``--concurrent`` prompts of ``--prompt-mb`` MB of text sent at once while
the same two probes go on, until every oversized prompt is answered. Reported per window: /health
latency p50 and max, the short request's latency p50 and max and how many completed, the
oversized prompts' status codes and latencies, and the gateway's peak RSS growth over the window
(VmHWM after ``clear_refs``). Commits alternate order between repeats; the load average is
recorded at the start and end of every run: compare only numbers taken on a quiet machine.

    /work/venv/bin/python benchmarks/intake.py --commits a1a5690,HEAD --prompt-mb 3,6 --repeats 3 \
        --out benchmarks/results/intake.json --markdown benchmarks/results/intake.md
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import os
import secrets
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from dsinfer.base.cluster_secret import ControlKeys
from harness.played_rank import PlayedRank
from harness.plots import plot_result
from harness.progress import progress
from harness.provenance import export_commit, machine_info
from harness.results import add_output_args, save_report
from harness.server import gateway

CONTEXT = 163_840
TEXT = "hello world, this is an oversized prompt. "


def _memory(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "p50": None, "max": None}
    return {"n": len(values), "p50": statistics.median(values), "max": max(values)}


def _probe(
    url: str, stop: threading.Event, health: list[float], short: list[float], errors: list[str]
) -> None:
    """/health every 50 ms on one thread, short completions back to back on another."""

    def health_loop() -> None:
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    client.get(f"{url}/health")
                    health.append(time.monotonic() - started)
                except httpx.HTTPError as e:
                    errors.append(f"health: {e!r}")
                stop.wait(0.05)

    def short_loop() -> None:
        body = {"prompt": "Hello", "max_tokens": 4}
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    r = client.post(f"{url}/v1/completions", json=body)
                    if r.status_code == 200:
                        short.append(time.monotonic() - started)
                    else:
                        errors.append(f"short: HTTP {r.status_code}")
                except httpx.HTTPError as e:
                    errors.append(f"short: {e!r}")

    threads = [threading.Thread(target=f, daemon=True) for f in (health_loop, short_loop)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _window(url: str, during: Callable[[], None]) -> dict[str, Any]:
    """The probes (``_probe``) while ``during()`` runs: /health and short-request latencies."""
    stop, health, short, errors = threading.Event(), [], [], []
    prober = threading.Thread(target=_probe, args=(url, stop, health, short, errors), daemon=True)
    prober.start()
    during()
    stop.set()
    prober.join()
    return {"health_s": _stats(health), "short_s": _stats(short), "errors": errors[:5]}


def run_once(source: Path, args: argparse.Namespace, prompt_mb: float, log_path: Path) -> dict[str, Any]:
    secret = secrets.token_urlsafe(32)
    curve = (source / "dsinfer/base/control_auth.py").exists()
    load_start = os.getloadavg()[0]
    with gateway(log_path, secret, source=source) as gw:
        assert gw.control is not None
        url, deadline = gw.base_url, time.monotonic() + 120
        keys = ControlKeys.from_secret(secret) if curve else None
        rank = PlayedRank(gw.control, keys, max_model_len=CONTEXT, interval=0.01, tokens=args.short_tokens)
        try:
            while (
                httpx.post(
                    f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30
                ).status_code
                != 200
            ):
                assert time.monotonic() < deadline, "the rank did not register"
                time.sleep(0.2)
            windows: dict[str, Any] = {"idle": _window(url, lambda: time.sleep(args.idle_seconds))}
            # oversized prompts
            Path(f"/proc/{gw.pid}/clear_refs").write_text("5")
            rss_before = _memory(gw.pid, "VmRSS")
            text = TEXT * int(prompt_mb * 1e6 / len(TEXT))
            answers: list[tuple[int, float]] = []

            def oversized() -> tuple[int, float]:
                started = time.monotonic()
                try:
                    r = httpx.post(
                        f"{url}/v1/completions", json={"prompt": text, "max_tokens": 4}, timeout=600
                    )
                    return r.status_code, time.monotonic() - started
                except httpx.HTTPError:
                    return 0, time.monotonic() - started

            def burst() -> None:
                time.sleep(0.5)
                with concurrent.futures.ThreadPoolExecutor(args.concurrent) as pool:
                    answers.extend(pool.map(lambda _: oversized(), range(args.concurrent)))
                time.sleep(0.5)

            windows["oversized"] = {
                **_window(url, burst),
                "statuses": [a[0] for a in answers],
                "oversized_s": [round(a[1], 3) for a in answers],
                "peak_rss_growth_mib": round((_memory(gw.pid, "VmHWM") - rss_before) / 2**20, 1),
            }
        finally:
            rank.stop()
    return {"prompt_mb": prompt_mb, "curve": curve, "load": [load_start, os.getloadavg()[0]], **windows}


def _fmt(value: float | None, scale: float = 1000.0) -> str:
    return "-" if value is None else f"{value * scale:.0f}"


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Intake under oversized prompts ({report['date']})",
        "",
        f"- machine: {report['machine'].get('cpu_model', '?')}, {report['machine']['online_cpus']} CPUs",
        "- commits: " + ", ".join(f"{c['label']} = {c['sha']}" for c in report["commits"]),
        f"- command: `{report['command']}`",
        f"- {report['concurrent']} prompts of each size at once; a short request = 4 tokens from a rank that answers at once",
        "",
        "| commit | prompt MB | window | /health p50 ms | /health max ms | short p50 ms | short max ms | shorts done | oversized: status, s | peak RSS growth MiB | load start/end |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in report["runs"]:
        for window in ("idle", "oversized"):
            w = run[window]
            over = ""
            if window == "oversized":
                over = ", ".join(f"{s} {t:.1f}" for s, t in zip(w["statuses"], w["oversized_s"], strict=True))
            lines.append(
                f"| {run['label']} | {run['prompt_mb']} | {window} | {_fmt(w['health_s']['p50'])} | "
                f"{_fmt(w['health_s']['max'])} | {_fmt(w['short_s']['p50'])} | {_fmt(w['short_s']['max'])} | "
                f"{w['short_s']['n']} | {over} | {w.get('peak_rss_growth_mib', '')} | "
                f"{run['load'][0]:.1f}/{run['load'][1]:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--commits",
        default="a1a5690,HEAD",
        help="comma-separated revisions (first = before; a1a5690: main before issue 17)",
    )
    parser.add_argument("--prompt-mb", default="3,6", help="sizes of the oversized prompts, MB of text")
    parser.add_argument("--concurrent", type=int, default=3, help="oversized prompts sent at once")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--idle-seconds", type=float, default=3.0)
    parser.add_argument("--short-tokens", type=int, default=4)
    add_output_args(parser)
    args = parser.parse_args()
    sizes = [float(x) for x in args.prompt_mb.split(",")]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="dsinfer-intake-") as tmp:
        commits = []
        for i, rev in enumerate(args.commits.split(",")):
            sha, source = export_commit(rev, Path(tmp) / f"src{i}")
            commits.append({"label": rev, "sha": sha, "source": source})
        for repeat in range(args.repeats):
            order = [(c, mb) for mb in sizes for c in commits]
            for commit, mb in order if repeat % 2 == 0 else order[::-1]:
                progress(f"[{commit['label']} {mb} MB r{repeat}] load {os.getloadavg()[0]:.1f}")
                result = run_once(
                    commit["source"], args, mb, Path(tmp) / f"gw-{commit['label']}-{mb}-{repeat}.log"
                )
                runs.append({"repeat": repeat, "label": commit["label"], **result})
                over = result["oversized"]
                progress(
                    f"[{commit['label']} {mb} MB r{repeat}] /health max {_fmt(over['health_s']['max'])} ms, "
                    f"short max {_fmt(over['short_s']['max'])} ms, oversized {over['statuses']} "
                    f"{over['oversized_s']} s, RSS +{over['peak_rss_growth_mib']} MiB"
                )
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": machine_info(),
        "command": " ".join(["benchmarks/intake.py", *sys.argv[1:]]),
        "concurrent": args.concurrent,
        "commits": [{"label": c["label"], "sha": c["sha"]} for c in commits],
        "runs": runs,
    }
    save_report(report, markdown(report), args.out, args.markdown, indent=1)
    plot_result(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
