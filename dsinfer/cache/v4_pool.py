"""DeepSeek-V4's KV pool: pages of compressed entries and indexer keys, and each running
sequence's bounded rest.

A page stands for ``page_size`` tokens (256: a multiple of both compression rates) and holds, per
compressing layer, those tokens' compressed entries (CSA: and indexer keys): the groups that grow
with a sequence (dsinfer/base/kv_groups.py; dsinfer/model/v4_paged.py lays them out). What stays
bounded whatever a sequence's length, the window's last ``sliding_window - 1`` raw rows of every
layer and the compressors' unfinished rows, is the sequence's own state; the engine sets that aside
for ``max_num_seqs`` sequences, and as many prefix-cache resume points (dsinfer/model/v4_paged.py),
before it counts pages, and drops the states of sequences that stop running. The scheduler admits,
grows and preempts by pages as for V3, and shares cached pages between sequences. Pages are not
read one by one (no disk tier) or registered with a transfer library (no PD) yet.
"""

from __future__ import annotations

import torch

from dsinfer.base.kv_groups import V4_PAGE_TOKENS, HybridCacheSpec
from dsinfer.base.v4_config import V4Config
from dsinfer.cache.kv_pool import PageAllocator
from dsinfer.model.v4_paged import SequenceStates


class V4StatePool:
    def __init__(
        self,
        config: V4Config,
        num_pages: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        max_resume_points: int = 0,
    ) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.spec = self.spec_for(config, dtype)
        self.page_size = self.spec.page_tokens
        self._device = torch.device(device)
        self.caches = SequenceStates(
            config, num_pages, self.page_size, dtype, self._device, max_resume_points
        )
        self.allocator = PageAllocator(num_pages)
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

    @classmethod
    def reserve_bytes_for(cls, config: V4Config, dtype: torch.dtype, max_num_seqs: int) -> int:
        """Set aside before pages: ``max_num_seqs`` sequences' bounded part and as many resume
        points (each at most a window and the compressors' overlap rows)."""
        return 2 * max_num_seqs * cls.sequence_bytes_for(config, dtype)

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
