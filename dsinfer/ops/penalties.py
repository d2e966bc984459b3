"""Presence, frequency and repetition penalties (vLLM / OpenAI semantics), vectorised over a batch.

Where it plugs in: penalties are a separate step on the raw logits that the engine runs *before*
``ops.sample`` (and after taking logprobs, which are reported from the raw logits as vLLM does)::

    logits = model.compute_logits(hidden)                    # fp32 [B, V]
    lp = top_logprobs(logits, ..., k)                         # only if a row asked for logprobs
    if penalties_active:
        logits = apply_penalties(logits, counts, prompt_mask, presence, frequency, repetition)
    tokens = ops.sample(logits, sampling_tensors)            # greedy rows take the argmax of these
    record_tokens(counts, tokens)                             # the engine keeps counts per row

Keeping it out of :class:`~dsinfer.ops.sampling.SamplingTensors` leaves the sampler's signature
(and any Triton backend of it) unchanged, and lets the engine skip the ``[B, V]`` state entirely
for batches without penalised requests. Everything here is per row and elementwise, so a row's
result does not depend on the batch it is in; rows with neutral values (``presence = frequency =
0``, ``repetition = 1``) come out bit-for-bit unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["apply_penalties", "penalty_state", "record_tokens"]


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Penalised ``logits`` (fp32 ``[B, V]``; the input tensor itself when nothing applies).

    ``output_counts`` (int ``[B, V]``): how often each token occurs in the output generated so
    far; ``prompt_mask`` (bool ``[B, V]``): the token occurs in the prompt; ``presence``,
    ``frequency``, ``repetition``: ``[B]`` per-row penalties.

    1. repetition ``r`` over tokens seen in the prompt or the output: a logit ``< 0`` is
       multiplied by ``r``, any other divided by ``r`` (transformers' rule);
    2. frequency ``f`` over output tokens: ``logit -= f * count``;
    3. presence ``p`` over output tokens: ``logit -= p * (count > 0)``.
    """
    if logits.dim() != 2 or output_counts.shape != logits.shape or prompt_mask.shape != logits.shape:
        raise ValueError(
            f"apply_penalties: logits {tuple(logits.shape)}, output_counts {tuple(output_counts.shape)} "
            f"and prompt_mask {tuple(prompt_mask.shape)} must all be [B, V]"
        )
    x = logits.float()
    rep = repetition.to(x.device, torch.float32)[:, None]
    freq = frequency.to(x.device, torch.float32)[:, None]
    pres = presence.to(x.device, torch.float32)[:, None]
    in_output = output_counts > 0
    rep_on = (rep != 1.0) & (in_output | prompt_mask)
    if bool(rep_on.any()):
        x = torch.where(rep_on, torch.where(x < 0, x * rep, x / rep), x)
    # Only touched positions change: an untouched logit (even -inf) never meets "- 0 * count".
    freq_on = (freq != 0.0) & in_output
    if bool(freq_on.any()):
        x = torch.where(freq_on, x - freq * output_counts.to(torch.float32), x)
    pres_on = (pres != 0.0) & in_output
    if bool(pres_on.any()):
        x = torch.where(pres_on, x - pres, x)
    return x


def _flat_index(rows: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
    """``row * vocab + token`` for every token of every row (CPU int64), range-checked."""
    lengths = [len(r) for r in rows]
    tokens = torch.tensor([t for r in rows for t in r], dtype=torch.int64)
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise ValueError(f"penalty_state: token ids must be in [0, {vocab})")
    row_of = torch.repeat_interleave(
        torch.arange(len(rows), dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64)
    )
    return row_of * vocab + tokens


def penalty_state(
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    vocab: int,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output_counts int32 [B, V], prompt_mask bool [B, V])`` for a batch, on ``device``.

    One ``scatter_add_`` (counts) and one ``index_fill_`` (mask) over the flattened batch; the
    index tensors are built on the CPU and moved once.
    """
    if len(prompts) != len(outputs):
        raise ValueError(f"penalty_state: {len(prompts)} prompts but {len(outputs)} outputs")
    batch = len(prompts)
    out_index = _flat_index(outputs, vocab).to(device)
    counts = torch.zeros(batch * vocab, dtype=torch.int32, device=device)
    counts.scatter_add_(0, out_index, torch.ones_like(out_index, dtype=torch.int32))
    mask = torch.zeros(batch * vocab, dtype=torch.bool, device=device)
    mask.index_fill_(0, _flat_index(prompts, vocab).to(device), True)
    return counts.view(batch, vocab), mask.view(batch, vocab)


def record_tokens(output_counts: torch.Tensor, tokens: torch.Tensor) -> None:
    """Count one new output token per row in place: ``output_counts[b, tokens[b]] += 1``."""
    output_counts.scatter_add_(
        1, tokens.to(output_counts.device, torch.int64)[:, None], torch.ones_like(output_counts[:, :1])
    )
