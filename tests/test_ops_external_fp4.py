"""The DeepGEMM FP8xFP4 adapter (dsinfer/ops/external_fp4.py) over a stand-in ``deep_gemm``.

The stand-in implements ``m_grouped_fp8_fp4_gemm_nt_contiguous`` as DeepGEMM 2.6.1 (54e2261)
documents and asserts it, in torch on the CPU: e4m3 activations with fp32 per-token-per-128 scales
that SM100 keeps as UE8M0 (powers of two), int8 weights of packed e2m1 pairs (even element in the
low nibble) with fp32 power-of-two scales per 32, the recipes, K a multiple of 128, the contiguous
layout's segments aligned, padding rows -1 (written with garbage). The adapter must equal the torch
reference within FP8-activation error and send what the kernel cannot take to its fallback."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from dsinfer.ops import mxfp4 as torch_mxfp4
from dsinfer.ops.backend import capability_unsupported
from dsinfer.ops.external_fp4 import DeepGemmMxfp4Adapter
from dsinfer.ops.fp8 import FP8_DTYPE, dequantize_activation_1x128, quantize_activation_1x128
from dsinfer.ops.mxfp4 import quantize_mxfp4

E2M1 = torch.tensor(torch_mxfp4.E2M1_VALUES)


def _powers_of_two(scale: torch.Tensor) -> bool:
    """SM100 packs an fp32 scale's exponent only: sign and mantissa must be zero."""
    return bool(((scale.view(torch.int32) & ~0x7F800000) == 0).all())


def _unpack_fp4(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 ``[n, k/2]`` (the even element in the low nibble) and fp32 ``[n, k/32]`` -> ``[n, k]``."""
    codes = w.view(torch.uint8).long()
    values = torch.stack([E2M1[codes & 0x0F], E2M1[codes >> 4]], dim=-1).flatten(-2)
    return values * scale.repeat_interleave(32, dim=-1)


def _deep_gemm(alignment: int = 128) -> types.ModuleType:
    mod = types.ModuleType("fake_deep_gemm_fp4")
    calls: list[dict[str, Any]] = []

    def m_grouped_fp8_fp4_gemm_nt_contiguous(
        a,
        b,
        d,
        grouped_layout,
        recipe=None,
        recipe_a=None,
        recipe_b=None,
        compiled_dims="nk",
        disable_ue8m0_cast=False,
        use_psum_layout=False,
        ensure_zero_padding=True,
        expected_m_for_psum_layout=None,
    ):  # type: ignore[no-untyped-def]
        (a_fp8, a_scale), (w, w_scale) = a, b
        m, k = a_fp8.shape
        groups, n, half_k = w.shape
        assert recipe is None and recipe_a == (1, 128) and recipe_b == (1, 32)
        assert not disable_ue8m0_cast and not use_psum_layout and expected_m_for_psum_layout is None
        assert a_fp8.dtype == FP8_DTYPE and a_fp8.is_contiguous() and w.dtype == torch.int8
        assert w.is_contiguous() and half_k * 2 == k and k % 128 == 0
        assert a_scale.dtype == w_scale.dtype == torch.float32
        assert a_scale.shape == (m, k // 128) and w_scale.shape == (groups, n, k // 32)
        assert _powers_of_two(a_scale) and _powers_of_two(w_scale)
        assert d.dtype == torch.bfloat16 and d.shape == (m, n) and d.is_contiguous()
        assert grouped_layout.dtype == torch.int32 and grouped_layout.shape == (m,)
        assert grouped_layout.is_contiguous() and m % alignment == 0
        for start in range(0, m, alignment):  # one expert (or padding) per aligned block
            block = grouped_layout[start : start + alignment]
            experts = block[block >= 0].unique()
            assert len(experts) <= 1 and (block[: int((block >= 0).sum())] >= 0).all()
        x = dequantize_activation_1x128(a_fp8, a_scale)
        d.fill_(float("nan"))  # padding rows: undefined
        for g in range(groups):
            rows = (grouped_layout == g).nonzero(as_tuple=True)[0]
            if len(rows):
                d[rows] = (x[rows] @ _unpack_fp4(w[g], w_scale[g]).T).to(d.dtype)
        calls.append({"m": m, "groups": groups})

    mod.m_grouped_fp8_fp4_gemm_nt_contiguous = m_grouped_fp8_fp4_gemm_nt_contiguous
    mod.get_mk_alignment_for_contiguous_layout = lambda: alignment
    mod.calls = calls
    return mod


def _experts(gen: torch.Generator, groups: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_mxfp4(torch.randn(groups, n, k, generator=gen) * 0.1)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within FP8-activation error: relative Frobenius error and cosine similarity."""
    g, w = got.double().flatten(), want.double().flatten()
    assert torch.isfinite(g).all()
    assert float((g - w).norm() / w.norm()) < 3e-2
    assert float(torch.nn.functional.cosine_similarity(g, w, dim=0)) > 0.999


@pytest.mark.parametrize("alignment", [128, 32])
def test_adapter_equals_the_reference(alignment: int) -> None:
    """Rows in any order, rows of expert -1 (zero), experts with no rows (1 and 4)."""
    gen = torch.Generator().manual_seed(1)
    b, b_scale = _experts(gen, 5, 96, 256)
    expert_of_row = torch.tensor([3, 0, -1, 2, 0, 3, -1, 0, 2, 2, 0], dtype=torch.int64)
    a = torch.randn(len(expert_of_row), 256, generator=gen).bfloat16()
    dg = _deep_gemm(alignment)
    adapter = DeepGemmMxfp4Adapter(dg, require_cuda=False)
    assert adapter.m_alignment == alignment
    got = adapter.mxfp4_grouped_gemm(a, b, b_scale, expert_of_row)
    want = torch_mxfp4.mxfp4_grouped_gemm(a, b, b_scale, expert_of_row)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    _close(got, want)
    assert (got[expert_of_row < 0] == 0).all()
    assert dg.calls == [{"m": 3 * alignment, "groups": 5}]  # three experts with rows, one segment each


def test_raw_e8m0_bytes_and_the_w2_shape() -> None:
    """The loader's e8m0 scales may come as their uint8 bytes; N wider than K (w13) and K wider
    than N (w2) both run."""
    gen = torch.Generator().manual_seed(2)
    dg = _deep_gemm()
    adapter = DeepGemmMxfp4Adapter(dg, require_cuda=False)
    for n, k in ((256, 128), (128, 384)):
        b, b_scale = _experts(gen, 3, n, k)
        raw = b_scale.view(torch.uint8)
        expert_of_row = torch.randint(-1, 3, (40,), generator=gen)
        a = torch.randn(40, k, generator=gen).bfloat16()
        _close(
            adapter.mxfp4_grouped_gemm(a, b, raw, expert_of_row),
            torch_mxfp4.mxfp4_grouped_gemm(a, b, b_scale, expert_of_row),
        )
    assert len(dg.calls) == 2


def test_what_the_kernel_cannot_take_goes_to_the_fallback() -> None:
    gen = torch.Generator().manual_seed(3)
    dg = _deep_gemm()
    used: list[str] = []

    def fallback(a, b, b_scale, expert_of_row):  # type: ignore[no-untyped-def]
        used.append(f"{a.dtype} k={a.shape[1]}")
        return torch_mxfp4.mxfp4_grouped_gemm(a, b, b_scale, expert_of_row)

    adapter = DeepGemmMxfp4Adapter(dg, fallback=fallback, require_cuda=False)
    b, b_scale = _experts(gen, 2, 64, 64)  # K 64: not a multiple of 128
    rows = torch.tensor([1, 0, -1])
    a = torch.randn(3, 64, generator=gen).bfloat16()
    torch.testing.assert_close(
        adapter.mxfp4_grouped_gemm(a, b, b_scale, rows), torch_mxfp4.mxfp4_grouped_gemm(a, b, b_scale, rows)
    )
    b, b_scale = _experts(gen, 2, 64, 128)
    a32 = torch.randn(3, 128, generator=gen)  # float32 asks for more than bf16 out of FP8 inputs
    got = adapter.mxfp4_grouped_gemm(a32, b, b_scale, rows)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch_mxfp4.mxfp4_grouped_gemm(a32, b, b_scale, rows))
    adapter.mxfp4_grouped_gemm(a32.bfloat16(), b, b_scale.float(), rows)  # fp32 scales: not known UE8M0
    assert used == ["torch.bfloat16 k=64", "torch.float32 k=128", "torch.bfloat16 k=128"]
    assert dg.calls == []
    DeepGemmMxfp4Adapter(dg).mxfp4_grouped_gemm(a32.bfloat16(), b, b_scale, rows)  # CPU by default
    assert dg.calls == []


