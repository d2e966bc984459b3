"""DeepSeek-V4's KV pool, as served today: pages for admission, each sequence's hybrid cache held
whole beside them.

A page stands for ``page_size`` tokens (256: a multiple of both compression rates). What a
sequence's cache holds grows with its tokens only in the compressed groups (CSA's and HCA's
entries, CSA's indexer keys): a page is charged those groups' bytes for its tokens. The rest is
bounded per sequence whatever its length: the window's last ``sliding_window - 1`` raw rows of
every layer and the compressors' unfinished rows (dsinfer/base/kv_groups.py). The engine sets
that aside for ``max_num_seqs`` sequences before it counts pages, so the scheduler, which admits,
grows and preempts by pages as for V3, keeps what the sequences hold within the budget.

The tensors themselves are each sequence's ``SequenceState`` (dsinfer/model/v4_state.py), kept in
``caches`` under the sequence's first page and dropped when that page returns to the free list:
finished, aborted and preempted sequences leave nothing. Nothing here is shared between sequences
(no prefix cache), read page by page (no disk tier) or registered with a transfer library (no PD)
yet.
"""

from __future__ import annotations

import torch

from dsinfer.base.kv_groups import V4_PAGE_TOKENS, HybridCacheSpec
from dsinfer.base.v4_config import V4Config
from dsinfer.cache.kv_pool import PageAllocator
from dsinfer.model.v4_state import SequenceStates


class _DroppingAllocator(PageAllocator):
    def __init__(self, num_pages: int, states: SequenceStates) -> None:
        super().__init__(num_pages)
        self._states = states

    def free(self, pages: list[int]) -> None:
        super().free(pages)
        self._states.drop(pages)


class V4StatePool:
    def __init__(
        self, config: V4Config, num_pages: int, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.spec = self.spec_for(config, dtype)
        self.page_size = self.spec.page_tokens
        self._device = torch.device(device)
        self.caches = SequenceStates(config, dtype, self._device)
        self.allocator: PageAllocator = _DroppingAllocator(num_pages, self.caches)
        self.num_layers = config.num_hidden_layers

    @staticmethod
    def spec_for(config: V4Config, dtype: torch.dtype) -> HybridCacheSpec:
        return HybridCacheSpec.for_v4(config, str(dtype).removeprefix("torch."), V4_PAGE_TOKENS)

    @classmethod
    def page_bytes_for(cls, config: V4Config, dtype: torch.dtype) -> int:
        """What one page is charged: its tokens' compressed entries and indexer keys."""
        spec = cls.spec_for(config, dtype)
        return sum(spec.page_bytes(g) for g in spec.groups if g.name != "window")

    @classmethod
    def sequence_bytes_for(cls, config: V4Config, dtype: torch.dtype) -> int:
        """What one sequence holds at most whatever its length: the window's rows of every layer
        and the compressors' unfinished rows."""
        spec = cls.spec_for(config, dtype)
        window = spec.group("window")
        assert window is not None
        return spec.window * len(window.layers) * window.entry_bytes + spec.state_bytes

    @property
    def page_bytes(self) -> int:
        return sum(self.spec.page_bytes(g) for g in self.spec.groups if g.name != "window")

    @property
    def page_layout(self) -> str:
        groups = ", ".join(
            f"{g.name}:{len(g.layers)}x{g.width}/{g.tokens_per_entry}" for g in self.spec.groups
        )
        return f"V4 hybrid, page {self.page_size}: {groups}"

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_usable_pages(self) -> int:
        return self.allocator.num_usable

    @property
    def device(self) -> torch.device:
        return self._device

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def describe(self) -> str:
        return self.page_layout

    def layer_tensors(self) -> list[tuple[torch.Tensor, ...]]:
        raise RuntimeError("DeepSeek-V4's cache is not paged by layer yet: no KV transfer (PD) for it")
