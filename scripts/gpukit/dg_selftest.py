"""One small DeepGEMM GEMM against the torch reference, in its own process: ``python -X faulthandler
-m scripts.gpukit.dg_selftest``. The lease runs it once per JIT compiler (``DG_JIT_USE_NVRTC``)
before phase 2 and keeps the first that works: on the first H100 run (2026-11-27) every DeepGEMM
call of phase 2 ended the process with SIGSEGV under NVRTC, with nothing printed.

Prints one line and exits 0 when the output equals the reference within the kit's 2%."""

from __future__ import annotations

import os
import sys
import time


def main() -> int:
    import deep_gemm
    import torch

    from dsinfer.ops import gemm as ref
    from dsinfer.ops.external import DeepGemmAdapter
    from dsinfer.ops.fp8 import quantize_weight_128x128

    start = time.monotonic()
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(128, 512, device=device, dtype=torch.bfloat16, generator=g)
    w, ws = quantize_weight_128x128(torch.randn(256, 512, device=device, generator=g))
    adapter = DeepGemmAdapter(deep_gemm)
    print(f"dg_selftest: deep_gemm {deep_gemm.__version__} api {adapter.api}; calling", flush=True)
    got = adapter.linear(x, w, ws)
    torch.cuda.synchronize()
    want = ref.linear(x, w, ws)
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    mode = "nvrtc" if os.environ.get("DG_JIT_USE_NVRTC") == "1" else "nvcc"
    print(f"dg_selftest: {mode}: rel err {err:.2e} in {time.monotonic() - start:.1f} s", flush=True)
    return 0 if err <= 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
