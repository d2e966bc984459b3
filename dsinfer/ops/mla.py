"""MLA decode over a paged latent KV cache: torch reference with FlashMLA semantics.

One latent KV head (``[num_blocks, page_size, 1, D]``) is shared by every query head (MQA over the
absorbed latent). K is the whole ``D`` channels (latent + rope), V is its first ``head_dim_v``
channels. Token ``t`` of sequence ``b`` lives in page ``block_table[b, t // page_size]`` at slot
``t % page_size``. With ``causal`` the mask is bottom-right aligned: query ``i`` of ``s_q`` sees
keys ``[0, cache_seqlens[b] - s_q + i]``. ``lse`` is the natural-log log-sum-exp of the scaled
scores, laid out ``[B, h_q, s_q]``. A query row with no visible key gets ``out = 0`` and
``lse = +inf`` (FlashAttention/FlashMLA's convention for empty rows).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["absorb_query", "mla_decode", "mla_decode_absorbed", "mla_decode_absorbed_with", "unabsorb_output"]


def mla_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged MLA decode attention; returns ``(out [B, s_q, h_q, head_dim_v], lse fp32 [B, h_q, s_q])``.

    Vectorised over batch, query tokens, heads and keys: the pages of every sequence are gathered
    with the block table into a padded ``[B, L, D]`` tensor (``L`` = pages of the longest
    sequence x page size) and invalid slots are masked. Computes in fp32; ``out`` has ``q``'s dtype.
    """
    bsz, s_q, h_q, dim = q.shape
    num_blocks, page_size, h_kv, dim_k = k_cache.shape
    if h_kv != 1:
        raise ValueError(f"mla_decode expects one latent KV head, got k_cache shape {tuple(k_cache.shape)}")
    if dim_k != dim:
        raise ValueError(f"q head dim {dim} != k_cache head dim {dim_k}")
    if not 0 < head_dim_v <= dim:
        raise ValueError(f"head_dim_v must be in (0, {dim}], got {head_dim_v}")
    device = q.device
    out_empty = torch.zeros(bsz, s_q, h_q, head_dim_v, dtype=q.dtype, device=device)
    lse_empty = torch.full((bsz, h_q, s_q), float("inf"), dtype=torch.float32, device=device)
    if bsz == 0 or s_q == 0:
        return out_empty, lse_empty
    seqlens = cache_seqlens.to(device=device, dtype=torch.long)
    max_len = int(seqlens.max())
    if max_len <= 0:
        return out_empty, lse_empty
    n_pages = min(-(-max_len // page_size), block_table.shape[1])
    length = n_pages * page_size

    # Gather pages: [B, n_pages] block ids -> [B, L, D]. Unused table entries may hold anything
    # (e.g. -1), so clamp them; their slots are masked below.
    pages = block_table[:, :n_pages].to(device=device, dtype=torch.long).clamp(0, num_blocks - 1)
    kv = k_cache[:, :, 0, :].index_select(0, pages.reshape(-1)).reshape(bsz, length, dim)
    kv = kv.float() if kv.dtype != torch.float32 else kv  # a fresh gather either way: safe to edit in place
    pos = torch.arange(length, device=device)
    key_valid = pos[None, :] < seqlens[:, None]  # [B, L]
    # Zero invalid slots so that garbage (even NaN) in unused cache memory cannot leak into out.
    # Only the invalid rows are written (a sequence's last-page tail and its padding pages).
    kv.view(bsz * length, dim)[(~key_valid).view(-1).nonzero().squeeze(1)] = 0.0

    # [B, s_q * h_q, D] x [B, D, L]: one batched GEMM for all heads and query tokens
    scores = torch.bmm(q.float().reshape(bsz, s_q * h_q, dim), kv.transpose(1, 2)).mul_(softmax_scale)
    scores = scores.view(bsz, s_q, h_q, length)
    visible = key_valid[:, None, :]  # [B, 1 or s_q, L]
    if causal and s_q > 1:
        last = seqlens[:, None] - s_q + torch.arange(s_q, device=device)[None, :]  # [B, s_q]
        visible = visible & (pos[None, None, :] <= last[..., None])
    scores.masked_fill_(~visible[:, :, None, :], float("-inf"))

    lse = torch.logsumexp(scores, dim=-1)  # [B, s_q, h_q]; -inf where nothing is visible
    empty = torch.isneginf(lse)
    probs = scores.sub_(torch.where(empty, 0.0, lse)[..., None]).exp_()
    out = torch.bmm(probs.view(bsz, s_q * h_q, length), kv[..., :head_dim_v]).view(bsz, s_q, h_q, head_dim_v)
    lse = torch.where(empty, float("inf"), lse)
    return out.to(q.dtype), lse.permute(0, 2, 1).contiguous()


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``[T, H, C + rope]``: each head's ``q_nope [T, H, nope]`` folded into the latent by
    ``w_uk [H, nope, C]`` (a batched GEMM in the model's dtype), the rotated ``q_pe`` after it."""
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # thd,hdc->thc
    return torch.cat([q_latent, q_pe], dim=-1)


def unabsorb_output(o_latent: torch.Tensor, w_uv_t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[T, H, v]`` in ``dtype``: each head's latent output ``o_latent [T, H, C]`` unfolded by
    ``w_uv_t [H, C, v]``."""
    tokens, heads, latent = o_latent.shape
    # one copy converts the dtype and puts heads first, the layout bmm takes as it is
    o_heads = torch.empty(heads, tokens, latent, dtype=dtype, device=o_latent.device)
    o_heads.copy_(o_latent.transpose(0, 1))
    return torch.bmm(o_heads, w_uv_t).transpose(0, 1)  # thc,hcv->thv


def mla_decode_absorbed_with(
    decode: Callable[..., tuple[torch.Tensor, torch.Tensor]],
) -> Callable[..., torch.Tensor]:
    """The ``mla_decode_absorbed`` entry point over an implementation of :func:`mla_decode`'s
    contract (this reference, the Triton kernel, FlashMLA's adapter)."""

    def mla_decode_absorbed(
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        w_uk: torch.Tensor,
        w_uv_t: torch.Tensor,
        k_cache: torch.Tensor,
        block_table: torch.Tensor,
        cache_seqlens: torch.Tensor,
        softmax_scale: float,
        causal: bool,
    ) -> torch.Tensor:
        """MLA's absorbed decode, ``out [B, s_q, H, v]`` in ``q_nope``'s dtype: each head's query
        folded into the latent (``q_nope [B, s_q, H, nope]`` times ``w_uk [H, nope, C]``), the
        rotated part ``q_pe [B, s_q, H, rope]`` after it, :func:`mla_decode` over the cache
        (``k_cache [blocks, page, 1, C + rope]``, V = its first C channels), and each head's latent
        output unfolded by ``w_uv_t [H, C, v]``. Here the two folds are batched GEMMs in the
        model's dtype around ``decode``; a fused kernel computes them in fp32 (the results then
        differ by the intermediate roundings)."""
        bsz, s_q, heads, nope = q_nope.shape
        tokens, latent = bsz * s_q, w_uk.shape[-1]
        q = absorb_query(q_nope.reshape(tokens, heads, nope), q_pe.reshape(tokens, heads, -1), w_uk)
        o_latent, _ = decode(
            q.view(bsz, s_q, heads, -1).to(k_cache.dtype),
            k_cache,
            block_table,
            cache_seqlens,
            latent,
            softmax_scale,
            causal,
        )
        out = unabsorb_output(o_latent.reshape(tokens, heads, latent), w_uv_t, q_nope.dtype)
        return out.reshape(bsz, s_q, heads, -1)

    return mla_decode_absorbed


mla_decode_absorbed = mla_decode_absorbed_with(mla_decode)
