"""Token bitmasks: one bit per vocabulary entry, 32 to an int32 word (llguidance's and xgrammar's
layout: token ``t`` is bit ``t % 32`` of word ``t // 32``, set = allowed)."""

from __future__ import annotations

import sys

import torch

__all__ = ["apply_token_bitmask", "bitmask_words"]

# Read as little-endian bytes, token t is bit t % 8 of byte t // 8: one table lookup per byte
# unpacks a mask (a shift per bit and a masked scatter cost several times more on CPU).
assert sys.byteorder == "little", "token bitmasks are unpacked as little-endian bytes"
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()  # [256, 8]


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """``logits [B, V]`` with disallowed tokens at -inf; ``bitmask [R, W]`` (int32, any device)
    holds the masks of ``rows`` in order (all B rows when ``rows`` is None). Returns a new tensor."""
    vocab = logits.shape[-1]
    as_bytes = bitmask.contiguous().view(torch.uint8).to(logits.device)
    allowed = _BYTE_BITS.to(logits.device)[as_bytes.long()].reshape(as_bytes.shape[0], -1)[:, :vocab]
    if rows is not None:
        full = torch.ones(logits.shape, dtype=torch.bool, device=logits.device)
        full[rows] = allowed
        allowed = full
    return torch.where(allowed, logits, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
