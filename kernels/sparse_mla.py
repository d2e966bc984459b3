"""Sparse MLA decode in Triton: absorbed attention over the cache slots each query picked.

Semantics are those of :func:`dsinfer.ops.sparse_mla.sparse_mla_decode` (FlashMLA's token-level
sparse decoding): one latent KV head (``k_cache [num_blocks, page_size, 1, D]``, K = all ``D``
channels, V = the first ``head_dim_v``) shared by every head; query token ``j`` of sequence ``b``
attends to the flat slots ``indices[b, j, :]`` (``page * page_size + offset``, ``-1`` unused).
``lse`` is natural-log ``[B, h_q, s_q]``; a row with no valid index gets ``out = 0``, ``lse = +inf``.

One program per (sequence, query token, block of ``BLOCK_M`` heads): an online softmax over the
query's indices, ``BLOCK_N`` gathered keys at a time, each key tile used for ``Q K^T`` and
``P V``. No split over keys: a query sees at most ``topk`` (2048 in V3.2) keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .online_softmax import FLOAT_DTYPES, LOG2E, channel_constants, online_softmax_finish, online_softmax_step

__all__ = ["sparse_mla_decode", "sparse_mla_decode_tiled"]


@triton.jit
def _sparse_mla_kernel(
    q_ptr,
    kv_ptr,
    idx_ptr,
    out_ptr,
    lse_ptr,
    scale_log2,
    s_q,
    h_q,
    topk,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_ib,
    stride_is,
    DV: tl.constexpr,
    DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_PE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    j = tl.program_id(1)
    head_block = tl.program_id(2)
    heads = head_block * BLOCK_M + tl.arange(0, BLOCK_M)
    head_ok = heads < h_q
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + j * stride_qs + heads * stride_qh
    q_nope = tl.load(q_rows[:, None] + offs_dv[None, :], mask=head_ok[:, None] & dv_ok[None, :], other=0.0)
    q_nope = q_nope.to(tl.float32)
    if DPE > 0:
        offs_pe = tl.arange(0, BLOCK_PE)
        pe_ok = offs_pe < DPE
        q_pe = tl.load(
            q_rows[:, None] + DV + offs_pe[None, :], mask=head_ok[:, None] & pe_ok[None, :], other=0.0
        ).to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    idx_row = idx_ptr + b.to(tl.int64) * stride_ib + j * stride_is
    for k0 in range(0, topk, BLOCK_N):
        offs_n = k0 + tl.arange(0, BLOCK_N)
        slot = tl.load(idx_row + offs_n, mask=offs_n < topk, other=-1).to(tl.int64)
        key_ok = slot >= 0
        slot = tl.where(key_ok, slot, 0)
        rows = kv_ptr + (slot // PAGE_SIZE) * stride_kp + (slot % PAGE_SIZE) * stride_kt
        kv = tl.load(rows[:, None] + offs_dv[None, :], mask=key_ok[:, None] & dv_ok[None, :], other=0.0)
        kv = kv.to(tl.float32)
        scores = tl.dot(q_nope, tl.trans(kv), input_precision="ieee")
        if DPE > 0:
            k_pe = tl.load(
                rows[:, None] + DV + offs_pe[None, :], mask=key_ok[:, None] & pe_ok[None, :], other=0.0
            )
            scores += tl.dot(q_pe, tl.trans(k_pe.to(tl.float32)), input_precision="ieee")
        scores = tl.where(key_ok[None, :], scores * scale_log2, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(scores, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p, kv, input_precision="ieee")

    out, lse, seen = online_softmax_finish(acc, m_i, l_i)
    out_rows = ((b * s_q + j) * h_q + heads).to(tl.int64) * DV
    tl.store(
        out_ptr + out_rows[:, None] + offs_dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=head_ok[:, None] & dv_ok[None, :],
    )
    tl.store(
        lse_ptr + (b * h_q + heads).to(tl.int64) * s_q + j, tl.where(seen, lse, float("inf")), mask=head_ok
    )


def sparse_mla_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    head_dim_v: int,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, s_q, h_q, head_dim_v]`` in q's dtype, ``lse fp32 [B, h_q, s_q])``; the Ops
    signature (see :mod:`dsinfer.ops.sparse_mla`)."""
    return sparse_mla_decode_tiled(q, k_cache, indices, head_dim_v, softmax_scale)


def sparse_mla_decode_tiled(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    head_dim_v: int,
    softmax_scale: float,
    *,
    block_m: int = 16,
    block_n: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sparse_mla_decode` with its tiles exposed: ``block_m`` heads and ``block_n`` picked
    keys per step (powers of two, at least 16)."""
    bsz, s_q, h_q, dim = q.shape
    if k_cache.dim() != 4 or k_cache.shape[2] != 1 or k_cache.shape[3] != dim:
        raise ValueError(f"k_cache must be [blocks, page_size, 1, {dim}], got {tuple(k_cache.shape)}")
    if indices.shape[:2] != (bsz, s_q):
        raise ValueError(f"indices must be [{bsz}, {s_q}, topk], got {tuple(indices.shape)}")
    if not 0 < head_dim_v <= dim:
        raise ValueError(f"head_dim_v must be in (0, {dim}], got {head_dim_v}")
    if q.dtype not in FLOAT_DTYPES or k_cache.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"sparse_mla_decode takes float32, bfloat16 or float16, got {q.dtype}, {k_cache.dtype}"
        )
    device = q.device
    out = torch.zeros(bsz, s_q, h_q, head_dim_v, dtype=q.dtype, device=device)
    lse = torch.full((bsz, h_q, s_q), float("inf"), dtype=torch.float32, device=device)
    topk = indices.shape[2]
    if out.numel() == 0 or topk == 0:
        return out, lse
    if k_cache.stride(-1) != 1:
        raise ValueError("k_cache channels must be contiguous")
    q = q if q.stride(-1) == 1 else q.contiguous()
    idx = indices.to(device=device, dtype=torch.int32).contiguous()
    grid = (bsz, s_q, triton.cdiv(h_q, block_m))
    _sparse_mla_kernel[grid](
        q,
        k_cache,
        idx,
        out,
        lse,
        softmax_scale * LOG2E,
        s_q,
        h_q,
        topk,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        idx.stride(0),
        idx.stride(1),
        **channel_constants(head_dim_v, dim),
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
    )
    return out, lse
