"""DeepSeek-V4's compressor pooling: the Triton kernel of dsinfer.kernels against the torch
reference of dsinfer.ops.v4_compress, on CPU under ``TRITON_INTERPRET=1`` in a fresh interpreter
(as tests/test_kernels_gemm.py explains; ``python -m tests.test_kernels_v4_compress`` prints the
JSON of check results).

Shapes: CSA's (8 rows: the previous window's first half and its own second half, the first window
without a predecessor: -inf gates) and HCA's (128 rows), head_dim 512 and the indexer's 128, one
window and many; float32 within 1e-6, bfloat16 within 4 bf16 ulps of the result's scale (the
kernel sums in float32, the reference in bf16, and a weight may round either way); a strided
view; no window.
"""

from __future__ import annotations

import importlib
import json
from types import ModuleType

import pytest
import torch

from tests.test_kernels_gemm import launches, run_checks, subprocess_checks

pytestmark = pytest.mark.system

SEED = 77


def _kernel_module() -> ModuleType:
    return importlib.import_module("dsinfer.kernels.v4_compress")


def _inputs(
    gen: torch.Generator, windows: int, rows: int, dim: int, absent_first_half: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    kv = torch.randn(windows, rows, dim, generator=gen)
    gate = torch.randn(windows, rows, dim, generator=gen) * 2
    if absent_first_half:  # CSA's first window: no predecessor
        gate[0, : rows // 2] = float("-inf")
    return kv, gate


def check_pool_matches_reference() -> None:
    from dsinfer.ops.v4_compress import pool_windows

    kmod = _kernel_module()
    gen = torch.Generator().manual_seed(SEED)
    for windows, rows, dim, absent in (
        (5, 8, 512, True),
        (1, 8, 128, True),
        (3, 128, 512, False),
        (2, 16, 32, False),
    ):
        kv, gate = _inputs(gen, windows, rows, dim, absent)
        with launches(kmod._pool_windows_kernel) as calls:
            out = kmod.pool_windows(kv, gate)
        ref = pool_windows(kv, gate)
        what = f"W={windows} R={rows} D={dim}"
        assert len(calls) == 1, f"{what}: {len(calls)} launches"
        assert out.dtype == kv.dtype and out.shape == ref.shape, what
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5, msg=what)


def check_pool_bf16_and_layouts() -> None:
    from dsinfer.ops.v4_compress import pool_windows

    kmod = _kernel_module()
    gen = torch.Generator().manual_seed(SEED + 1)
    kv, gate = _inputs(gen, 4, 8, 512, True)
    kv16, gate16 = kv.to(torch.bfloat16), gate.to(torch.bfloat16)
    out, ref = kmod.pool_windows(kv16, gate16), pool_windows(kv16, gate16)
    assert out.dtype == torch.bfloat16
    scale = ref.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-3)
    # the weights are rounded to bf16 before the sum: a float32 softmax that differs in its last
    # bit may round a weight the other way (one bf16 ulp of a weight, times a row)
    assert bool(((out.float() - ref.float()).abs() <= scale * 2**-6).all()), "beyond 4 bf16 ulps"
    wide_kv, wide_gate = _inputs(gen, 3, 8, 1024, False)
    strided = (wide_kv[:, :, ::2], wide_gate[:, :, ::2])  # every other channel: a strided view
    torch.testing.assert_close(kmod.pool_windows(*strided), pool_windows(*strided), atol=1e-6, rtol=1e-5)
    empty = kmod.pool_windows(torch.zeros(0, 8, 32), torch.zeros(0, 8, 32))
    assert empty.shape == (0, 32)


CHECKS = (check_pool_matches_reference, check_pool_bf16_and_layouts)
results, test_kernel_check = subprocess_checks("tests.test_kernels_v4_compress", CHECKS)


if __name__ == "__main__":
    print(json.dumps(run_checks(CHECKS)))
