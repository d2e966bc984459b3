"""Tile sweep of dsinfer's block-FP8 GEMMs (dense, masked and contiguous grouped) on one GPU.

For each kernel at DeepSeek-V3's shapes, every candidate launch configuration (row and column
tile, warps, pipeline stages) is timed, checked against the torch reference and described by the
spilled bytes of its build are the kit's ``triton-compile`` stage's. The best configuration per case is what
``kernels.fp8_gemm.tile_config`` and ``kernels.grouped_gemm.contiguous_tile_config`` should
launch. Results: JSON (``--out``) and a markdown table (``--markdown``).

    python benchmarks/kernels/sweep_gemm.py --out /tmp/sweep.json --markdown /tmp/sweep.md
    TRITON_INTERPRET=1 python benchmarks/kernels/sweep_gemm.py --device cpu --tiny   # plumbing
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import harness.kernels as bk
from harness.plots import plot_result
from harness.progress import log

CANDIDATES = (  # BLOCK_M, BLOCK_N, num_warps, num_stages
    (32, 128, 4, 3),
    (64, 64, 4, 3),
    (64, 128, 4, 3),
    (64, 128, 8, 3),
    (64, 256, 8, 3),
    (128, 64, 4, 3),
    (128, 128, 8, 3),
    (128, 128, 8, 4),
    (128, 256, 8, 3),
)
# the masked kernel's operands by TMA (kernels/grouped_gemm_tma.py): columns in one 128-wide scale block
MASKED_TMA = ((64, 128, 4, 3), (64, 128, 4, 4), (64, 128, 8, 4), (128, 128, 8, 3), (128, 128, 8, 4))
DENSE = ("q_b_proj", "kv_a_proj_with_mqa", "o_proj", "dense down_proj")  # the kit's kernels stage
DENSE_ROWS = (128, 4096)
GROUPED_TOKENS = (32, 256)  # per expert; 8 local experts (256 over EP32)
EXPERTS = 8
TINY_EXPERTS = 2  # --tiny: the interpreter runs every program; two groups exercise the grouping


Candidate = tuple[int, ...]  # BLOCK_M, BLOCK_N, num_warps, num_stages[, TMA]


def tile(cfg: Candidate) -> dict[str, int]:
    bm, bn, warps, stages, *tma = cfg
    out = {"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8, "num_warps": warps, "num_stages": stages}
    return {**out, "TMA": 1} if tma and tma[0] else out


def label(cfg: Candidate) -> str:
    return "{}x{} w{} s{}".format(*cfg[:4]) + (" tma" if len(cfg) > 4 and cfg[4] else "")


def sweep_case(
    name: str,
    flops: int,
    call: Callable[[dict[str, int] | None], torch.Tensor],
    ref: torch.Tensor,
    timer: bk.Timer,
    fp8_tflops: float,
    candidates: tuple[Candidate, ...],
    deadline: float,
) -> dict[str, Any]:
    """Time the default launch and every candidate; each row: config, us, TFLOP/s, error."""
    rows = []
    for cfg in (None, *candidates):
        if time.monotonic() > deadline:
            break
        name_of = "default" if cfg is None else label(cfg)
        try:
            out = call(None if cfg is None else tile(cfg))
            t = timer(lambda cfg=cfg: call(None if cfg is None else tile(cfg)))
        except Exception as exc:  # out of shared memory or registers: not a candidate
            rows.append({"config": name_of, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
            continue
        us = t["median_us"]
        err = bk.rel_err(out, ref)
        rows.append({
            "config": name_of, "us": us, "tflops": flops / (us * 1e-6) / 1e12,
            "of_fp8": flops / (us * 1e-6) / 1e12 / fp8_tflops, "rel_err": err,
            "ok": err <= bk.GEMM_TOL,
        })  # fmt: skip
    good = [r for r in rows if r.get("ok")]
    best = min(good, key=lambda r: r["us"]) if good else None
    log(f"  {name}: default {rows[0].get('us', math.nan):.1f} us, best {best and best['config']} "
           f"{best and round(best['us'], 1)} us")  # fmt: skip
    return {"case": name, "flops": flops, "best": best and best["config"], "rows": rows}


def render(results: dict[str, Any]) -> str:
    """The sweep as markdown: one table per case, the best configuration in its heading."""
    lines = [f"# FP8 GEMM tile sweep ({results['device']}, fp8 {results['fp8_tflops']:.0f} TFLOP/s)", ""]
    for section in ("masked", "contiguous", "dense"):
        for case in results[section]:
            lines += [f"## {case['case']} (best: {case['best']})", ""]
            lines += ["| config | us | TFLOP/s | of fp8 | rel err |", "|---|---:|---:|---:|---:|"]
            for r in case["rows"]:
                if "error" in r:
                    lines.append(f"| {r['config']} | {r['error']} | | | |")
                else:
                    lines.append(
                        f"| {r['config']} | {r['us']:.1f} | {r['tflops']:.0f} | {r['of_fp8']:.1%} | {r['rel_err']:.4f} |"
                    )
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--markdown", type=Path, default=None)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="interpreter-sized shapes (with --device cpu)")
    p.add_argument(
        "--deadline-s", type=float, default=400.0, help="stop starting new configurations after this"
    )
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.deadline_s
    kernels = bk.import_kernels()
    from dsinfer.ops import gemm as torch_gemm

    device = torch.device(args.device)
    timer = bk.Timer(warmup=0 if args.tiny else 2, iters=args.iters, max_s=1.0, device=args.device)
    g = bk.gen(device)
    v3 = bk.load_v3()
    fp8_tflops = math.nan
    if device.type == "cuda":
        a = torch.randn(8192, 8192, device=device).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        t = timer(lambda: bk.scaled_mm(a, a.t(), one, True))
        fp8_tflops = 2 * 8192**3 / (t["median_us"] * 1e-6) / 1e12
        del a
    log(
        f"sweep_gemm on {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}: fp8 {fp8_tflops:.0f} TFLOP/s"
    )
    candidates: tuple[Candidate, ...] = CANDIDATES if not args.tiny else ((16, 32, 4, 2), (32, 32, 4, 2))
    masked_tma = tuple((*c, 1) for c in (MASKED_TMA if not args.tiny else ((16, 64, 4, 2),)))
    shapes = (
        [(n, k) for name, n, k in bk.projection_shapes(v3) if name in DENSE] if not args.tiny else [(64, 256)]
    )
    hidden, inter = (v3.hidden, v3.moe_intermediate) if not args.tiny else (256, 128)
    experts = EXPERTS if not args.tiny else TINY_EXPERTS
    results: dict[str, Any] = {
        "device": str(device),
        "fp8_tflops": fp8_tflops,
        "dense": [],
        "masked": [],
        "contiguous": [],
    }

    for n, k in ((2 * inter, hidden), (hidden, inter)):
        w, ws = bk.fp8_weights(g, (experts,), n, k)
        for tokens in GROUPED_TOKENS if not args.tiny else (8,):
            flops = 2 * experts * tokens * n * k
            x = torch.randn(experts, tokens, k, device=device, dtype=torch.bfloat16, generator=g)
            qa, sa = kernels.quantize_activation_1x128(x)
            masked_m = torch.full((experts,), tokens, dtype=torch.int32, device=device)
            dm = torch.zeros(experts, tokens, n, device=device, dtype=torch.bfloat16)

            def masked(
                cfg: dict[str, int] | None, qa=qa, sa=sa, w=w, ws=ws, dm=dm, mm=masked_m, t=tokens
            ) -> torch.Tensor:
                kernels.m_grouped_fp8_gemm_nt_masked((qa, sa), (w, ws), dm, mm, t, tile=cfg)
                return dm

            ref = torch_gemm.grouped_gemm_masked(x, w, ws, masked_m, tokens)
            results["masked"].append(sweep_case(
                f"masked E{experts} m{tokens} n{n} k{k}", flops, masked, ref,
                timer, fp8_tflops, candidates + masked_tma, deadline,
            ))  # fmt: skip
            xf = x.reshape(experts * tokens, k)
            qf, sf = kernels.quantize_activation_1x128(xf)
            idx = torch.arange(experts, dtype=torch.int32, device=device).repeat_interleave(tokens)
            dc = torch.zeros(experts * tokens, n, device=device, dtype=torch.bfloat16)

            def contiguous(
                cfg: dict[str, int] | None, qf=qf, sf=sf, w=w, ws=ws, dc=dc, idx=idx
            ) -> torch.Tensor:
                kernels.m_grouped_fp8_gemm_nt_contiguous((qf, sf), (w, ws), dc, idx, tile=cfg)
                return dc

            ref = torch_gemm.grouped_gemm_contiguous(xf, w, ws, idx)
            results["contiguous"].append(sweep_case(
                f"contiguous E{experts} m{tokens} n{n} k{k}", flops, contiguous, ref,
                timer, fp8_tflops, candidates, deadline,
            ))  # fmt: skip
    for n, k in shapes:
        for m in DENSE_ROWS if not args.tiny else (16,):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=g)
            w, ws = bk.fp8_weights(g, (), n, k)
            qa, sa = kernels.quantize_activation_1x128(x)
            d = torch.empty(m, n, device=device, dtype=torch.bfloat16)

            def dense(cfg: dict[str, int] | None, qa=qa, sa=sa, w=w, ws=ws, d=d) -> torch.Tensor:
                kernels.fp8_gemm_nt((qa, sa), (w, ws), d, tile=cfg)
                return d

            ref = torch_gemm.linear(x, w, ws)
            results["dense"].append(sweep_case(
                f"dense m{m} n{n} k{k}", 2 * m * n * k, dense, ref,
                timer, fp8_tflops, candidates, deadline,
            ))  # fmt: skip
    args.out.write_text(json.dumps(results, indent=1))
    plot_result(args.out)
    if args.markdown:
        args.markdown.write_text(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
