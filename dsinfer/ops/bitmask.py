"""Token bitmasks: one bit per vocabulary entry, 32 to an int32 word (llguidance's and xgrammar's
layout: token ``t`` is bit ``t % 32`` of word ``t // 32``, set = allowed)."""

from __future__ import annotations

import torch

__all__ = ["apply_token_bitmask", "bitmask_words"]


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``logits [B, V]`` with the disallowed tokens of ``rows`` at -inf; ``bitmask [len(rows), W]``
    (int32, any device) holds those rows' masks in order. Returns a new tensor."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask.to(logits.device)[:, :, None] >> shifts) & 1  # [R, W, 32]
    allowed = bits.reshape(bits.shape[0], -1)[:, :vocab].bool()
    out = logits.clone()
    out[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return out
