"""End-to-end decode step of a reduced-depth, full-width DeepSeek-V3 on one CUDA GPU: time per step
and tokens/s per GPU, eager and replayed from a CUDA graph (dsinfer/engine/cuda_graph.py).

The model has DeepSeek-V3's widths (configs/models/deepseek-v3/config.json: hidden 7168, 128 heads,
MLA 512 + 64, 256 routed experts top-8 + 1 shared, vocab 129,280) and ``--layers`` decoder layers
(``--dense-layers`` of them dense, the rest MoE), FP8 block-scaled weights drawn at random on the
GPU (the GEMM time does not depend on the values), a bf16 latent KV cache of ``--context`` random
tokens per sequence, no MTP. For each batch size ``B`` three ways of running one decode step
(``B`` sequences, one new token each, logits of every row) are timed:

- ``eager``: the ordinary forward the model runner runs without graphs (per-step tensors from
  Python lists, routed experts in the contiguous layout with host-read counts);
- ``static``: the graph's callable run eagerly (static buffers, masked expert layout), to separate
  the layout's cost from the launch overhead;
- ``graph``: the same callable replayed from a CUDA graph, as decode steps run on a GPU.

A step is timed on the host from its start to ``torch.cuda.synchronize()`` after it (so launch
overhead counts), median of ``--iters`` steps after ``--warmup``; tokens/s per GPU = B / step time.
The step of the full 61-layer model takes about 61/L times the per-layer part; the JSON keeps
the raw numbers. Without a CUDA GPU the script says so and exits with status 1.

UNMEASURED: written without a GPU (nothing here has run on one); only ``--help`` and the no-GPU
exit have run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import subprocess
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
from dsinfer.model.layers import Linear
from dsinfer.model.moe import Experts
from dsinfer.ops import Ops, select_ops

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "models" / "deepseek-v3" / "config.json"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "decode_graph_gpu.json"
FULL_DEPTH = 61  # DeepSeek-V3's decoder layers
WEIGHT_STD = 0.02
FP8_STD = 2.0  # random fp8 values ~ N(0, 2^2), scale_inv = WEIGHT_STD / FP8_STD


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results (default {DEFAULT_OUT.name})")
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
    data = json.loads(CONFIG.read_text())
    data.update(
        num_hidden_layers=args.layers, first_k_dense_replace=args.dense_layers, num_nextn_predict_layers=0
    )
    if args.routed_experts is not None:
        data["n_routed_experts"] = args.routed_experts
    path = directory / "config.json"
    path.write_text(json.dumps(data))
    return ModelConfig.from_file(path)


def _is_fp8_linear(name: str) -> bool:
    """The projections DeepSeek ships in FP8 (attention, dense MLPs, shared experts); not lm_head."""
    return name.endswith(("_proj", "_proj_with_mqa"))


@torch.no_grad()
def build_model(
    config: ModelConfig, ops: Ops, device: torch.device, dtype: torch.dtype
) -> DeepseekV3ForCausalLM:
    """The model with random weights made on the GPU (FP8 where DeepSeek ships FP8)."""
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config, ops)
    for name, module in model.named_modules():
        if (isinstance(module, Linear) and _is_fp8_linear(name)) or isinstance(module, Experts):
            module.make_fp8()
    gen = torch.Generator(device=device).manual_seed(0)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            keep = param.dtype in (torch.float8_e4m3fn,) or name.endswith("scale_inv") or "bias" in name
            real = torch.empty(param.shape, dtype=param.dtype if keep else dtype, device=device)
            if name.endswith("scale_inv"):
                real.fill_(WEIGHT_STD / FP8_STD)
            elif real.dtype == torch.float8_e4m3fn:
                for piece in real.view(-1, *real.shape[-2:]):  # one expert at a time: bounded memory
                    piece.copy_(torch.randn(piece.shape, generator=gen, device=device).mul_(FP8_STD))
            elif "norm" in name or "norm" in type(module).__name__.lower():
                real.fill_(1.0)
            elif "bias" in name:
                real.zero_()
            else:
                real.normal_(0.0, WEIGHT_STD, generator=gen)
            setattr(module, name, torch.nn.Parameter(real, requires_grad=False))
        for name, buffer in list(module.named_buffers(recurse=False)):
            module.register_buffer(name, buffer.to(device), persistent=False)
    model.post_load(dtype)
    return model.eval()


def time_steps(step: Callable[[], Any], iters: int, warmup: int) -> dict[str, float]:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
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


def git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    device, dtype = torch.device("cuda"), torch.bfloat16
    ops = select_ops(device)
    log(ops.describe())
    with tempfile.TemporaryDirectory() as tmp:
        config = reduced_config(args, Path(tmp))
    log(
        f"building {args.layers} layers ({args.dense_layers} dense), {config.n_routed_experts} experts, FP8 ..."
    )
    start = time.monotonic()
    model = build_model(config, ops, device, dtype)
    log(f"model built in {time.monotonic() - start:.1f} s")
    max_bs, page = max(args.batch_sizes), 64
    pages_per_seq = math.ceil((args.context + 1) / page)
    pool = PagedKVPool.for_model(config, config.num_hidden_layers, max_bs * pages_per_seq + 1, dtype, device)
    gen = torch.Generator(device=device).manual_seed(1)
    for layer in pool.caches:
        for cache in layer.tensors():
            cache.normal_(0.0, 1.0, generator=gen)
    sizes = tuple(args.batch_sizes)
    start = time.monotonic()
    graphs = CudaGraphRunner(
        model, pool, max_batch_size=max_bs, max_seq_len=args.context + 1, batch_sizes=sizes
    )
    log(f"captured {len(sizes)} graphs in {time.monotonic() - start:.1f} s")
    static = CudaGraphRunner(
        model, pool, max_batch_size=max_bs, max_seq_len=args.context + 1, capture=False, batch_sizes=sizes
    )
    results = []
    for bs in sizes:
        page_lists = [pool.allocator.allocate(pages_per_seq) for _ in range(bs)]
        ids = torch.randint(2, config.vocab_size, (bs,), generator=torch.Generator().manual_seed(bs)).tolist()
        rows = DecodeRows(ids, [args.context] * bs, page_lists)
        entry: dict[str, Any] = {"batch_size": bs, "context": args.context}
        with torch.inference_mode():
            entry["eager"] = time_steps(eager_step(model, pool, rows, device), args.iters, args.warmup)
            if not args.no_static:
                entry["static"] = time_steps(lambda rows=rows: static.run(rows), args.iters, args.warmup)
            entry["graph"] = time_steps(lambda rows=rows: graphs.run(rows), args.iters, args.warmup)
        for mode in ("eager", "static", "graph"):
            if mode in entry:
                entry[mode]["tokens_per_s"] = bs / entry[mode]["median_ms"] * 1e3
        entry["graph_speedup"] = entry["eager"]["median_ms"] / entry["graph"]["median_ms"]
        log(
            f"B={bs}: eager {entry['eager']['median_ms']:.2f} ms, graph {entry['graph']['median_ms']:.2f} ms "
            f"({entry['graph_speedup']:.2f}x), {entry['graph']['tokens_per_s']:.0f} tok/s per GPU"
        )
        results.append(entry)
        for pages in page_lists:
            pool.allocator.free(pages)
    props = torch.cuda.get_device_properties(device)
    return {
        "device": {"name": props.name, "capability": list(torch.cuda.get_device_capability(device))},
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": " ".join(sys.argv),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "backends": dict(ops.backends),
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
        "| B | eager ms | static ms | graph ms | graph speedup | eager tok/s | graph tok/s |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in out["results"]:
        static = f"{r['static']['median_ms']:.2f}" if "static" in r else "-"
        lines.append(
            f"| {r['batch_size']} | {r['eager']['median_ms']:.2f} | {static} | {r['graph']['median_ms']:.2f} | "
            f"{r['graph_speedup']:.2f}x | {r['eager']['tokens_per_s']:.0f} | {r['graph']['tokens_per_s']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench_decode_graph.py needs a CUDA GPU (torch.cuda.is_available() is False): nothing measured",
            file=sys.stderr,
        )
        return 1
    out = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(report(out))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