def test_no_row_with_an_expert_gives_zeros_without_a_call() -> None:
    gen = torch.Generator().manual_seed(4)
    dg = _deep_gemm()
    b, b_scale = _experts(gen, 2, 64, 128)
    a = torch.randn(4, 128, generator=gen).bfloat16()
    got = DeepGemmMxfp4Adapter(dg, require_cuda=False).mxfp4_grouped_gemm(a, b, b_scale, torch.full((4,), -1))
    assert got.shape == (4, 64) and (got == 0).all() and dg.calls == []


def test_activation_scales_are_powers_of_two_rounded_up() -> None:
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(5)) * 7
    q, scale = quantize_activation_1x128(x, ue8m0=True)
    _, plain = quantize_activation_1x128(x)
    assert _powers_of_two(scale) and (scale >= plain).all() and (scale < 2 * plain).all()
    assert q.float().abs().max() <= 448
    err = (dequantize_activation_1x128(q, scale) - x).norm() / x.norm()
    assert float(err) < 5e-2


def test_module_without_the_fp4_gemm_is_refused() -> None:
    with pytest.raises(ImportError, match="m_grouped_fp8_fp4_gemm_nt_contiguous"):
        DeepGemmMxfp4Adapter(types.ModuleType("deep_gemm"))


def test_deepgemm_mxfp4_needs_sm100() -> None:
    for capability in ((9, 0), (8, 9), (12, 0)):
        why = capability_unsupported("deepgemm", capability, "mxfp4")
        assert why is not None and "DeepGEMM's FP8xFP4 GEMM needs compute capability 10.x (SM100)" in why
    assert "this GPU is 9.0" in str(capability_unsupported("deepgemm", (9, 0), "mxfp4"))
    assert capability_unsupported("deepgemm", (10, 0), "mxfp4") is None
    assert capability_unsupported("deepgemm", (10, 3), "mxfp4") is None
    # the other DeepGEMM kernels keep their SM90 requirement
    assert capability_unsupported("deepgemm", (9, 0), "gemm") is None
    assert "(SM90)" in str(capability_unsupported("deepgemm", (10, 0), "gemm"))
