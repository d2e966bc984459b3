"""NVIDIA's aiperf, unmodified, as the client of a trace replay.

``write_mooncake_trace`` writes requests in Mooncake's trace format (what aiperf's
``mooncake_trace`` dataset reads): each hash id a block of ``block_tokens`` tokens (aiperf's
``--isl-block-size``), input lengths scaled from the trace's 512-token blocks and cut to a
context limit, output lengths fixed. ``run_aiperf`` plays it at its timestamps
(``--fixed-schedule``) against an OpenAI completions endpoint, streaming, and reads the run's
summary: requests, failures, throughput and TTFT percentiles.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from harness.traces import TRACE_BLOCK_TOKENS, TraceRequest


def write_mooncake_trace(
    requests: list[TraceRequest],
    path: Path,
    *,
    block_tokens: int,
    limit: int,
    max_tokens: int,
    speedup: float,
) -> None:
    t0 = requests[0].timestamp_ms if requests else 0
    with path.open("w") as f:
        for r in requests:
            length = min(limit, max(1, -(-r.input_length * block_tokens // TRACE_BLOCK_TOKENS)))
            blocks = list(r.hash_ids[: -(-length // block_tokens)])
            record = {
                "timestamp": round((r.timestamp_ms - t0) / speedup),
                "input_length": length,
                "output_length": max_tokens,
                "hash_ids": blocks,
            }
            f.write(json.dumps(record) + "\n")


def offline_tokenizer(directory: Path, cache: Path) -> tuple[str, dict[str, str]]:
    """A repo name and the environment under which aiperf loads the tokenizer files of
    ``directory`` offline: aiperf's worker processes force offline mode, where it resolves
    names in the Hugging Face cache only, so the files become that cache's snapshot of the name."""
    snapshot = cache / "models--dsinfer--tokenizer" / "snapshots" / "local"
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        if (directory / name).exists():
            (snapshot / name).write_bytes((directory / name).read_bytes())
    refs = cache / "models--dsinfer--tokenizer" / "refs"
    refs.mkdir(exist_ok=True)
    (refs / "main").write_text("local")
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return "dsinfer/tokenizer", env


def run_aiperf(
    aiperf: str,
    base_url: str,
    trace: Path,
    out: Path,
    *,
    model: str,
    tokenizer: str,
    block_tokens: int,
    timeout: float,
) -> dict[str, Any]:
    """One replay of ``trace``; aiperf's artifacts and log under ``out``; ``tokenizer``: a
    directory with the served model's tokenizer files."""
    out.mkdir(parents=True, exist_ok=True)
    name, env = offline_tokenizer(Path(tokenizer), out / "hf-cache")
    cmd = [aiperf, "profile", "--model", model, "--url", base_url, "--endpoint-type", "completions"]
    cmd += ["--streaming", "--input-file", str(trace), "--custom-dataset-type", "mooncake_trace"]
    cmd += ["--fixed-schedule", "--tokenizer", name, "--isl-block-size", str(block_tokens)]
    cmd += ["--artifact-dir", str(out), "--ui-type", "none", "--random-seed", "0"]
    with (out / "aiperf.log").open("w") as log:
        done = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False, env={**os.environ, **env}
        )
    if done.returncode != 0:
        tail = (out / "aiperf.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"aiperf exited {done.returncode}; the end of its log:\n{tail}")
    (summary,) = out.rglob("profile_export_aiperf.json")
    return summarise(json.loads(summary.read_text()))


def summarise(data: dict[str, Any]) -> dict[str, Any]:
    """requests, failed, seconds, requests_per_s and TTFT p50/p90 (s) from aiperf's summary JSON."""

    def metric(name: str, stat: str) -> float:
        entry = data[name]
        value = float(entry[stat])
        return value / 1e3 if entry.get("unit") == "ms" else value

    completed = int(metric("request_count", "avg"))
    failed = int(data.get("error_request_count", {}).get("avg", 0) or 0)
    seconds = metric("benchmark_duration", "avg") if "benchmark_duration" in data else 0.0
    return {
        "requests": completed + failed,
        "failed": failed,
        "seconds": seconds,
        "requests_per_s": metric("request_throughput", "avg"),
        "ttft_p50_s": metric("time_to_first_token", "p50"),
        "ttft_p90_s": metric("time_to_first_token", "p90"),
    }
