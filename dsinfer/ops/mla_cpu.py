"""Fused MLA decode over the paged latent cache for CPUs (numba), with FlashMLA's semantics.

The torch reference gathers every sequence's pages into a padded batch and reads it twice; decode
attention is memory-bound, so this kernel reads each cached latent row once, straight from its
page, for all query heads at once (they share the single latent KV head), with an online softmax
across pages. Sequences run in parallel. Math is fp32; a bf16 cache is read as its raw bits.
Semantics are those of :func:`dsinfer.ops.mla.mla_decode` (bottom-right causal mask, natural-log
lse, an empty row gives out 0 and lse +inf); only slots below ``cache_seqlens`` are ever read.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

__all__ = ["mla_decode"]

_FASTMATH = {"reassoc", "contract", "nsz"}  # let LLVM vectorize dot products; keep inf semantics


@numba.njit(cache=True, fastmath=_FASTMATH, inline="always")
def _scores4(qb, kv, t, r, dim, scale, scores):
    """Scores of key t for query rows r..r+3: each cached value is loaded once for four FMAs."""
    s0 = s1 = s2 = s3 = np.float32(0.0)
    for d in range(dim):
        k = kv[t, d]
        s0 += qb[r, d] * k
        s1 += qb[r + 1, d] * k
        s2 += qb[r + 2, d] * k
        s3 += qb[r + 3, d] * k
    scores[r, t], scores[r + 1, t] = s0 * scale, s1 * scale
    scores[r + 2, t], scores[r + 3, t] = s2 * scale, s3 * scale


@numba.njit(cache=True, fastmath=_FASTMATH, inline="always")
def _attend_page(qb, kv, count, start, n, s_q, h_q, dv, scale, causal, m, denom, acc, scores):
    """Online-softmax update of every query row with keys start..start+count-1 held in kv.
    Key-major loops: each cached row is read once from memory for all query rows; query rows go
    four at a time so a loaded value feeds four FMAs."""
    rows, dim = qb.shape
    blocked = rows - rows % 4
    for t in range(count):
        for r in range(0, blocked, 4):
            _scores4(qb, kv, t, r, dim, scale, scores)
        for r in range(blocked, rows):
            dot = np.float32(0.0)
            for d in range(dim):
                dot += qb[r, d] * kv[t, d]
            scores[r, t] = dot * scale
    for r in range(rows):
        visible = min(count, (n - s_q + r // h_q + 1 if causal else n) - start)  # keys [start, start+visible)
        if visible <= 0:
            for t in range(count):
                scores[r, t] = 0.0
            continue
        new_max = max(m[r], scores[r, :visible].max())
        correction = np.exp(m[r] - new_max)
        denom[r] *= correction
        for d in range(dv):
            acc[r, d] *= correction
        for t in range(count):
            scores[r, t] = np.exp(scores[r, t] - new_max) if t < visible else 0.0
            denom[r] += scores[r, t]
        m[r] = new_max
    for t in range(count):
        for r in range(0, blocked, 4):
            p0, p1, p2, p3 = scores[r, t], scores[r + 1, t], scores[r + 2, t], scores[r + 3, t]
            for d in range(dv):
                k = kv[t, d]
                acc[r, d] += p0 * k
                acc[r + 1, d] += p1 * k
                acc[r + 2, d] += p2 * k
                acc[r + 3, d] += p3 * k
        for r in range(blocked, rows):
            p = scores[r, t]
            for d in range(dv):
                acc[r, d] += p * kv[t, d]


@numba.njit(parallel=True, cache=True, fastmath=_FASTMATH, nogil=True)
def _decode(q, cache, bf16_bits, table, lens, dv, scale, causal, out, lse):  # numpy arrays, typed by numba
    """``cache`` is float32 [P, page, D] (``bf16_bits`` unused) or, when ``cache`` has no rows and
    ``bf16_bits`` holds the cache as uint16, bf16 read through a float32 scratch page."""
    bsz, s_q, h_q, dim = q.shape
    bf16 = bf16_bits.shape[0] > 0
    page_size = bf16_bits.shape[1] if bf16 else cache.shape[1]
    rows = s_q * h_q
    for b in numba.prange(bsz):
        n = lens[b]
        qb = q[b].reshape(rows, dim)
        m = np.full(rows, -np.inf, dtype=np.float32)
        denom = np.zeros(rows, dtype=np.float32)
        acc = np.zeros((rows, dv), dtype=np.float32)
        scores = np.empty((rows, page_size), dtype=np.float32)
        page = np.empty((page_size, dim), dtype=np.float32)
        page_bits = page.view(np.uint32)
        for start in range(0, n, page_size):
            count = min(page_size, n - start)
            block = table[b, start // page_size]
            if bf16:
                src = bf16_bits[block]
                for t in range(count):
                    for d in range(dim):
                        page_bits[t, d] = np.uint32(src[t, d]) << np.uint32(16)
                _attend_page(qb, page, count, start, n, s_q, h_q, dv, scale, causal, m, denom, acc, scores)
            else:
                _attend_page(
                    qb, cache[block], count, start, n, s_q, h_q, dv, scale, causal, m, denom, acc, scores
                )
        for r in range(rows):
            s, h = r // h_q, r % h_q
            if denom[r] == 0.0:
                out[b, s, h, :] = 0.0
                lse[b, h, s] = np.inf
            else:
                for d in range(dv):
                    out[b, s, h, d] = acc[r, d] / denom[r]
                lse[b, h, s] = m[r] + np.log(denom[r])


def mla_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, s_q, h_q, head_dim_v], lse fp32 [B, h_q, s_q])``; CPU tensors only."""
    bsz, s_q, h_q, dim = q.shape
    if k_cache.shape[2] != 1 or k_cache.shape[3] != dim:
        raise ValueError(f"mla_decode expects k_cache [blocks, page, 1, {dim}], got {tuple(k_cache.shape)}")
    if not 0 < head_dim_v <= dim:
        raise ValueError(f"head_dim_v must be in (0, {dim}], got {head_dim_v}")
    bf16 = k_cache.dtype == torch.bfloat16
    if not bf16 and k_cache.dtype != torch.float32:
        raise ValueError(f"mla_decode on CPU takes a float32 or bfloat16 cache, got {k_cache.dtype}")
    cache = k_cache.reshape(k_cache.shape[0], k_cache.shape[1], dim)  # a view: numba sees C layout
    if bf16:
        cache_np = np.empty((0, 1, dim), dtype=np.float32)
        bits_np = cache.view(torch.int16).numpy().view(np.uint16)
    else:
        cache_np, bits_np = cache.numpy(), np.empty((0, 1, dim), dtype=np.uint16)
    out = torch.empty(bsz, s_q, h_q, head_dim_v, dtype=torch.float32)
    lse = torch.empty(bsz, h_q, s_q, dtype=torch.float32)
    # one thread budget: the kernel uses as many threads as torch does in this process
    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))
    _decode(
        q.detach().float().contiguous().numpy(),
        cache_np,
        bits_np,
        block_table.to(torch.int32).contiguous().numpy(),
        cache_seqlens.to(torch.int32).contiguous().numpy(),
        head_dim_v,
        np.float32(softmax_scale),
        causal,
        out.numpy(),
        lse.numpy(),
    )
    return out.to(q.dtype), lse
