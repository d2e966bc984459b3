"""Scheduled sequences -> the ForwardBatch the model reads (positions, cache slots, block tables),
and the split of a step into two micro-batches of even attention load."""

from __future__ import annotations

import torch

from dsinfer.engine.scheduler import ScheduledSeq
from dsinfer.model.batch import ForwardBatch


def build_forward_batch(
    items: list[ScheduledSeq],
    starts: list[int],
    q_lens: list[int],
    num_absorbed: int,
    page_size: int,
    device: torch.device,
) -> ForwardBatch:
    """Sequence i computes positions [starts[i], starts[i] + q_lens[i]) over its pages."""
    positions: list[int] = []
    slots: list[int] = []
    for item, start, q_len in zip(items, starts, q_lens, strict=True):
        pages = item.seq.pages
        positions.extend(range(start, start + q_len))
        slots.extend(pages[p // page_size] * page_size + p % page_size for p in range(start, start + q_len))
    width = max(len(item.seq.pages) for item in items)
    table = torch.tensor(
        [item.seq.pages + [0] * (width - len(item.seq.pages)) for item in items], dtype=torch.int32
    )
    return ForwardBatch(
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=table.to(device),
        q_lens=list(q_lens),
        kv_lens=[start + q for start, q in zip(starts, q_lens, strict=True)],
        num_absorbed=num_absorbed,
        seq_keys=[item.seq.key for item in items],
    )


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
