"""The masked grouped FP8 GEMM with its operand tiles loaded by TMA (Hopper's copy engine).

Same contract as :func:`.grouped_gemm.m_grouped_fp8_gemm_nt_masked`'s pointer kernel, which launches
this one for a tile with ``TMA: 1``. A and B are seen as 2-D matrices ``[G * max_m, k]`` and
``[G * n, k]``; a ``[BLOCK_M, 128]`` tile of A at row ``g * max_m + m0`` and a ``[BLOCK_N, 128]``
tile of B at row ``g * n + n0`` are one box each, written to shared memory by the copy engine with
no per-element pointers in registers. A box may reach into the next group's rows (``max_m`` or
``n`` not a multiple of the tile): those rows and columns are computed and not stored. Scales stay
pointer loads (one float per row and K block for A; one scalar per tile and K block for B, since
a tile of at most 128 columns lies in one 128-row block of B).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .fp8_gemm import _BLOCK_K, SCALE_BLOCK, _masked_tile, _store_tile

__all__ = ["launch_masked_tma", "masked_tma_unsupported"]


@triton.jit
def _masked_tma_kernel(a_desc, b_desc,
                       sa_ptr, stride_sag, stride_sam, stride_sak,
                       sb_ptr, stride_sbg, stride_sbn, stride_sbk,
                       d_ptr, stride_dg, stride_dm, stride_dn,
                       masked_m_ptr, M_MAX, N, K,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    g, pid_m, pid_n, offs_m, offs_n, row_mask, live = _masked_tile(
        masked_m_ptr, M_MAX, N, BLOCK_M, BLOCK_N, GROUP_M
    )
    if live:
        a_row = (g * M_MAX + pid_m * BLOCK_M).to(tl.int32)
        b_row = (g * N + pid_n * BLOCK_N).to(tl.int32)
        sa_ptrs = sa_ptr + g * stride_sag + offs_m.to(tl.int64) * stride_sam
        sb_ptrs = sb_ptr + g * stride_sbg + (pid_n * BLOCK_N // _BLOCK_K) * stride_sbn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in tl.range(0, K // _BLOCK_K):
            a = a_desc.load([a_row, kb * _BLOCK_K])
            b = b_desc.load([b_row, kb * _BLOCK_K])
            factor = tl.load(sa_ptrs + kb * stride_sak, mask=row_mask, other=0.0) * tl.load(
                sb_ptrs + kb * stride_sbk
            )
            acc += tl.dot(a, tl.trans(b)) * factor[:, None]
        _store_tile(d_ptr + g * stride_dg, acc, offs_m, offs_n, row_mask, N, stride_dm, stride_dn, False)


def masked_tma_unsupported(qa: torch.Tensor, qb: torch.Tensor, block_n: int) -> str | None:
    """Why the TMA kernel cannot take these operands, or None."""
    k = qa.shape[-1]
    if k % SCALE_BLOCK:
        return f"k {k} is not a multiple of {SCALE_BLOCK}"
    if SCALE_BLOCK % block_n:
        return f"a {block_n}-column tile does not lie in one {SCALE_BLOCK}-row scale block"
    if not (qa.is_contiguous() and qb.is_contiguous()):
        return "A and B must be contiguous"
    if qa.data_ptr() % 16 or qb.data_ptr() % 16:
        return "A and B must be 16-byte aligned"
    return None


def launch_masked_tma(
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    d: torch.Tensor,
    masked_m: torch.Tensor,
    cfg: dict[str, int],
) -> None:
    """One launch over ``(tiles of max_m x n, G)``; the caller checked :func:`masked_tma_unsupported`."""
    (qa, sa), (qb, sb) = a, b
    num_groups, m_max, k = qa.shape
    n = qb.shape[1]
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    a2, b2 = qa.view(num_groups * m_max, k), qb.view(num_groups * n, k)
    a_desc = TensorDescriptor(a2, list(a2.shape), list(a2.stride()), [bm, SCALE_BLOCK])
    b_desc = TensorDescriptor(b2, list(b2.shape), list(b2.stride()), [bn, SCALE_BLOCK])
    grid = (triton.cdiv(m_max, bm) * triton.cdiv(n, bn), num_groups)
    _masked_tma_kernel[grid](
        a_desc, b_desc, sa, *sa.stride(), sb, *sb.stride(), d, *d.stride(), masked_m, m_max, n, k,
        BLOCK_M=bm, BLOCK_N=bn, GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )  # fmt: skip
