"""End-to-end decode step of a reduced-depth, full-width DeepSeek-V3 on one CUDA GPU: time per step
and tokens/s per GPU, eager and replayed from a CUDA graph (dsinfer/engine/cuda_graph.py).

The model has DeepSeek-V3's widths (configs/models/deepseek-v3/config.json: hidden 7168, 128 heads,
MLA 512 + 64, 256 routed experts top-8 + 1 shared, vocab 129,280) and ``--layers`` decoder layers
(``--dense-layers`` of them dense, the rest MoE), FP8 block-scaled dummy weights drawn on the GPU
by the loader (``load_format="dummy"``; the GEMM time does not depend on the values), a bf16 latent
KV cache of ``--context`` random tokens per sequence, no MTP. For each batch size ``B`` three ways of running one decode step
(``B`` sequences, one new token each, logits of every row) are timed:

- ``eager``: the ordinary forward the model runner runs without graphs (per-step tensors from
  Python lists, routed experts in the contiguous layout with host-read counts);
- ``static``: the graph's callable run eagerly (static buffers, masked expert layout), to separate
  the layout's cost from the launch overhead;
- ``graph``: the same callable replayed from a CUDA graph, as decode steps run on a GPU.

A step is timed on the host from its start to ``torch.cuda.synchronize()`` after it (so launch
overhead counts), median of ``--iters`` steps after ``--warmup``; tokens/s per GPU = B / step time.
The step of the full 61-layer model takes about 61/L times the per-layer part; the JSON keeps
the raw numbers. Without a CUDA GPU the script says so and exits with status 1; ``--device cpu``
(with ``--config`` of a small model) runs the eager and static steps on the CPU, the plumbing that
scripts/gpu-check --cpu-smoke holds.

UNMEASURED: written without a GPU (nothing here has run on one).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gzip
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dsinfer.base.config import ModelConfig
from dsinfer.cache.kv_pool import PagedKVPool
from dsinfer.engine.cuda_graph import CudaGraphRunner, DecodeRows
from dsinfer.model.batch import ForwardBatch
from dsinfer.model.deepseek_v3 import DeepseekV3ForCausalLM
from dsinfer.model.loader import load_model
from dsinfer.ops import select_ops
from harness.kernels import CONFIG, ROOT
from harness.plots import plot_result
from harness.progress import log
from harness.provenance import git_state

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "decode_graph_gpu.json"
FULL_DEPTH = 61  # DeepSeek-V3's decoder layers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--dense-layers", type=int, default=1, help="of which dense, first (default 1)")
    p.add_argument(
        "--routed-experts",
        type=int,
        default=None,
        help="routed experts per MoE layer (default the config's 256; a multiple of n_group=8)",
    )
    p.add_argument(
        "--batch-sizes",
        default="1,8,32,64,128",
        help="decode batch sizes, comma-separated (default 1,8,32,64,128)",
    )
    p.add_argument("--context", type=int, default=4096, help="cached tokens per sequence (default 4096)")
    p.add_argument("--iters", type=int, default=30, help="timed steps per measurement (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--no-static", action="store_true", help="skip the eagerly run static-buffer variant")
    p.add_argument(
        "--mtp",
        action="store_true",
        help="also the MTP verification step (two tokens per sequence) through the two-token buckets, "
        "beside the plain step (the MTP draft layer is not in the reduced model)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results (default {DEFAULT_OUT.name})")
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: eager and static steps only"
    )
    p.add_argument("--config", type=Path, default=CONFIG, help="model config.json (default DeepSeek-V3's)")
    p.add_argument(
        "--ops", default="auto", help="kernel backends for select_ops: auto (the best available) or names"
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="also profile 3 replays of the largest batch's graph (torch.profiler): DIR/trace.json.gz "
        "(a Chrome trace) and DIR/kernels.md (GPU time per kernel, per step)",
    )
    args = p.parse_args(argv)
    try:
        args.batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",") if b.strip()})
    except ValueError:
        p.error(f"--batch-sizes must be integers, got {args.batch_sizes!r}")
    if not args.batch_sizes or args.batch_sizes[0] < 1:
        p.error("--batch-sizes must be positive")
    for name in ("layers", "context", "iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if not 0 <= args.dense_layers < args.layers:
        p.error("--dense-layers must be in [0, --layers): at least one MoE layer")
    return args


def reduced_config(args: argparse.Namespace, directory: Path) -> ModelConfig:
    data = json.loads(args.config.read_text())
    data.update(
        num_hidden_layers=args.layers, first_k_dense_replace=args.dense_layers, num_nextn_predict_layers=0
    )
    if args.routed_experts is not None:
        data["n_routed_experts"] = args.routed_experts
    path = directory / "config.json"
    path.write_text(json.dumps(data))
    return ModelConfig.from_file(path)


def build_model(
    directory: Path, device: torch.device, dtype: torch.dtype, prefer: str = "auto"
) -> tuple[DeepseekV3ForCausalLM, str]:
    """The loader's dummy weights on ``device`` (FP8 where DeepSeek ships FP8 and the GEMMs take
    it), no MTP layer. -> (model, the kernel backends chosen)."""
    ops = select_ops(device, prefer)
    loaded = load_model(directory, ops, device=device, dtype=dtype, load_format="dummy", num_mtp_layers=0)
    return loaded.model, ops.describe()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], Any], iters: int, warmup: int, device: torch.device) -> dict[str, float]:
    for _ in range(warmup):
        step()
    _sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "iters": iters}


def eager_step(
    model: DeepseekV3ForCausalLM, pool: PagedKVPool, rows: DecodeRows, device: torch.device
) -> Callable[[], Any]:
    """The model runner's eager decode forward: per-step tensors from host lists, contiguous experts."""
    ps = pool.page_size

    def step() -> torch.Tensor:
        slots = [pg[p // ps] * ps + p % ps for pg, p in zip(rows.page_lists, rows.positions, strict=True)]
        width = max(len(pg) for pg in rows.page_lists)
        table = [pg + [0] * (width - len(pg)) for pg in rows.page_lists]
        batch = ForwardBatch(
            positions=torch.tensor(rows.positions, dtype=torch.int64, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(table, dtype=torch.int32, device=device),
            q_lens=[1] * len(rows),
            kv_lens=[p + 1 for p in rows.positions],
            num_absorbed=len(rows),
        )
        hidden = model(torch.tensor(rows.input_ids, device=device), batch, pool.caches)
        return model.compute_logits(hidden)

    return step


def profile_steps(step: Callable[[], Any], out: Path, device: torch.device, steps: int = 3) -> dict[str, Any]:
    """``steps`` decode steps under torch.profiler: a Chrome trace and a table of GPU time per kernel
    (per step) in ``out``. -> the table's rows (name, calls per step, us per step, share)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    step()
    _sync(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out / "trace.json"))
    with (out / "trace.json").open("rb") as raw, gzip.open(out / "trace.json.gz", "wb") as packed:
        packed.write(raw.read())
    (out / "trace.json").unlink()
    attr = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    events = [
        e
        for e in prof.key_averages()
        if getattr(e, attr, 0) > 0 and (device.type != "cuda" or e.device_type.name == "CUDA")
    ]
    total = sum(getattr(e, attr) for e in events) or 1.0
    rows = [
        {"kernel": e.key[:120], "calls_per_step": e.count / steps, "us_per_step": getattr(e, attr) / steps,
         "share": getattr(e, attr) / total}
        for e in sorted(events, key=lambda e: -getattr(e, attr))
    ]  # fmt: skip
    what = (
        "GPU time per decode step by kernel" if device.type == "cuda" else "CPU time per step by op (nested)"
    )
    lines = [f"{what} ({steps} profiled steps; {total / steps:.0f} us per step)", "",
             "| kernel | calls/step | us/step | share |", "|---|---:|---:|---:|"]  # fmt: skip
    lines += [
        f"| `{r['kernel']}` | {r['calls_per_step']:.0f} | {r['us_per_step']:.1f} | {r['share']:.1%} |"
        for r in rows[:40]
    ]
    (out / "kernels.md").write_text("\n".join(lines) + "\n")
    log(f"profiled {steps} steps: {total / steps:.0f} us of kernels per step; {out / 'kernels.md'}")
    return {"steps": steps, "kernel_us_per_step": total / steps, "top": rows[:25]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        config = reduced_config(args, Path(tmp))
        log(
            f"building {args.layers} layers ({args.dense_layers} dense), {config.n_routed_experts} experts ..."
        )
        start = time.monotonic()
        model, backends = build_model(Path(tmp), device, dtype, args.ops)
    log(f"model built in {time.monotonic() - start:.1f} s; {backends}")
    max_bs, page = max(args.batch_sizes), 64
    pages_per_seq = math.ceil((args.context + 2) / page)  # (a verification writes two tokens)
    pool = PagedKVPool.for_model(config, config.num_hidden_layers, max_bs * pages_per_seq + 1, dtype, device)
    gen = torch.Generator(device=device).manual_seed(1)
    for layer in pool.caches:
        for cache in layer.tensors():
            cache.normal_(0.0, 1.0, generator=gen)
    sizes = tuple(args.batch_sizes)
    start = time.monotonic()
    graphs = None
    shape = {"max_batch_size": max_bs, "max_seq_len": args.context + 2, "batch_sizes": sizes}
    shape["tokens_per_seq"] = (1, 2) if args.mtp else (1,)
    if device.type == "cuda":
        graphs = CudaGraphRunner(model, pool, **shape)  # type: ignore[arg-type]
        log(
            f"captured {len(sizes) * len(shape['tokens_per_seq'])} graphs in {time.monotonic() - start:.1f} s"
        )
    static = CudaGraphRunner(model, pool, capture=False, **shape)  # type: ignore[arg-type]
    results = []
    for bs in sizes:
        page_lists = [pool.allocator.allocate(pages_per_seq) for _ in range(bs)]
        ids = torch.randint(2, config.vocab_size, (bs,), generator=torch.Generator().manual_seed(bs)).tolist()
        rows = DecodeRows(ids, [args.context] * bs, page_lists)
        entry: dict[str, Any] = {"batch_size": bs, "context": args.context}
        with torch.inference_mode():
            entry["eager"] = time_steps(
                eager_step(model, pool, rows, device), args.iters, args.warmup, device
            )
            if not args.no_static:
                entry["static"] = time_steps(
                    lambda rows=rows: static.run(rows), args.iters, args.warmup, device
                )
            if graphs is not None:
                entry["graph"] = time_steps(
                    lambda rows=rows: graphs.run(rows), args.iters, args.warmup, device
                )
            if args.mtp:  # each sequence's last token and a draft, causal over its cache
                verify = DecodeRows(
                    [t for t in ids for _ in range(2)], [args.context] * bs, page_lists, q_len=2
                )
                runner = graphs if graphs is not None else static
                entry["verify"] = time_steps(
                    lambda verify=verify, runner=runner: runner.run(verify), args.iters, args.warmup, device
                )
                plain = entry.get("graph", entry.get("static", entry["eager"]))
                entry["verify_over_plain"] = entry["verify"]["median_ms"] / plain["median_ms"]
        for mode in ("eager", "static", "graph"):
            if mode in entry:
                entry[mode]["tokens_per_s"] = bs / entry[mode]["median_ms"] * 1e3
        if "graph" in entry:
            entry["graph_speedup"] = entry["eager"]["median_ms"] / entry["graph"]["median_ms"]
        best = entry.get("graph", entry.get("static", entry["eager"]))
        verify = f"; MTP verification {entry['verify_over_plain']:.2f}x that" if "verify" in entry else ""
        log(
            f"B={bs}: eager {entry['eager']['median_ms']:.2f} ms, best {best['median_ms']:.2f} ms, "
            f"{best['tokens_per_s']:.0f} tok/s per device{verify}"
        )
        results.append(entry)
        if args.profile is not None and bs == max_bs:
            runner = graphs if graphs is not None else static
            with torch.inference_mode():
                entry["profile"] = profile_steps(functools.partial(runner.run, rows), args.profile, device)
        for pages in page_lists:
            pool.allocator.free(pages)
    name, capability = "cpu", None
    if device.type == "cuda":
        name, capability = torch.cuda.get_device_name(device), list(torch.cuda.get_device_capability(device))
    return {
        "device": {"name": name, "capability": capability},
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_state()["commit"],
        "command": " ".join(sys.argv),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "backends": backends,
        "model": {
            "layers": args.layers,
            "dense_layers": args.dense_layers,
            "routed_experts": config.n_routed_experts,
            "full_depth": FULL_DEPTH,
        },
        "results": results,
    }


def report(out: dict[str, Any]) -> str:
    lines = [
        f"Decode step, {out['model']['layers']} layers of DeepSeek-V3 ({out['device']['name']})",
        "",
        "| B | eager ms | static ms | graph ms | graph speedup | eager tok/s | graph tok/s | MTP verify ms (x plain) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in out["results"]:
        static = f"{r['static']['median_ms']:.2f}" if "static" in r else "-"
        graph = f"{r['graph']['median_ms']:.2f}" if "graph" in r else "-"
        speedup = f"{r['graph_speedup']:.2f}x" if "graph_speedup" in r else "-"
        graph_rate = f"{r['graph']['tokens_per_s']:.0f}" if "graph" in r else "-"
        verify = f"{r['verify']['median_ms']:.2f} ({r['verify_over_plain']:.2f}x)" if "verify" in r else "-"
        lines.append(
            f"| {r['batch_size']} | {r['eager']['median_ms']:.2f} | {static} | {graph} | "
            f"{speedup} | {r['eager']['tokens_per_s']:.0f} | {graph_rate} | {verify} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "bench_decode_graph.py needs a CUDA GPU (torch.cuda.is_available() is False): nothing measured",
            file=sys.stderr,
        )
        return 1
    out = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    plot_result(args.out)
    print(report(out))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
