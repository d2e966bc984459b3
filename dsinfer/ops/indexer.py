"""DeepSeek-V3.2's lightning indexer over the paged key cache: logits and top-k (torch reference).

For query token ``j`` of sequence ``b`` and a cached key ``t`` it sees, the logit is

    logit[b, j, t] = sum_h weights[b, j, h] * relu(q[b, j, h] . k[t])

(DeepGEMM's weighted-ReLU MQA logits; DeepSeek folds the softmax scale, ``n_heads ** -0.5`` and
an FP8 query's scale into ``weights``). Keys live in a paged cache like the latent: token ``t`` of
sequence ``b`` is slot ``t % page_size`` of page ``block_table[b, t // page_size]``. Query ``j``
of ``s_q`` sees keys ``0 .. cache_seqlens[b] - s_q + j`` (bottom-right causal: a prefill chunk and
a decode step alike). ``indexer_topk`` returns, per query, the positions (token indices in the
sequence) of its ``topk`` highest logits (at most as many as the block table has slots), ``-1``
where fewer keys are visible; ``positions_to_slots``
turns them into the flat cache slots FlashMLA's sparse kernels take.

The key cache is either plain (``[pages, page_size, D]``, any float dtype) or FP8 as DeepSeek's
release keeps it (``uint8 [pages, page_size, D + 4]``): within a page, the ``page_size * D`` e4m3
key bytes of its tokens, then their ``page_size`` fp32 scales (DeepGEMM's paged layout). Keys and
queries are rotated by a normalised Hadamard transform before FP8 quantisation (which preserves
dot products and spreads outliers over the channels).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsinfer.ops.fp8 import AMAX_MIN, FP8_DTYPE, FP8_MAX

__all__ = [
    "dequantize_key_cache",
    "hadamard",
    "indexer_logits",
    "indexer_topk",
    "indexer_topk_with",
    "positions_to_slots",
    "quantize_per_row",
    "select_topk",
    "visible_keys",
    "write_keys",
]

SCALE_BYTES = 4


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """``x @ H / sqrt(n)`` over the last dimension (n a power of two): orthonormal, so dot products
    are unchanged. The fast Walsh-Hadamard butterfly, in fp32."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"the Hadamard transform needs a power-of-two width, got {n}")
    y = x.float().reshape(-1, n)
    h = 1
    while h < n:
        pairs = y.view(-1, n // (2 * h), 2, h)
        y = torch.cat((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=-1).view(-1, n)
        h *= 2
    return (y * n**-0.5).view(x.shape)


def quantize_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 with one fp32 scale per row of the last dimension: ``x ~= q * scale[..., None]``."""
    scale = x.float().abs().amax(dim=-1).clamp_min(AMAX_MIN) / FP8_MAX
    return (x.float() / scale.unsqueeze(-1)).to(FP8_DTYPE), scale


def _fp8_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys uint8 [P, ps, D], scales fp32 [P, ps]) views of an FP8 key cache."""
    pages, page_size, width = cache.shape
    dim = width - SCALE_BYTES
    flat = cache.view(pages, page_size * width)
    keys = flat[:, : page_size * dim].view(pages, page_size, dim)
    scales = flat[:, page_size * dim :].view(torch.float32)
    return keys, scales


def write_keys(cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor) -> None:
    """Store ``keys [T, D]`` at flat ``slots [T]``: as they are in a plain cache, rotated and
    quantised (the caller rotated them) in an FP8 one."""
    if cache.dtype != torch.uint8:
        cache.view(-1, cache.shape[-1])[slots] = keys.to(cache.dtype)
        return
    q, scale = quantize_per_row(keys)
    page_size = cache.shape[1]
    values, scales = _fp8_views(cache)
    pages, offsets = slots // page_size, slots % page_size
    values[pages, offsets] = q.view(torch.uint8)
    scales[pages, offsets] = scale


def dequantize_key_cache(cache: torch.Tensor) -> torch.Tensor:
    """Plain keys of a whole cache, float32 ``[P, ps, D]`` (a plain cache is only upcast)."""
    if cache.dtype != torch.uint8:
        return cache.float()
    values, scales = _fp8_views(cache)
    return values.view(FP8_DTYPE).float() * scales.unsqueeze(-1)


def _gather_keys(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """Float32 keys of ``pages [B, n]``, ``[B, n * page_size, D]``."""
    bsz, n = pages.shape
    picked = cache.index_select(0, pages.reshape(-1))
    keys = dequantize_key_cache(picked)
    return keys.view(bsz, n * cache.shape[1], keys.shape[-1])


def visible_keys(cache_seqlens: torch.Tensor, s_q: int, length: int) -> torch.Tensor:
    """bool ``[B, s_q, length]``: key ``t`` is visible to query ``j`` (bottom-right causal)."""
    device = cache_seqlens.device
    last = cache_seqlens.long()[:, None] - s_q + torch.arange(s_q, device=device)[None, :]
    return torch.arange(length, device=device)[None, None, :] <= last[..., None]


def indexer_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
) -> torch.Tensor:
    """fp32 ``[B, s_q, L]`` with ``L = block_table.shape[1] * page_size``; ``-inf`` where a key
    is not visible. ``q [B, s_q, H, D]`` (float or e4m3), ``weights [B, s_q, H]``."""
    bsz, s_q, heads, dim = q.shape
    pages = block_table.long().clamp(0, k_cache.shape[0] - 1)
    keys = _gather_keys(k_cache, pages)  # [B, L, D]
    length = keys.shape[1]
    scores = torch.bmm(q.float().reshape(bsz, s_q * heads, dim), keys.transpose(1, 2))
    scores = scores.view(bsz, s_q, heads, length).relu_()
    logits = torch.einsum("bsh,bshl->bsl", weights.float(), scores)
    return logits.masked_fill_(~visible_keys(cache_seqlens, s_q, length), float("-inf"))


def select_topk(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """int32 ``[B, s_q, min(topk, L)]``: positions of the ``topk`` highest finite logits of each
    row, best first, ``-1`` past the visible keys. The width depends only on the logits' shape
    (the block table's), never on the lengths: graph-safe."""
    values, positions = logits.topk(min(topk, logits.shape[-1]), dim=-1)
    return torch.where(torch.isfinite(values), positions, -1).to(torch.int32)


def indexer_topk_with(logits: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The ``indexer_topk`` entry point over a logits implementation with ``indexer_logits``'s
    signature (this reference, the Triton kernel)."""

    def indexer_topk(
        q: torch.Tensor,
        weights: torch.Tensor,
        k_cache: torch.Tensor,
        block_table: torch.Tensor,
        cache_seqlens: torch.Tensor,
        topk: int,
    ) -> torch.Tensor:
        """Positions ``int32 [B, s_q, min(topk, L)]`` of each query's keys (see the module doc)."""
        if q.dim() != 4 or weights.shape != q.shape[:3]:
            raise ValueError(
                f"q must be [B, s_q, H, D] and weights [B, s_q, H], got {tuple(q.shape)}, {tuple(weights.shape)}"
            )
        if topk <= 0:
            raise ValueError(f"topk must be positive, got {topk}")
        return select_topk(logits(q, weights, k_cache, block_table, cache_seqlens), topk)

    return indexer_topk


indexer_topk = indexer_topk_with(indexer_logits)


def positions_to_slots(positions: torch.Tensor, block_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """Flat cache slots ``page * page_size + offset`` of ``positions [B, s_q, k]`` (``-1`` kept)."""
    bsz = positions.shape[0]
    pos = positions.long().clamp(min=0)
    pages = block_table.long().gather(1, (pos // page_size).view(bsz, -1)).view_as(pos)
    slots = pages * page_size + pos % page_size
    return torch.where(positions >= 0, slots, -1).to(torch.int32)
