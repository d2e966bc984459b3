"""Grouped block-FP8 expert GEMMs in Triton with DeepGEMM's contiguous and masked layouts.

Both reuse the dense kernel's tile (:func:`kernels.fp8_gemm._scaled_dot`): one fp8 tensor-core
product per 128-wide K block, scaled by the 1x128 activation and 128x128 weight scales into fp32.

- Contiguous (prefill): rows of ``A [m_sum, k]`` use expert ``m_indices[row]``; rows marked -1 are
  skipped (not written), as in DeepGEMM. DeepGEMM needs every expert segment padded to 128 rows;
  here a row tile may hold several experts (unpadded, even unsorted rows), each computed only for
  its own rows, so sorted unpadded segments cost at most one extra tile product per boundary.
  Its tile (:func:`contiguous_tile_config`) comes from the H100 sweep of 2026-11-26: at 2048 rows
  (256 per expert) 64x128 with 4 warps runs 2.4-2.6x faster than the 32x64, 8-warp tile chosen
  before any GPU to avoid spills (241 against 632 us for w13), although its build spills (an
  832-byte stack frame for sm_90a with Triton 3.9); at 256 rows 32x128 with 4 warps is the fastest.
  The kit's ``triton-compile`` stage (scripts/gpu-check) reports the frames of every configuration.
- Masked (decode, DeepEP low-latency layout): ``A [G, max_m, k]`` and only the first
  ``masked_m[g]`` rows of group ``g`` are computed and written; tiles past them exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_gemm import _masked_tile, _scaled_dot, _store_tile, _tile_offsets, check_operands, tile_config
from .grouped_gemm_tma import launch_masked_tma, masked_tma_unsupported

__all__ = [
    "contiguous_tile_config",
    "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nt_masked",
    "masked_tile_config",
]


def contiguous_tile_config(m: int, n: int) -> dict[str, int]:
    """Launch parameters of the contiguous kernel for ``m`` rows in all (see the module docstring):
    64-row tiles from 1024 rows, 32 below, 128 columns, 4 warps."""
    block_m = 64 if m >= 1024 else min(max(triton.next_power_of_2(max(m, 1)), 16), 32)
    block_n = min(max(triton.next_power_of_2(max(n, 1)), 16), 128)
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}


def masked_tile_config(m: int, n: int, k: int) -> dict[str, int]:
    """The masked kernel's launch for ``m`` expected rows per group: :func:`tile_config`'s, except
    that 256 rows or more over ``k <= 2048`` (V3's w2) take the TMA kernel's 64x128 tile with 4
    warps (H100, 2026-11-28, 8 x 256 x 7168 x 2048: 89.4 against 97.4 us; over k = 7168 it was
    slower, 187 against 168 us, and at 32 rows level)."""
    if m >= 256 and k <= 2048:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3, "TMA": 1}
    return tile_config(m, n)


@triton.jit
def _contiguous_kernel(
    a_ptr,
    sa_ptr,
    b_ptr,
    sb_ptr,
    d_ptr,
    idx_ptr,
    M,
    N,
    K,
    G,
    stride_am,
    stride_ak,
    stride_sam,
    stride_sak,
    stride_bg,
    stride_bn,
    stride_bk,
    stride_sbg,
    stride_sbn,
    stride_sbk,
    stride_dm,
    stride_dn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    offs_m, offs_n = _tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    group = tl.load(idx_ptr + offs_m, mask=offs_m < M, other=-1).to(tl.int32)
    group = tl.where((group >= 0) & (group < G), group, -1)  # no such expert: skipped like -1
    # int64 expert ids: expert * stride_bg can pass 2^31 (256 experts of 4096 x 7168).
    first = tl.min(tl.where(group >= 0, group, G), axis=0).to(tl.int64)
    last = tl.max(group, axis=0).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for e in range(first, last + 1):
        rows = group == e
        if tl.max(rows.to(tl.int32), axis=0) > 0:
            part = _scaled_dot(
                a_ptr, sa_ptr, b_ptr + e * stride_bg, sb_ptr + e * stride_sbg,
                offs_m, offs_n, rows, N, K,
                stride_am, stride_ak, stride_sam, stride_sak, stride_bn, stride_bk, stride_sbn, stride_sbk,
                BLOCK_M, BLOCK_N, EVEN_K,
            )  # fmt: skip
            acc = tl.where(rows[:, None], part, acc)
    _store_tile(d_ptr, acc, offs_m, offs_n, group >= 0, N, stride_dm, stride_dn, False)


@triton.jit
def _masked_kernel(
    a_ptr,
    sa_ptr,
    b_ptr,
    sb_ptr,
    d_ptr,
    masked_m_ptr,
    M_MAX,
    N,
    K,
    stride_ag,
    stride_am,
    stride_ak,
    stride_sag,
    stride_sam,
    stride_sak,
    stride_bg,
    stride_bn,
    stride_bk,
    stride_sbg,
    stride_sbn,
    stride_sbk,
    stride_dg,
    stride_dm,
    stride_dn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    g, _, _, offs_m, offs_n, row_mask, live = _masked_tile(masked_m_ptr, M_MAX, N, BLOCK_M, BLOCK_N, GROUP_M)
    if live:
        acc = _scaled_dot(
            a_ptr + g * stride_ag, sa_ptr + g * stride_sag, b_ptr + g * stride_bg, sb_ptr + g * stride_sbg,
            offs_m, offs_n, row_mask, N, K,
            stride_am, stride_ak, stride_sam, stride_sak, stride_bn, stride_bk, stride_sbn, stride_sbk,
            BLOCK_M, BLOCK_N, EVEN_K,
        )  # fmt: skip
        _store_tile(d_ptr + g * stride_dg, acc, offs_m, offs_n, row_mask, N, stride_dm, stride_dn, False)


def m_grouped_fp8_gemm_nt_contiguous(
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    d: torch.Tensor,
    m_indices: torch.Tensor,
    tile: dict[str, int] | None = None,
) -> None:
    """DeepGEMM's contiguous grouped GEMM: ``d[i] = (A[i] * sa[i]) @ (B[g] * sb[g])^T``, ``g = m_indices[i]``.

    ``a = (A fp8 [m_sum, k], sa fp32 [m_sum, ceil(k/128)])``, ``b = (B fp8 [G, n, k], sb fp32
    [G, ceil(n/128), ceil(k/128)])``, ``d`` bf16 or fp32 ``[m_sum, n]``, ``m_indices`` int ``[m_sum]``.
    Rows whose index is -1 (or not an expert of ``B``) are left untouched. ``tile`` replaces
    :func:`contiguous_tile_config`'s launch parameters (tuning).
    """
    check_operands(a, b, d, "m_grouped_fp8_gemm_nt_contiguous")
    (qa, sa), (qb, sb) = a, b
    (m, k), (num_groups, n) = qa.shape, qb.shape[:2]
    if tuple(d.shape) != (m, n) or tuple(m_indices.shape) != (m,):
        raise ValueError(
            f"m_grouped_fp8_gemm_nt_contiguous: output {tuple(d.shape)} must be [{m}, {n}] and "
            f"m_indices {tuple(m_indices.shape)} [{m}]"
        )
    if m == 0 or n == 0 or num_groups == 0:
        return
    cfg = tile or contiguous_tile_config(m, n)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _contiguous_kernel[grid](
        qa, sa, qb, sb, d, m_indices, m, n, k, num_groups,
        qa.stride(0), qa.stride(1), sa.stride(0), sa.stride(1),
        qb.stride(0), qb.stride(1), qb.stride(2), sb.stride(0), sb.stride(1), sb.stride(2),
        d.stride(0), d.stride(1),
        EVEN_K=k % 128 == 0, **cfg,
    )  # fmt: skip


def m_grouped_fp8_gemm_nt_masked(
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    d: torch.Tensor,
    masked_m: torch.Tensor,
    expected_m: int,
    tile: dict[str, int] | None = None,
) -> None:
    """DeepGEMM's masked grouped GEMM: ``d[g, :masked_m[g]] = (A[g] * sa[g]) @ (B[g] * sb[g])^T`` rows.

    ``a = (A fp8 [G, max_m, k], sa fp32 [G, max_m, ceil(k/128)])``, ``b = (B fp8 [G, n, k], sb fp32
    [G, ceil(n/128), ceil(k/128)])``, ``d`` bf16 or fp32 ``[G, max_m, n]``, ``masked_m`` int ``[G]``
    (read on the device, no host sync). Rows at or past ``masked_m[g]`` are left untouched.
    ``expected_m`` (a host-side hint of the typical ``masked_m``) picks the launch
    (:func:`masked_tile_config`); ``tile`` replaces it (tuning; ``TMA: 1`` runs
    :mod:`.grouped_gemm_tma`'s kernel, which raises where it cannot take the operands; a default
    TMA launch falls back to the pointer kernel there).
    """
    check_operands(a, b, d, "m_grouped_fp8_gemm_nt_masked")
    (qa, sa), (qb, sb) = a, b
    num_groups, m_max, k = qa.shape
    n = qb.shape[1]
    if qb.shape[0] != num_groups or tuple(d.shape) != (num_groups, m_max, n):
        raise ValueError(
            f"m_grouped_fp8_gemm_nt_masked: B {tuple(qb.shape)} and output {tuple(d.shape)} must have "
            f"{num_groups} groups; output [{num_groups}, {m_max}, {n}]"
        )
    if tuple(masked_m.shape) != (num_groups,):
        raise ValueError(
            f"m_grouped_fp8_gemm_nt_masked: masked_m {tuple(masked_m.shape)} must be [{num_groups}]"
        )
    if num_groups == 0 or m_max == 0 or n == 0:
        return
    rows = min(max(int(expected_m), 1), m_max)
    cfg = dict(tile or masked_tile_config(rows, n, k))
    if cfg.pop("TMA", 0):
        why = masked_tma_unsupported(qa, qb, cfg["BLOCK_N"])
        if why is None:
            launch_masked_tma(a, b, d, masked_m, cfg)
            return
        if tile is not None:
            raise ValueError(f"m_grouped_fp8_gemm_nt_masked: the TMA kernel cannot run: {why}")
        cfg = tile_config(rows, n)
    grid = (triton.cdiv(m_max, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), num_groups)
    _masked_kernel[grid](
        qa, sa, qb, sb, d, masked_m, m_max, n, k,
        qa.stride(0), qa.stride(1), qa.stride(2), sa.stride(0), sa.stride(1), sa.stride(2),
        qb.stride(0), qb.stride(1), qb.stride(2), sb.stride(0), sb.stride(1), sb.stride(2),
        d.stride(0), d.stride(1), d.stride(2),
        EVEN_K=k % 128 == 0, **cfg,
    )  # fmt: skip
