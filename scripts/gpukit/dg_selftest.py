"""One small DeepGEMM GEMM against the torch reference, in its own process: ``python -X faulthandler
-m scripts.gpukit.dg_selftest``. The lease runs it under each way of running DeepGEMM it knows
before phase 2 and keeps the first that works.

On the H100 (2026-11-27) every first DeepGEMM call ended the process with SIGSEGV in
``std::regex`` inside DeepGEMM's ``_C``: the image's ``/opt/gcc/bin/g++`` links libstdc++
statically, so the extension carried a second copy of its locale code. Built by the system's g++
it passes (2026-11-28; the lease builds it so). This prints the libstdc++ files the process mapped.

Prints its lines and exits 0 when the output equals the reference within the kit's 2%."""

from __future__ import annotations

import os
import sys
import time


def cxx_runtimes() -> list[str]:
    """The libstdc++ files this process mapped."""
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-1] for line in maps if "libstdc++" in line})


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
    print(
        f"dg_selftest: deep_gemm {deep_gemm.__version__} api {adapter.api}; libstdc++ {cxx_runtimes()}",
        flush=True,
    )
    got = adapter.linear(x, w, ws)
    torch.cuda.synchronize()
    want = ref.linear(x, w, ws)
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    mode = "nvrtc" if os.environ.get("DG_JIT_USE_NVRTC") == "1" else "nvcc"
    print(f"dg_selftest: {mode}: rel err {err:.2e} in {time.monotonic() - start:.1f} s", flush=True)
    return 0 if err <= 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
