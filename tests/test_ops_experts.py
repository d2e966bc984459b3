"""Routed experts: the fused CPU kernel against two grouped GEMMs around the SwiGLU (in float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsinfer.ops import gemm, select_ops
from dsinfer.ops.amx_cpu import amx_bf16_available
from dsinfer.ops.experts import grouped_experts
from dsinfer.ops.experts_cpu import fused_experts
from dsinfer.ops.fp8 import quantize_weight_128x128


def _reference(rows: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    inter = w13.shape[1] // 2
    r, a, b = rows.double(), w13.double(), w2.double()
    out = [
        (F.silu(r[i] @ a[s, :inter].t()) * (r[i] @ a[s, inter:].t())) @ b[s].t()
        for i, s in enumerate(slots.tolist())
    ]
    return torch.stack(out) if out else torch.zeros(0, w2.shape[1], dtype=torch.float64)


def _case(m: int, slots_n: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(m, hidden, generator=g).to(dtype)
    # slot 1 never used: an expert with no rows
    choices = [s for s in range(slots_n) if s != 1] or [0]
    slots = torch.tensor(choices, dtype=torch.int64)[torch.randint(len(choices), (m,), generator=g)]
    w13 = (torch.randn(slots_n, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(slots_n, hidden, inter, generator=g) * inter**-0.5).to(dtype)
    return rows, slots, w13, w2


@pytest.mark.parametrize(
    ("m", "slots_n", "hidden", "inter"),
    [(1, 4, 64, 32), (37, 6, 64, 32), (256, 16, 256, 128), (9, 3, 30, 6)],  # 30/6: ragged blocks
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_experts_matches_reference(
    m: int, slots_n: int, hidden: int, inter: int, dtype: torch.dtype
) -> None:
    rows, slots, w13, w2 = _case(m, slots_n, hidden, inter, dtype)
    fused = fused_experts(rows, slots, w13, None, w2, None)
    assert fused.dtype == dtype and fused.shape == (m, hidden)
    expected = _reference(rows, slots, w13, w2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(fused.double(), expected, atol=tol, rtol=tol)
    grouped = grouped_experts(gemm.grouped_gemm_contiguous, rows, slots, w13, None, w2, None)
    assert torch.allclose(grouped.double(), expected, atol=tol * 2, rtol=tol * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_rows_for_k_pairs_equal_the_rows_repeated(dtype: torch.dtype) -> None:
    """``pairs_per_row`` k: pair p reads token row p // k (MoE passes each token once for its k
    experts): the same bits as the rows repeated k times, in the fused kernel and the grouped
    reference alike."""
    tokens, _, w13, w2 = _case(13, 6, 64, 32, dtype, seed=5)
    k = 3
    pair_slots = torch.randint(6, (13 * k,), generator=torch.Generator().manual_seed(6))
    repeated = tokens.repeat_interleave(k, dim=0)
    fused = fused_experts(tokens, pair_slots, w13, None, w2, None, k)
    assert fused.shape == (13 * k, 64) and torch.equal(
        fused, fused_experts(repeated, pair_slots, w13, None, w2, None)
    )
    grouped = grouped_experts(gemm.grouped_gemm_contiguous, tokens, pair_slots, w13, None, w2, None, k)
    assert torch.equal(
        grouped, grouped_experts(gemm.grouped_gemm_contiguous, repeated, pair_slots, w13, None, w2, None)
    )
    empty = fused_experts(tokens[:0], pair_slots[:0], w13, None, w2, None, k)
    assert empty.shape == (0, 64)


def test_fused_experts_row_result_does_not_depend_on_the_batch() -> None:
    """Expert-parallel pools group rows differently at every size: a row's bits must not change."""
    rows, slots, w13, w2 = _case(45, 5, 64, 32, torch.float32, seed=3)
    whole = fused_experts(rows, slots, w13, None, w2, None)
    for i in (0, 7, 44):
        alone = fused_experts(rows[i : i + 1], slots[i : i + 1], w13, None, w2, None)
        assert torch.equal(alone[0], whole[i])
    half = fused_experts(rows[::2], slots[::2], w13, None, w2, None)
    assert torch.equal(half, whole[::2])


def test_fused_experts_empty_and_fp8_fallback() -> None:
    rows, slots, w13, w2 = _case(0, 4, 64, 32, torch.float32)
    assert fused_experts(rows, slots, w13, None, w2, None).shape == (0, 64)
    # block-FP8 weights go through the grouped-GEMM reference (the CPU loader dequantizes them)
    rows, slots, w13, w2 = _case(8, 2, 128, 128, torch.float32)
    w13_q, w13_s = (torch.stack(t) for t in zip(*(quantize_weight_128x128(w) for w in w13), strict=True))
    w2_q, w2_s = (torch.stack(t) for t in zip(*(quantize_weight_128x128(w) for w in w2), strict=True))
    out = fused_experts(rows, slots, w13_q, w13_s, w2_q, w2_s)
    ref = grouped_experts(gemm.grouped_gemm_contiguous, rows, slots, w13_q, w13_s, w2_q, w2_s)
    assert torch.equal(out, ref)


def test_cpu_ops_choose_the_fused_experts_and_torch_forces_grouped() -> None:
    assert select_ops("cpu").backends["experts"] == ("amx" if amx_bf16_available() else "numba")
    assert select_ops("cpu", prefer="numba").backends["experts"] == "numba"
    assert select_ops("cpu", prefer="torch").backends["experts"] == "grouped"
