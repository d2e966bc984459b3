"""Offline tokens/s with and without the packed linear weights (``ops.pack_linear_weight``),
alternating in one process.

One ``LLM`` (``--dtype`` bfloat16 or float32, the offline benchmark's checkpoint and workload: 64
prompts of 32 random token ids, 128 output tokens, greedy, ``ignore_eos``) runs passes with every
``Linear.packed`` in place and passes with it cleared (the plain ``F.linear`` path), in
alternating order. In bf16 both give the same tokens (checked: the same oneDNN kernel); in float32
oneDNN and MKL sum in other orders, so the share of tokens that agree is reported instead.
Reported: each mode's passes, their medians and the median of the paired ratios.
Alternating within one process keeps the machine's drift out of the comparison: whole-process runs
on a shared 2-core machine swing 10-20% between identical commands.

    python benchmarks/packed_linear.py --pairs 10 --out benchmarks/results/packed_linear.json
    python benchmarks/packed_linear.py --dtype float32 --out benchmarks/results/packed_linear_f32.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from dsinfer import LLM, SamplingParams
from dsinfer.model.layers import Linear
from harness.plots import plot_result
from harness.provenance import machine_info

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("/work/bench-scratch/ckpt/tiny-f32"))
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not (args.model / "config.json").exists():
        make = REPO / "benchmarks" / "make_bench_checkpoint.py"
        subprocess.run([sys.executable, str(make), "--out", str(args.model)], check=True)
    torch.set_num_threads(args.threads)
    llm = LLM(str(args.model), dtype=args.dtype)
    linears = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
    packed = {m: m.packed for m in linears}
    if all(p is None for p in packed.values()):
        sys.exit(f"no {args.dtype} linear is packed here: nothing to compare")

    def use(mode: str) -> None:
        for m in linears:
            m.packed = packed[m] if mode == "packed" else None

    rng = random.Random(0)
    prompts = [[rng.randrange(2, 4096) for _ in range(32)] for _ in range(64)]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    tokens = {}
    for mode in ("packed", "plain"):  # also the warm-up
        use(mode)
        tokens[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    pairs = [
        (a, b)
        for x, y in zip(tokens["packed"], tokens["plain"], strict=True)
        for a, b in zip(x, y, strict=True)
    ]
    same_share = sum(a == b for a, b in pairs) / len(pairs)
    if args.dtype == "bfloat16" and same_share < 1.0:
        sys.exit("packed and plain bf16 weights gave different tokens")
    passes: dict[str, list[float]] = {"packed": [], "plain": []}
    load_before = os.getloadavg()
    for i in range(args.pairs):
        for mode in ("packed", "plain") if i % 2 == 0 else ("plain", "packed"):
            use(mode)
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            passes[mode].append(64 * 128 / (time.perf_counter() - start))
        print(
            f"pair {i + 1}: packed {passes['packed'][-1]:.0f}, plain {passes['plain'][-1]:.0f} tok/s",
            flush=True,
        )
    ratio = statistics.median(a / b for a, b in zip(passes["packed"], passes["plain"], strict=True))
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
        ).stdout.strip(),
        "machine": f"{machine_info()['cpu_model']}, {os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} threads",
        "dtype": args.dtype,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "output_tok_s": passes,
        "median_tok_s": {k: statistics.median(v) for k, v in passes.items()},
        "paired_median_ratio_packed_over_plain": ratio,
        "same_token_share": same_share,
    }
    print(json.dumps({k: report[k] for k in ("median_tok_s", "paired_median_ratio_packed_over_plain")}))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        plot_result(args.out)


if __name__ == "__main__":
    main()
