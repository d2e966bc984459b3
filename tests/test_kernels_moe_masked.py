"""The masked-layout MoE activation kernels of dsinfer.kernels (quantization, SwiGLU fused with
it) against dsinfer.ops.fp8's reference on the valid rows, under ``TRITON_INTERPRET=1`` in a fresh
interpreter as tests/test_kernels_gemm.py explains. Rows past ``masked_m`` must stay untouched and
row blocks wholly past it are not computed (their rows would be written otherwise)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_kernels_gemm import launches, run_checks, subprocess_checks

pytestmark = pytest.mark.system

GEN_SEED = 2027
CASES = (  # (groups, capacity, k, masked_m)
    (3, 40, 256, [0, 17, 40]),
    (2, 16, 200, [16, 1]),  # a partial scale block
    (4, 33, 128, [0, 0, 0, 0]),
)


def _untouched_filled(shape: tuple[int, ...], kb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs pre-filled with a marker, to see which rows a kernel wrote."""
    q = torch.full(shape, 0x7E, dtype=torch.uint8).view(torch.float8_e4m3fn)
    return q, torch.full((*shape[:-1], kb), -1.0)


def _check_rows(
    q: torch.Tensor, s: torch.Tensor, x: torch.Tensor, counts: list[int], what: str, ulps: int = 0
) -> None:
    """Rows below ``counts[g]`` quantized as the reference does: bit for bit, or with ``ulps`` > 0
    (an input the kernel computed with another ``exp`` than torch's, which may round a value one
    float32 ulp apart) scales within that many ulps and fp8 codes within one step."""
    from dsinfer.ops.fp8 import quantize_activation_1x128

    for g, count in enumerate(counts):
        q_ref, s_ref = quantize_activation_1x128(x[g, :count])
        scales_ok = (
            torch.equal(s[g, :count], s_ref)
            if ulps == 0
            else bool(
                ((s[g, :count] - s_ref).abs() <= ulps * torch.finfo(torch.float32).eps * s_ref.abs()).all()
            )
        )
        if not scales_ok:
            raise AssertionError(
                f"{what} group {g}: scales differ, max {(s[g, :count] - s_ref).abs().max():.3e}"
            )
        codes, codes_ref = q[g, :count].view(torch.uint8).int(), q_ref.view(torch.uint8).int()
        if not (torch.equal(codes, codes_ref) if ulps == 0 else bool(((codes - codes_ref).abs() <= 1).all())):
            raise AssertionError(f"{what} group {g}: fp8 values differ")
        if not bool((s[g, count:] == -1.0).all()) or not bool((q[g, count:].view(torch.uint8) == 0x7E).all()):
            raise AssertionError(f"{what} group {g}: rows past masked_m were written")


def check_quantize_masked() -> None:
    from dsinfer.kernels import moe_masked as kmod

    gen = torch.Generator().manual_seed(GEN_SEED)
    for groups, capacity, k, counts in CASES:
        a = torch.randn(groups, capacity, k, generator=gen) * 3
        masked_m = torch.tensor(counts, dtype=torch.int32)
        with launches(kmod._masked_kernel) as calls:
            q, s = kmod.quantize_masked_1x128(a, masked_m)
        if len(calls) != 1:
            raise AssertionError(f"{len(calls)} launches")
        marked_q, marked_s = _untouched_filled(q.shape, s.shape[-1])
        valid = torch.arange(capacity)[None, :] < masked_m[:, None]
        marked_q.view(torch.uint8)[valid] = q.view(torch.uint8)[valid]
        marked_s[valid] = s[valid]
        _check_rows(marked_q, marked_s, a, counts, f"quantize {groups}x{capacity}x{k}")


def check_untouched_rows_stay() -> None:
    """A kernel that wrote padding rows would change them: run over pre-filled outputs."""
    from dsinfer.kernels import moe_masked as kmod

    gen = torch.Generator().manual_seed(GEN_SEED + 1)
    groups, capacity, k, counts = 3, 40, 256, [0, 17, 40]
    a = torch.randn(groups, capacity, k, generator=gen)
    masked_m = torch.tensor(counts, dtype=torch.int32)
    q, s = _untouched_filled((groups, capacity, k), 2)
    kb = 2
    kmod._masked_kernel[(groups, -(-capacity // kmod.BLOCK_M), kb)](
        a, q, s, masked_m, k, 0.0,
        a.stride(0), a.stride(1), q.stride(0), q.stride(1), s.stride(0), s.stride(1),
        SWIGLU=False, CLAMP=False, BLOCK_M=kmod.BLOCK_M,
    )  # fmt: skip
    _check_rows(q, s, a, counts, "pre-filled")


def check_swiglu_quantize_masked() -> None:
    from dsinfer.kernels import moe_masked as kmod

    gen = torch.Generator().manual_seed(GEN_SEED + 2)
    for limit in (None, 7.0):
        for groups, capacity, k, counts in CASES:
            gate_up = torch.randn(groups, capacity, 2 * k, generator=gen) * 6
            masked_m = torch.tensor(counts, dtype=torch.int32)
            q, s = kmod.swiglu_quantize_masked(gate_up, masked_m, limit)
            gate, up = gate_up[..., :k], gate_up[..., k:]
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            activated = gate / (1.0 + torch.exp(-gate)) * up  # silu as the kernel computes it
            marked_q, marked_s = _untouched_filled(q.shape, s.shape[-1])
            valid = torch.arange(capacity)[None, :] < masked_m[:, None]
            marked_q.view(torch.uint8)[valid] = q.view(torch.uint8)[valid]
            marked_s[valid] = s[valid]
            # the interpreter's exp is numpy's: a value may round one ulp from torch's
            _check_rows(
                marked_q, marked_s, activated, counts, f"swiglu limit={limit} {groups}x{capacity}x{k}", ulps=2
            )
            # the reference is SiLU; torch's two CPU paths for it differed by 1.5e-4 relative in
            # one CI run of this interpreted subprocess (3e-7 in a plain one): not the kernel's check
            torch.testing.assert_close(activated, torch.nn.functional.silu(gate) * up, rtol=1e-3, atol=1e-3)


CHECKS = (check_quantize_masked, check_untouched_rows_stay, check_swiglu_quantize_masked)
results, test_kernel_check = subprocess_checks("tests.test_kernels_moe_masked", CHECKS)


if __name__ == "__main__":
    print(json.dumps(run_checks(CHECKS)))
