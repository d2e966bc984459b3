"""DeepSeek-V4's KV pool: pages of compressed entries and indexer keys, and each running
sequence's bounded rest.

A page stands for ``page_size`` tokens (256: a multiple of both compression rates) and holds, per
compressing layer, those tokens' compressed entries (CSA: and indexer keys): the groups that grow
with a sequence (dsinfer/base/kv_groups.py; dsinfer/model/v4_paged.py lays them out). What stays
bounded whatever a sequence's length, the window's last ``sliding_window - 1`` raw rows of every
layer and the compressors' unfinished rows, is the sequence's own state; the engine sets that aside
for ``max_num_seqs`` sequences, and as many prefix-cache resume points (dsinfer/model/v4_paged.py),
before it counts pages, and drops the states of sequences that stop running. The scheduler admits,
grows and preempts by pages as for V3, and shares cached pages between sequences. A page's record
(what the disk tier stores, ``read_page``/``write_page``) is its compressed groups and its resume
point, so a page read back after a restart can end a prefix hit. Pages are not registered with a
transfer library (no PD) yet.
"""

from __future__ import annotations

import struct

import torch

from dsinfer.base.kv_groups import V4_PAGE_TOKENS, HybridCacheSpec
from dsinfer.base.v4_config import V4Config
from dsinfer.cache.kv_pool import PageAllocator, PagePool
from dsinfer.model.v4_paged import SequenceStates

_TAIL = struct.Struct("<q?")  # a record's resume point: its position, whether there is one


class V4StatePool(PagePool):
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
        self.page_bytes = self.page_bytes_for(config, dtype)
        # a page's record: its groups, then room for a resume point (zero parts give the shapes)
        self._resume_blank = self.caches.resume_shapes()
        groups = [t[0] for t in self.caches.tensors()]
        self._resume_bytes = sum(t.nbytes for t in self._resume_blank)
        self.page_record_bytes = sum(t.nbytes for t in groups) + self._resume_bytes + _TAIL.size
        shapes = ", ".join(f"{tuple(t.shape)}" for t in groups + self._resume_blank)
        self.page_record_layout = f"{self.page_layout}; record {shapes} x {dtype} + resume point"

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
    def page_layout(self) -> str:
        groups = ", ".join(
            f"{g.name}:{len(g.layers)}x{g.width}/{g.tokens_per_entry}" for g in self.spec.groups
        )
        return f"V4 hybrid, page {self.page_size}: {groups}"

    @property
    def device(self) -> torch.device:
        return self._device

    def describe(self) -> str:
        return self.page_layout

    # A page as a record (what the disk and host tiers store) -------------------------------------
    # page_record_bytes: its compressed groups, then room for its resume point (the window's rows
    # and CSA's overlap rows at its end), then the point's position and a presence byte
    def read_page(self, page: int, device: str | torch.device = "cpu") -> torch.Tensor:
        """A copy of ``page``'s record, uint8 ``[page_record_bytes]`` (no resume point: zeros)."""
        out = torch.zeros(self.page_record_bytes, dtype=torch.uint8, device=device)
        point = self.caches.resume_point(page)
        parts = [t[page] for t in self.caches.tensors()]
        if point is not None:
            parts += [*point.windows, *(t for pair in point.overlaps.values() for t in pair)]
        offset = 0
        for part in parts:
            raw = part.contiguous().view(torch.uint8).reshape(-1)
            out[offset : offset + raw.numel()].copy_(raw)
            offset += raw.numel()
        tail = _TAIL.pack(point.position if point is not None else 0, point is not None)
        out[self.page_record_bytes - _TAIL.size :] = torch.tensor(list(tail), dtype=torch.uint8)
        return out

    def write_page(self, page: int, data: torch.Tensor) -> None:
        """Install a record ``read_page`` made: the groups into ``page``, its resume point if any."""
        if data.dtype != torch.uint8 or tuple(data.shape) != (self.page_record_bytes,):
            raise ValueError(
                f"page record is {data.dtype} {tuple(data.shape)}, expected uint8 ({self.page_record_bytes},)"
            )
        offset = 0
        for tensor in self.caches.tensors():
            target = tensor[page].view(torch.uint8)
            target.copy_(data[offset : offset + target.numel()].view(target.shape))
            offset += target.numel()
        resume = []
        for like in self._resume_blank:
            raw = data[offset : offset + like.nbytes].clone()
            resume.append(raw.view(like.dtype).view(like.shape).to(self._device))
            offset += like.nbytes
        position, present = _TAIL.unpack(bytes(data[offset:].tolist()))
        self.caches.forget([page])
        if present:
            self.caches.install(page, self.caches.boundary_from(position, resume))

    def layer_tensors(self) -> list[tuple[torch.Tensor, ...]]:
        raise RuntimeError("DeepSeek-V4's cache is not paged by layer yet: no KV transfer (PD) for it")
