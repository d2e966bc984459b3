"""DeepSeek-V4's MXFP4 grouped expert GEMM: the Triton kernel of dsinfer.kernels against the torch
reference of dsinfer.ops.mxfp4, on CPU under ``TRITON_INTERPRET=1`` in a fresh interpreter (as
tests/test_kernels_gemm.py explains; ``python -m tests.test_kernels_mxfp4`` prints the JSON of
check results).

Weights quantised by ``quantize_mxfp4`` (e2m1 codes over every value, e8m0 scales as the format's
own dtype and as raw bytes); rows of several experts unsorted, rows of expert -1 (not written:
zero), K not a multiple of the kernel's slice, more rows than a tile; float32 within 1e-5 of the
output's scale, bfloat16 within one bf16 ulp of it (the sums' order differs); one launch.
"""

from __future__ import annotations

import importlib
import json
from types import ModuleType

import pytest
import torch

from tests.test_kernels_gemm import launches, run_checks, subprocess_checks

pytestmark = pytest.mark.system

SEED = 41


def _kernel_module() -> ModuleType:
    return importlib.import_module("dsinfer.kernels.mxfp4_gemm")


def check_grouped_gemm_matches_reference() -> None:
    from dsinfer.ops.mxfp4 import E2M1_VALUES, mxfp4_grouped_gemm, quantize_mxfp4

    kmod = _kernel_module()
    gen = torch.Generator().manual_seed(SEED)
    for experts, n, k, m in ((4, 80, 96, 37), (3, 64, 128, 300), (1, 16, 32, 1)):
        w = torch.randn(experts, n, k, generator=gen) * 3
        packed, scale = quantize_mxfp4(w)
        codes = torch.arange(16, dtype=torch.uint8)
        packed[0, 0, :16] = codes | ((15 - codes) << 4)  # every code, in the low and the high nibble
        a = torch.randn(m, k, generator=gen)
        rows = torch.randint(-1, experts, (m,), generator=gen)
        what = f"G={experts} N={n} K={k} M={m}"
        for dtype in (torch.float32, torch.bfloat16):
            for scales in (scale, scale.view(torch.uint8)):
                with launches(kmod._mxfp4_grouped_kernel) as calls:
                    out = kmod.mxfp4_grouped_gemm(a.to(dtype), packed, scales, rows)
                ref = mxfp4_grouped_gemm(a.to(dtype), packed, scales, rows)
                assert len(calls) == 1 and out.dtype == dtype and out.shape == (m, n), what
                bound = ref.float().abs().amax().clamp_min(1.0) * (1e-5 if dtype == torch.float32 else 2**-7)
                assert float((out.float() - ref.float()).abs().max()) <= float(bound), f"{what} {dtype}"
                assert bool((out[rows < 0] == 0).all()), f"{what}: a row of no expert was written"
    assert len(E2M1_VALUES) == 16


def check_no_rows() -> None:
    from dsinfer.ops.mxfp4 import quantize_mxfp4

    packed, scale = quantize_mxfp4(torch.randn(2, 16, 32))
    out = _kernel_module().mxfp4_grouped_gemm(torch.randn(3, 32), packed, scale, torch.full((3,), -1))
    assert out.shape == (3, 16) and bool((out == 0).all())


CHECKS = (check_grouped_gemm_matches_reference, check_no_rows)
results, test_kernel_check = subprocess_checks("tests.test_kernels_mxfp4", CHECKS)


if __name__ == "__main__":
    print(json.dumps(run_checks(CHECKS)))
