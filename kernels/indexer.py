"""DeepSeek-V3.2's lightning-indexer logits over the paged key cache, in Triton.

Semantics are those of :func:`dsinfer.ops.indexer.indexer_logits`: for query token ``j`` of
sequence ``b`` and key ``t`` (slot ``t % page_size`` of page ``block_table[b, t // page_size]``),
``logit = sum_h weights[b, j, h] * relu(q[b, j, h] . k[t])`` when ``t <= cache_seqlens[b] - s_q + j``,
else ``-inf``; the output is fp32 ``[B, s_q, block_table.shape[1] * page_size]``. The key cache is
plain (``[pages, page_size, D]``, fp32/bf16/fp16) or FP8 (uint8 ``[pages, page_size, D + 4]``:
within a page its tokens' e4m3 keys, then their fp32 scales, DeepGEMM's layout), and ``q`` is
float or e4m3. Products accumulate in fp32.

One program per (sequence, query token, block of ``BLOCK_N`` keys): the query's heads form a
``[BLOCK_H, D]`` tile that meets each key tile in one ``tl.dot``. Top-k is left to torch
(``dsinfer.ops.indexer.select_topk``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .online_softmax import FLOAT_DTYPES

__all__ = ["indexer_logits"]

SCALE_BYTES = 4


@triton.jit
def _indexer_logits_kernel(
    q_ptr,
    w_ptr,
    k_ptr,
    table_ptr,
    lens_ptr,
    out_ptr,
    s_q,
    heads,
    table_width,
    length,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_wb,
    stride_ws,
    stride_kp,
    stride_kt,
    stride_tb,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8_KEYS: tl.constexpr,
):
    b = tl.program_id(0)
    j = tl.program_id(1)
    key_block = tl.program_id(2)
    last = tl.load(lens_ptr + b) - s_q + j

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok, d_ok = offs_h < heads, offs_d < D
    q_row = q_ptr + b.to(tl.int64) * stride_qb + j * stride_qs
    q = tl.load(
        q_row + offs_h[:, None] * stride_qh + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0
    )
    w = tl.load(w_ptr + b.to(tl.int64) * stride_wb + j * stride_ws + offs_h, mask=h_ok, other=0.0)

    pos = key_block * BLOCK_N + tl.arange(0, BLOCK_N)
    page_idx = pos // PAGE_SIZE
    key_ok = (pos <= last) & (page_idx < table_width)
    page = tl.load(table_ptr + b.to(tl.int64) * stride_tb + page_idx, mask=key_ok, other=0).to(tl.int64)
    slot = pos % PAGE_SIZE
    if FP8_KEYS:  # the page's D-byte keys, then its fp32 scales
        k_bytes = tl.load(
            k_ptr + page[:, None] * stride_kp + slot[:, None] * D + offs_d[None, :],
            mask=key_ok[:, None] & d_ok[None, :],
            other=0,
        )
        k = k_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        scale_ptr = (k_ptr + page * stride_kp + PAGE_SIZE * D + slot * 4).to(tl.pointer_type(tl.float32))
        k = k * tl.load(scale_ptr, mask=key_ok, other=0.0)[:, None]
    else:
        k = tl.load(
            k_ptr + page[:, None] * stride_kp + slot[:, None] * stride_kt + offs_d[None, :],
            mask=key_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(tl.float32)
    scores = tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee")  # [BLOCK_H, BLOCK_N]
    logits = tl.sum(tl.maximum(scores, 0.0) * w[:, None], 0)
    out_row = out_ptr + (b * s_q + j).to(tl.int64) * length
    tl.store(out_row + pos, tl.where(key_ok, logits, float("-inf")), mask=pos < length)


def indexer_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    block_n: int = 32,
) -> torch.Tensor:
    """fp32 ``[B, s_q, L]``, ``L = block_table.shape[1] * page_size`` (see the module doc)."""
    bsz, s_q, heads, dim = q.shape
    pages, page_size, width = k_cache.shape
    fp8 = k_cache.dtype == torch.uint8
    if fp8 and width != dim + SCALE_BYTES:
        raise ValueError(f"an FP8 key cache holds {dim} + {SCALE_BYTES} bytes per key, got {width}")
    if not fp8 and (width != dim or k_cache.dtype not in FLOAT_DTYPES):
        raise ValueError(f"key cache {k_cache.dtype} [.., {width}] does not hold {dim}-wide keys")
    if weights.shape != (bsz, s_q, heads):
        raise ValueError(f"weights must be [{bsz}, {s_q}, {heads}], got {tuple(weights.shape)}")
    length = block_table.shape[1] * page_size
    out = torch.empty(bsz, s_q, length, dtype=torch.float32, device=q.device)
    if out.numel() == 0 or pages == 0:
        return out.fill_(float("-inf"))
    if k_cache.stride(-1) != 1 or (fp8 and not k_cache.is_contiguous()):
        raise ValueError("the key cache must have contiguous channels (FP8: contiguous pages)")
    q = q if q.stride(-1) == 1 else q.contiguous()
    weights = weights.float().contiguous()
    table = block_table.to(device=q.device, dtype=torch.int32).contiguous()
    lens = cache_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
    grid = (bsz, s_q, triton.cdiv(length, block_n))
    _indexer_logits_kernel[grid](
        q,
        weights,
        k_cache,
        table,
        lens,
        out,
        s_q,
        heads,
        table.shape[1],
        length,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        weights.stride(0),
        weights.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        table.stride(0),
        D=dim,
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_H=max(16, triton.next_power_of_2(heads)),
        PAGE_SIZE=page_size,
        BLOCK_N=block_n,
        FP8_KEYS=fp8,
    )
    return out
