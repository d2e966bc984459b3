"""build_forward_batch's positions and cache slots: the host-list path (small steps) and the tensor
path (long prefills) give the same tensors, and a position's slot is its page's slot."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import torch

from dsinfer.engine import forward
from dsinfer.engine.forward import build_forward_batch


def _items(rng: random.Random, count: int, page_size: int) -> tuple[list[Any], list[int], list[int]]:
    items, starts, q_lens = [], [], []
    for key in range(count):
        start, q_len = rng.randrange(0, 300), rng.choice([1, 2, rng.randrange(1, 200)])
        pages = rng.sample(range(1000), -(-(start + q_len) // page_size))
        items.append(SimpleNamespace(seq=SimpleNamespace(pages=pages, key=key), num_draft=0))
        starts.append(start)
        q_lens.append(q_len)
    return items, starts, q_lens


def test_listed_and_tensor_paths_agree() -> None:
    rng, page_size = random.Random(3), 16
    for count in (1, 2, 7, 64):
        items, starts, q_lens = _items(rng, count, page_size)
        table = build_forward_batch(items, starts, q_lens, 0, page_size, torch.device("cpu")).block_tables
        listed = forward._slots_listed(items, starts, q_lens, table, page_size)
        tensor = forward._slots_tensor(items, starts, q_lens, table, page_size)
        for a, b in zip(listed, tensor, strict=True):
            assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b)
        positions, slots = listed
        row = 0
        for item, start, q_len in zip(items, starts, q_lens, strict=True):
            for pos in range(start, start + q_len):
                assert positions[row] == pos
                assert slots[row] == item.seq.pages[pos // page_size] * page_size + pos % page_size
                row += 1
