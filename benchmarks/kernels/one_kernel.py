"""A few launches of one dsinfer kernel at DeepSeek-V3's decode shapes, for a profiler to read
(scripts/gpukit/stage_ncu.py runs it under Nsight Compute: ``ncu --launch-skip 2 --launch-count 1``).

    python benchmarks/kernels/one_kernel.py --kernel mla        # MLA decode, B128 x 4K, 128 heads
    python benchmarks/kernels/one_kernel.py --kernel masked     # grouped FP8, masked, 8 x 256, w13

Kernels: ``mla`` (the default launch: the TMA kernel), ``mla-pointer`` (the pointer kernel in
32-row blocks, its fallback), ``masked`` (``m_grouped_fp8_gemm_nt_masked``, 8 experts x 256 rows,
n 4096, k 7168). ``--device cpu --tiny`` (with ``TRITON_INTERPRET=1``) runs them at tiny shapes.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch

KERNELS = ("mla", "mla-pointer", "masked")


def mla_call(device: torch.device, tiny: bool, kernel: str | None) -> Callable[[], object]:
    import importlib

    mla = importlib.import_module("dsinfer.kernels.mla_decode")
    batch, ctx, heads, page = (2, 64, 32, 32) if tiny else (128, 4096, 128, 64)
    dim, dim_v = (48, 32) if tiny else (576, 512)
    g = torch.Generator(device=device).manual_seed(0)
    pages = -(-ctx // page)
    cache = torch.randn(batch * pages, page, 1, dim, device=device, dtype=torch.bfloat16, generator=g)
    table = torch.randperm(batch * pages, device=device, generator=g).to(torch.int32).view(batch, pages)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, 1, heads, dim, device=device, dtype=torch.bfloat16, generator=g)
    launch = {} if kernel is None else {"kernel": kernel, "block_m": 32}
    return lambda: mla.mla_decode_split_kv(q, cache, table, lens, dim_v, 0.1352, True, **launch)


def masked_call(device: torch.device, tiny: bool) -> Callable[[], object]:
    import dsinfer.kernels as kernels

    experts, rows, n, k = (2, 16, 128, 256) if tiny else (8, 256, 4096, 7168)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(experts, rows, k, device=device, dtype=torch.bfloat16, generator=g)
    qa, sa = kernels.quantize_activation_1x128(x)
    w = torch.randn(experts, n, k, device=device, dtype=torch.bfloat16, generator=g).to(torch.float8_e4m3fn)
    ws = torch.rand(experts, n // 128, k // 128, device=device, generator=g) * 1e-2 + 1e-3
    d = torch.empty(experts, rows, n, device=device, dtype=torch.bfloat16)
    masked_m = torch.full((experts,), rows, dtype=torch.int32, device=device)
    return lambda: kernels.m_grouped_fp8_gemm_nt_masked((qa, sa), (w, ws), d, masked_m, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", choices=KERNELS, required=True)
    p.add_argument("--launches", type=int, default=5, help="calls (the first compiles; default 5)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="interpreter-sized shapes (with --device cpu)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.kernel == "masked":
        call = masked_call(device, args.tiny)
    else:
        call = mla_call(device, args.tiny, "pointer" if args.kernel == "mla-pointer" else None)
    start = time.monotonic()
    for _ in range(args.launches):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"{args.kernel}: {args.launches} calls in {time.monotonic() - start:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
