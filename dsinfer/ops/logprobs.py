"""Logprobs for the OpenAI ``logprobs`` / vLLM ``prompt_logprobs`` options.

Both come from the log-softmax of the RAW logits (before penalties, temperature and filters),
which is what vLLM returns by default and what ``torch.log_softmax`` of a transformers model's
logits gives. A batch whose rows asked for different ``k`` is computed once with the largest ``k``
and each row keeps its first ``k`` columns (the top-k are sorted, best first).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["PROMPT_CHUNK", "TokenLogprobs", "prompt_logprobs", "token_ranks", "top_logprobs"]

PROMPT_CHUNK = 512  # prompt positions per log-softmax (bounds the fp32 [T, V] temporary)


class TokenLogprobs(NamedTuple):
    """Per row: the chosen token's logprob and the ``k`` most likely tokens with theirs."""

    token_logprob: torch.Tensor  # f32 [B]
    top_ids: torch.Tensor  # int64 [B, k], best first
    top_logprobs: torch.Tensor  # f32 [B, k]


def _check(logits: torch.Tensor, ids: torch.Tensor, k: int) -> int:
    if logits.dim() != 2 or ids.shape != logits.shape[:1]:
        raise ValueError(
            f"logprobs: logits {tuple(logits.shape)} must be [B, V] and ids {tuple(ids.shape)} [B]"
        )
    if k < 0:
        raise ValueError(f"logprobs: k must be >= 0, got {k}")
    return min(k, logits.shape[1])


def _from_logprobs(logprobs: torch.Tensor, ids: torch.Tensor, k: int) -> TokenLogprobs:
    chosen = logprobs.gather(1, ids.to(logprobs.device, torch.int64)[:, None]).squeeze(1)
    if k == 0:
        rows = logprobs.shape[0]
        return TokenLogprobs(
            chosen,
            torch.empty(rows, 0, dtype=torch.int64, device=logprobs.device),
            logprobs.new_empty(rows, 0),
        )
    values, indices = logprobs.topk(k, dim=-1, sorted=True)
    return TokenLogprobs(chosen, indices, values)


def top_logprobs(logits: torch.Tensor, sampled: torch.Tensor, k: int) -> TokenLogprobs:
    """``(sampled_logprob [B], top_ids [B, k], top_logprobs [B, k])`` of fp32 ``logits [B, V]``.

    ``k`` may be 0 (empty ``[B, 0]`` tensors) and is capped at the vocabulary size.
    """
    k = _check(logits, sampled, k)
    return _from_logprobs(torch.log_softmax(logits.float(), dim=-1), sampled, k)


def prompt_logprobs(logits: torch.Tensor, next_ids: torch.Tensor, k: int) -> TokenLogprobs:
    """The same for prompt positions: ``logits [T, V]`` at positions ``0..T-1`` scored against
    ``next_ids [T]``, the prompt token that actually follows each (so a prompt of length L gives
    ``logits[:L-1]`` and ``prompt[1:]``; the first prompt token has no logprob).

    Computed in chunks of :data:`PROMPT_CHUNK` positions so a long prompt never materialises a
    second full ``[T, V]`` tensor.
    """
    k = _check(logits, next_ids, k)
    parts = [
        _from_logprobs(
            torch.log_softmax(logits[s : s + PROMPT_CHUNK].float(), dim=-1), next_ids[s : s + PROMPT_CHUNK], k
        )
        for s in range(0, logits.shape[0], PROMPT_CHUNK)
    ]
    if not parts:
        return _from_logprobs(logits.float().new_empty(0, logits.shape[1]), next_ids, k)
    return TokenLogprobs(*(torch.cat(cols) for cols in zip(*parts, strict=True)))


def token_ranks(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """1-based rank of ``ids [B]`` in each row of ``logits [B, V]`` (1 = most likely; ties share the
    better rank), as vLLM reports beside a sampled token's logprob."""
    x = logits.float()
    chosen = x.gather(1, ids.to(x.device, torch.int64)[:, None])
    return (x > chosen).sum(dim=-1) + 1
