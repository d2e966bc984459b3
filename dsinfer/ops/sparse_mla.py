"""Sparse MLA decode: absorbed attention over the cache slots each query picked (torch reference).

FlashMLA's token-level sparse decoding semantics (DeepSeek-V3.2): one latent KV head
(``k_cache [num_blocks, page_size, 1, D]``, K = all ``D`` channels, V = the first ``head_dim_v``)
shared by every query head; query token ``j`` of sequence ``b`` attends to exactly the slots
``indices[b, j, :]`` (flat ``page * page_size + offset``; ``-1`` = unused). No causal mask: the
indices say what is visible. ``lse`` is natural-log, ``[B, h_q, s_q]``; a row with no valid index
gets ``out = 0`` and ``lse = +inf``.
"""

from __future__ import annotations

import torch

__all__ = ["sparse_mla_decode"]


def sparse_mla_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    head_dim_v: int,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, s_q, h_q, D]``, ``indices int32 [B, s_q, topk]`` -> ``(out [B, s_q, h_q, head_dim_v]``
    in q's dtype, ``lse fp32 [B, h_q, s_q])``. Computes in fp32."""
    bsz, s_q, _, dim = q.shape
    if k_cache.dim() != 4 or k_cache.shape[2] != 1 or k_cache.shape[3] != dim:
        raise ValueError(f"k_cache must be [blocks, page_size, 1, {dim}], got {tuple(k_cache.shape)}")
    if indices.shape[:2] != (bsz, s_q):
        raise ValueError(f"indices must be [{bsz}, {s_q}, topk], got {tuple(indices.shape)}")
    if not 0 < head_dim_v <= dim:
        raise ValueError(f"head_dim_v must be in (0, {dim}], got {head_dim_v}")
    topk = indices.shape[2]
    flat = k_cache.view(-1, dim)
    valid = indices >= 0  # [B, s_q, topk]
    picked = flat.index_select(0, indices.reshape(-1).long().clamp(min=0)).float().view(bsz, s_q, topk, dim)
    picked = torch.where(valid.unsqueeze(-1), picked, 0.0)  # garbage (even NaN) in unused slots cannot leak
    scores = torch.einsum("bshd,bskd->bshk", q.float(), picked) * softmax_scale
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, s_q, h_q]
    empty = torch.isneginf(lse)
    probs = (scores - torch.where(empty, 0.0, lse).unsqueeze(-1)).exp()
    out = torch.einsum("bshk,bskv->bshv", probs, picked[..., :head_dim_v])
    lse = torch.where(empty, float("inf"), lse)
    return out.to(q.dtype), lse.permute(0, 2, 1).contiguous()
