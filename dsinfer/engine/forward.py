"""Scheduled sequences -> the ForwardBatch the model reads (positions, cache slots, block tables),
and the split of a step into two micro-batches of even attention load."""

from __future__ import annotations

import torch

from dsinfer.engine.scheduler import ScheduledSeq
from dsinfer.model.batch import ForwardBatch

# up to this many tokens a step's positions and slots are computed on host lists (a decode step:
# a dozen small tensor operations cost more); longer prefills use tensor operations
LISTED_TOKENS = 256


def build_forward_batch(
    items: list[ScheduledSeq],
    starts: list[int],
    q_lens: list[int],
    num_absorbed: int,
    page_size: int,
    device: torch.device,
) -> ForwardBatch:
    """Sequence i computes positions [starts[i], starts[i] + q_lens[i]) over its pages."""
    width = max(len(item.seq.pages) for item in items)
    table = torch.tensor(
        [item.seq.pages + [0] * (width - len(item.seq.pages)) for item in items], dtype=torch.int32
    )
    positions, slots = (_slots_listed if sum(q_lens) <= LISTED_TOKENS else _slots_tensor)(
        items, starts, q_lens, table, page_size
    )
    return ForwardBatch(
        positions=positions.to(device),
        slot_mapping=slots.to(device),
        block_tables=table.to(device),
        q_lens=list(q_lens),
        kv_lens=[start + q for start, q in zip(starts, q_lens, strict=True)],
        num_absorbed=num_absorbed,
        seq_keys=[item.seq.key for item in items],
        drafts=[item.num_draft for item in items],
    )


def _slots_listed(
    items: list[ScheduledSeq], starts: list[int], q_lens: list[int], table: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    positions: list[int] = []
    slots: list[int] = []
    for item, start, q_len in zip(items, starts, q_lens, strict=True):
        pages = item.seq.pages
        for pos in range(start, start + q_len):
            positions.append(pos)
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
    return torch.tensor(positions, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64)


def _slots_tensor(
    items: list[ScheduledSeq], starts: list[int], q_lens: list[int], table: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.tensor(q_lens)
    seq = torch.repeat_interleave(torch.arange(len(items)), lens)
    first = torch.repeat_interleave(torch.tensor(starts) - (lens.cumsum(0) - lens), lens)
    positions = first + torch.arange(len(seq))  # the step's tokens in order: position of each
    return positions, table[seq, positions // page_size].long() * page_size + positions % page_size


def attention_load(item: ScheduledSeq) -> int:
    """New tokens x context: what one sequence's step costs attention."""
    return item.num_new * item.end


def balanced_split(loads: list[int]) -> int:
    """The k in [1, n) for which ``loads[:k]`` and ``loads[k:]`` are the most even (n >= 2).

    Whole sequences stay in one micro-batch and the order is kept (prefill chunks, then decodes),
    so the two micro-batches' outputs concatenate back into the step's token order."""
    if len(loads) < 2:
        raise ValueError("a split needs at least two sequences")
    total, before = sum(loads), 0
    best, best_k = None, 1
    for k in range(1, len(loads)):
        before += loads[k - 1]
        gap = abs(total - 2 * before)
        if best is None or gap < best:
            best, best_k = gap, k
    return best_k
