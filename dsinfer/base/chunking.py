"""Attention-aware prefill chunking: the rule shared by the engine's scheduler and the simulator.

A step's token budget is counted in new-token equivalents of the attention stage: a chunk of
prompt tokens ``[start, start + num_new)`` costs its tokens (their projections), its causal
query-key pairs over ``attention_token_weight`` (the pairs that cost as much as one token's
projections) and the decompression of the ``start`` tokens already in the cache
(``context_token_weight`` each). A continuation over a long cached context then gets a short
chunk, so on a lockstep data-parallel pool no rank's step is stretched by one long context.
"""

from __future__ import annotations

import math


def prefill_chunk_cost(
    start: int, num_new: int, attention_token_weight: float, context_token_weight: float
) -> float:
    """New-token equivalents of computing prompt tokens ``[start, start + num_new)``: the tokens, their
    causal query-key pairs over ``attention_token_weight``, the ``start`` cached tokens' decompression."""
    pairs = num_new * start + num_new * (num_new + 1) / 2
    return num_new + pairs / attention_token_weight + start * context_token_weight


def fit_prefill_chunk(
    start: int,
    remaining: int,
    budget: float,
    attention_token_weight: float,
    context_token_weight: float,
    first: bool,
) -> int:
    """The most tokens (<= ``remaining``) of a prompt at ``start`` whose chunk cost fits ``budget``.
    The step's first chunk always makes progress: if its context decompression alone leaves no room,
    that fixed part is let through (the step overshoots by it), and it gets at least one token."""
    w, fixed = attention_token_weight, start * context_token_weight

    def fit(room: float) -> int:
        if room <= 0:
            return 0
        b = 1.0 + (start + 0.5) / w  # the root of n^2 / (2 w) + b n = room, cancellation-free
        n = min(remaining, int(2.0 * room / (b + math.sqrt(b * b + 2.0 * room / w))))
        while n < remaining and prefill_chunk_cost(start, n + 1, w, 0.0) <= room:
            n += 1
        while n > 0 and prefill_chunk_cost(start, n, w, 0.0) > room:
            n -= 1
        return n

    n = fit(budget - fixed)
    if n == 0 and first:
        n = max(1, fit(budget))
    return min(n, remaining)
