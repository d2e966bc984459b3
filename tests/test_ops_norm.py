"""The CPU RMSNorm (numba) against the torch reference: float32 to rounding, bf16 with the
reference's two roundings (normalised row, then times the weight), any leading shape and
non-contiguous views, zero rows, other dtype pairs through the reference, and a row's result
independent of the rows beside it."""

from __future__ import annotations

import pytest
import torch

from dsinfer.ops import norm, norm_cpu

EPS = 1e-6


def _inputs(dtype: torch.dtype, rows: int = 37, dim: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rows * dim)
    x = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    w = (torch.rand(dim, generator=g) + 0.5).to(dtype)
    return x, w


def test_float32_matches_the_reference() -> None:
    x, w = _inputs(torch.float32)
    out = norm_cpu.rms_norm(x, w, EPS)
    assert out.dtype == torch.float32 and out.shape == x.shape
    torch.testing.assert_close(out, norm.rms_norm(x, w, EPS), rtol=2e-6, atol=2e-6)


def test_bf16_rounds_as_the_reference() -> None:
    x, w = _inputs(torch.bfloat16, rows=256, dim=512)
    out = norm_cpu.rms_norm(x, w, EPS)
    ref = norm.rms_norm(x, w, EPS)
    assert out.dtype == torch.bfloat16
    # the sum of squares may round differently in its last bit: a rare value lands one bf16 step away
    steps = (out.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-30) * 128
    assert (steps <= 1.01).all()
    assert (out == ref).float().mean() > 0.99
    # with a scale the reference computes alike, every value is equal: the roundings are the same
    unit = torch.full((3, 512), 0.5).bfloat16()
    assert torch.equal(norm_cpu.rms_norm(unit, w, 0.0), norm.rms_norm(unit, w, 0.0))


def test_shapes_views_and_empty() -> None:
    x, w = _inputs(torch.float32, rows=24, dim=64)
    batched = x.view(2, 3, 4, 64)
    torch.testing.assert_close(norm_cpu.rms_norm(batched, w, EPS), norm.rms_norm(batched, w, EPS))
    wide = torch.cat([x, x], dim=-1)[:, :64]  # a strided view, as a latent slice of kv_a_proj's output
    assert not wide.is_contiguous()
    torch.testing.assert_close(norm_cpu.rms_norm(wide, w, EPS), norm.rms_norm(x, w, EPS))
    for dtype in (torch.float32, torch.bfloat16):  # rows read in place, not packed first: same bits
        both = torch.cat([x, x * 2], dim=-1).to(dtype)
        for part in (both[:, :64], both[:, 64:], both[3:9, 64:]):
            assert part.stride(0) == 128
            packed = part.contiguous()
            assert torch.equal(
                norm_cpu.rms_norm(part, w.to(dtype), EPS), norm_cpu.rms_norm(packed, w.to(dtype), EPS)
            )
    empty = norm_cpu.rms_norm(x[:0], w, EPS)
    assert empty.shape == (0, 64)


@pytest.mark.parametrize(
    ("x_dtype", "w_dtype"), [(torch.float32, torch.bfloat16), (torch.float16, torch.float16)]
)
def test_other_dtypes_take_the_reference(x_dtype: torch.dtype, w_dtype: torch.dtype) -> None:
    x, w = _inputs(torch.float32)
    x, w = x.to(x_dtype), w.to(w_dtype)
    assert torch.equal(norm_cpu.rms_norm(x, w, EPS), norm.rms_norm(x, w, EPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_its_neighbours(dtype: torch.dtype) -> None:
    x, w = _inputs(dtype, rows=9)
    whole = norm_cpu.rms_norm(x, w, EPS)
    for i in (0, 4, 8):
        assert torch.equal(norm_cpu.rms_norm(x[i : i + 1], w, EPS), whole[i : i + 1])
