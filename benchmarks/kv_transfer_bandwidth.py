"""KV transfer bandwidth: dsinfer's NIXL and Mooncake backends between two processes, against
this machine's memcpy measured in the same run.

The writer (this process) and a receiver (this file with ``--receiver``, a child process) each
hold DeepSeek-V3-shaped KV pages: 64 tokens x 576 values in bfloat16 = 73,728 B per page per
layer. For each backend, size and pattern the writer moves the pages with ``write_pages`` and
polls until every handle is done:

- ``per-layer``: 61 calls, one per cache layer (what a prefill rank issues for one request),
  each writing the same n contiguous pages into contiguous destination pages (one descriptor);
- ``per-layer-scattered``: the same, with destination pages in random order (one descriptor per
  page: what a fragmented decode pool gives);
- ``one-call``: one call writing all pages of one large layer (the most a single call can move).

GB/s = bytes / (first write_pages call to the last handle done), best and median of ``--iters``.
The last write of every configuration is checked against the receiver's memory (digests). memcpy
baselines: torch ``copy_`` with one thread and numpy ``copyto``, same sizes, in this process.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dsinfer.transfer import TransferBackend, TransferHandle, make_transfer_backend
from harness.children import JsonLinesChild, say
from harness.plots import plot_result
from harness.progress import progress
from harness.provenance import command_line, git_commit, machine_info, utc_now
from harness.results import add_output_args, write_json

PAGE_TOKENS, PAGE_VALUES, DTYPE = 64, 576, torch.bfloat16
PAGE_BYTES = PAGE_TOKENS * PAGE_VALUES * DTYPE.itemsize
MIB = 1 << 20
MARK = "@@kv-bench "  # NIXL logs on stdout too
WAIT_S = 120.0


def digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()


def make_pool(layers: int, pages: int) -> list[torch.Tensor]:
    return [torch.zeros(pages, PAGE_TOKENS, PAGE_VALUES, dtype=DTYPE) for _ in range(layers)]


# Receiver process --------------------------------------------------------------------------------
def receiver_main(backend: str, specs: list[str]) -> None:
    """``specs``: ``agent=layers x pages`` pools, each behind its own agent; answers digests."""
    pools: dict[str, list[torch.Tensor]] = {}
    txs: dict[str, TransferBackend] = {}
    for spec in specs:
        agent, shape = spec.split("=")
        layers, pages = (int(v) for v in shape.split("x"))
        pools[agent] = make_pool(layers, pages)
        txs[agent] = make_transfer_backend(backend, agent)
        txs[agent].register_pool([(layer,) for layer in pools[agent]])  # one cache per layer
    say(MARK, {a: tx.metadata().hex() for a, tx in txs.items()})
    for line in sys.stdin:
        req = json.loads(line)
        cache = pools[req["agent"]]
        say(MARK, [digest(cache[layer][pages]) for layer, pages in req["pages"]])


class Receiver(JsonLinesChild):
    def __init__(self, backend: str, specs: dict[str, tuple[int, int]]) -> None:
        cmd = [sys.executable, __file__, "--receiver", backend]
        cmd += [f"{agent}={layers}x{pages}" for agent, (layers, pages) in specs.items()]
        super().__init__(cmd, MARK, WAIT_S)
        self.metadata = {a: bytes.fromhex(md) for a, md in self.recv().items()}

    def digests(self, agent: str, pages: list[tuple[int, list[int]]]) -> list[str]:
        return list(self.ask({"agent": agent, "pages": pages}))


# Measurements ------------------------------------------------------------------------------------
def timed(fn: Callable[[], float | None], iters: int) -> tuple[list[float], list[float]]:
    """(seconds, issue seconds) of ``iters`` runs after one warm-up; fn returns its issue time."""
    fn()
    totals, issues = [], []
    for _ in range(iters):
        t = time.perf_counter()
        issue = fn()
        totals.append(time.perf_counter() - t)
        issues.append(issue or 0.0)
    return totals, issues


def summary(nbytes: int, totals: list[float]) -> dict[str, float]:
    best, median = min(totals), statistics.median(totals)
    return {
        "best_s": best,
        "median_s": median,
        "best_gbps": nbytes / best / 1e9,
        "median_gbps": nbytes / median / 1e9,
    }


def memcpy_baselines(sizes: list[int], iters: int) -> list[dict[str, Any]]:
    out = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for size in sizes:
            src = torch.randint(0, 255, (size,), dtype=torch.uint8)
            dst = torch.zeros_like(src)
            src_np, dst_np = src.numpy(), dst.numpy()

            def torch_copy(d: torch.Tensor = dst, s: torch.Tensor = src) -> None:
                d.copy_(s)

            def numpy_copy(d: np.ndarray = dst_np, s: np.ndarray = src_np) -> None:
                np.copyto(d, s)

            for method, fn in (("torch copy_ (1 thread)", torch_copy), ("numpy copyto", numpy_copy)):
                totals, _ = timed(fn, iters)
                row = {"method": method, "bytes": size, **summary(size, totals)}
                out.append(row)
                progress(f"memcpy {method:24s} {size / MIB:5.0f} MiB: {row['best_gbps']:6.2f} GB/s best")
    finally:
        torch.set_num_threads(threads)
    return out


def wait(tx: TransferBackend, handles: list[TransferHandle]) -> None:
    deadline = time.monotonic() + WAIT_S
    pending = list(handles)
    while pending:
        states = [tx.poll(h) for h in pending]
        if "failed" in states:
            raise RuntimeError(f"a write failed ({tx.name})")
        pending = [h for h, s in zip(pending, states, strict=True) if s == "pending"]
        if time.monotonic() > deadline:
            raise RuntimeError(f"writes pending after {WAIT_S:.0f} s ({tx.name})")
    for h in handles:
        tx.release(h)


def plan(
    mode: str, size: int, layers: int, rng: np.random.Generator, dst_pages: int
) -> list[tuple[int, list[int], list[int]]]:
    """(layer, src pages, dst pages) of each call moving about ``size`` bytes."""
    if mode == "one-call":
        n = max(1, round(size / PAGE_BYTES))
        return [(0, list(range(n)), list(range(n)))]
    n = max(1, round(size / (layers * PAGE_BYTES)))
    calls = []
    for layer in range(layers):
        dst = list(range(n)) if mode == "per-layer" else rng.permutation(dst_pages)[:n].tolist()
        calls.append((layer, list(range(n)), dst))
    return calls


def bench_backend(backend: str, sizes: list[int], layers: int, iters: int) -> list[dict[str, Any]]:
    per_layer_pages = max(1, round(max(sizes) / (layers * PAGE_BYTES)))
    big_pages = max(1, round(max(sizes) / PAGE_BYTES))
    tag = uuid.uuid4().hex[:8]
    geometry = {f"recv-layers-{tag}": (layers, per_layer_pages), f"recv-big-{tag}": (1, big_pages)}
    progress(
        f"{backend}: starting the receiver ({layers} x {per_layer_pages} pages and 1 x {big_pages} pages)"
    )
    receiver = Receiver(backend, geometry)
    writers: dict[str, tuple[TransferBackend, list[torch.Tensor]]] = {}
    rows: list[dict[str, Any]] = []
    try:
        for agent, (n_layers, n_pages) in geometry.items():
            pool = make_pool(n_layers, n_pages)
            for cache in pool:
                cache.view(torch.int16).copy_(
                    torch.randint(-(2**15), 2**15 - 1, cache.shape, dtype=torch.int16)
                )
            tx = make_transfer_backend(backend, f"bench-writer-{agent}")
            tx.register_pool([(layer,) for layer in pool])
            tx.connect(agent, receiver.metadata[agent])
            writers[agent] = (tx, pool)
        rng = np.random.default_rng(0)
        for mode in ("per-layer", "per-layer-scattered", "one-call"):
            agent = next(a for a in geometry if ("big" in a) == (mode == "one-call"))
            tx, pool = writers[agent]
            for size in sizes:
                calls = plan(mode, size, len(pool), rng, pool[0].shape[0])
                nbytes = sum(len(src) for _, src, _ in calls) * PAGE_BYTES

                def run(tx: TransferBackend = tx, calls: list = calls, agent: str = agent) -> float:
                    t = time.perf_counter()
                    handles = [tx.write_pages(agent, layer, src, dst) for layer, src, dst in calls]
                    issue = time.perf_counter() - t
                    wait(tx, handles)
                    return issue

                totals, issues = timed(run, iters)
                check = [(layer, dst) for layer, _, dst in calls]
                want = [digest(pool[layer][src]) for layer, src, _ in calls]
                verified = receiver.digests(agent, check) == want
                row = {
                    "backend": backend,
                    "mode": mode,
                    "target_mib": size // MIB,
                    "bytes": nbytes,
                    "calls": len(calls),
                    "pages_per_call": len(calls[0][1]),
                    **summary(nbytes, totals),
                    "issue_median_s": statistics.median(issues),
                    "verified": verified,
                }
                rows.append(row)
                progress(
                    f"{backend:8s} {mode:20s} {nbytes / MIB:6.1f} MiB in {len(calls):2d} calls: "
                    f"{row['best_gbps']:5.2f} GB/s best, {row['median_gbps']:5.2f} median, "
                    f"write_pages calls {row['issue_median_s'] * 1e3:7.1f} ms of {row['median_s'] * 1e3:7.1f} ms"
                    f"{'' if verified else '  DATA MISMATCH'}"
                )
    finally:
        for tx, _ in writers.values():
            tx.close()
        receiver.kill()
    return rows


# Report ------------------------------------------------------------------------------------------
def versions() -> dict[str, str]:
    out = {}
    for dist in ("torch", "numpy", "nixl-cu12", "mooncake-transfer-engine-non-cuda"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    out["dsinfer"] = git_commit(short=True)
    return out


def markdown(report: dict[str, Any]) -> str:
    m, v = report["machine"], report["versions"]
    lines = [
        "# KV transfer bandwidth: dsinfer write_pages (NIXL, Mooncake) vs memcpy",
        "",
        f"- Machine: {m['cpu_model']}, {m['online_cpus']} cores, {m['mem_total_gib']} GiB, kernel {m['kernel']}; "
        f"load average {m['load_avg_start'][0]:.2f} at start, {report['load_avg_end'][0]:.2f} at end "
        "(other people use this machine: expect noise)",
        f"- Versions: torch {v['torch']}, numpy {v['numpy']}, nixl-cu12 {v['nixl-cu12']}, "
        f"mooncake-transfer-engine-non-cuda {v['mooncake-transfer-engine-non-cuda']}, dsinfer {v['dsinfer']}",
        f"- Page: {PAGE_TOKENS} tokens x {PAGE_VALUES} values bf16 = {PAGE_BYTES:,} B per layer; "
        f"{report['layers']} layers for the per-layer patterns; best / median of {report['iters']} runs "
        "after one warm-up",
        f"- Environment: {report['env'] or 'no UCX_/MC_ variables set'}",
        f"- Date: {report['date']}",
        f"- Command: `{report['command']}`",
        "",
        "| backend | pattern | MiB | calls x pages | best GB/s | median GB/s | in write_pages (median ms) | "
        "total (median ms) | data checked |",
        "|---|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['backend']} | {r['mode']} | {r['bytes'] / MIB:.1f} | {r['calls']} x {r['pages_per_call']} | "
            f"{r['best_gbps']:.2f} | {r['median_gbps']:.2f} | {r['issue_median_s'] * 1e3:.1f} | "
            f"{r['median_s'] * 1e3:.1f} | {'ok' if r['verified'] else 'MISMATCH'} |"
        )
    lines += ["", "| memcpy in one process | MiB | best GB/s | median GB/s |", "|---|---:|---:|---:|"]
    for r in report["memcpy"]:
        lines.append(
            f"| {r['method']} | {r['bytes'] / MIB:.0f} | {r['best_gbps']:.2f} | {r['median_gbps']:.2f} |"
        )
    for backend, error in report["skipped"].items():
        lines.append(f"\n{backend} skipped: {error}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="nixl,mooncake")
    parser.add_argument("--sizes-mib", default="16,64,256")
    parser.add_argument("--layers", type=int, default=61, help="cache layers of the per-layer patterns")
    parser.add_argument("--iters", type=int, default=5)
    add_output_args(
        parser,
        Path("benchmarks/results/kv_transfer_bandwidth.json"),
        Path("benchmarks/results/kv_transfer_bandwidth.md"),
    )
    args = parser.parse_args()
    sizes = [int(s) * MIB for s in args.sizes_mib.split(",")]
    report: dict[str, Any] = {
        "benchmark": "kv_transfer_bandwidth",
        "date": utc_now(),
        "command": command_line(sys.executable),
        "machine": {**machine_info(), "load_avg_start": os.getloadavg()},
        "versions": versions(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "MC_"))},
        "layers": args.layers,
        "iters": args.iters,
        "page_bytes": PAGE_BYTES,
        "results": [],
        "skipped": {},
    }
    report["memcpy"] = memcpy_baselines(sizes, args.iters)
    for backend in args.backends.split(","):
        try:
            report["results"] += bench_backend(backend, sizes, args.layers, args.iters)
        except Exception as e:  # a missing optional library: report it and go on
            progress(f"{backend}: skipped ({e})")
            report["skipped"][backend] = str(e)
    report["load_avg_end"] = os.getloadavg()
    write_json(args.out, report)
    plot_result(args.out)
    args.markdown.write_text(markdown(report))
    progress(f"wrote {args.out} and {args.markdown}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--receiver"]:
        receiver_main(sys.argv[2], sys.argv[3:])
    else:
        main()
