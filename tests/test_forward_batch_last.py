"""ForwardBatch's view of each sequence's last new token (what the MTP draft layer attends from)."""

from __future__ import annotations

import torch

from dsinfer.model.batch import ForwardBatch


def _batch(q_lens: list[int], kv_lens: list[int], num_absorbed: int) -> ForwardBatch:
    total = sum(q_lens)
    return ForwardBatch(
        positions=torch.arange(100, 100 + total),
        slot_mapping=torch.arange(1000, 1000 + total),
        block_tables=torch.zeros(len(q_lens), 4, dtype=torch.int32),
        q_lens=q_lens,
        kv_lens=kv_lens,
        num_absorbed=num_absorbed,
    )


def test_last_tokens_of_a_decode_step_reuse_its_cached_lengths() -> None:
    batch = _batch([2, 1, 2], [10, 5, 7], num_absorbed=3)
    rows = batch.last_token_indices()
    assert rows.tolist() == [1, 2, 4] and rows.dtype == torch.int64
    tail = batch.last_tokens(rows)
    assert tail.q_lens == [1, 1, 1] and tail.num_absorbed == 3
    assert tail.positions.tolist() == [101, 102, 104] and tail.slot_mapping.tolist() == [1001, 1002, 1004]
    assert tail.cache_seqlens is batch.cache_seqlens and tail.cache_seqlens.tolist() == [10, 5, 7]


def test_last_tokens_of_a_step_with_a_prefill_chunk_count_every_sequence() -> None:
    batch = _batch([4, 2], [4, 9], num_absorbed=1)  # a fresh prompt, then a decode with its draft
    rows = batch.last_token_indices()
    assert rows.tolist() == [3, 5]
    tail = batch.last_tokens(rows)
    assert tail.num_absorbed == 2 and tail.cache_seqlens is not None
    assert tail.cache_seqlens.tolist() == [4, 9] and tail.cache_seqlens.dtype == torch.int32
