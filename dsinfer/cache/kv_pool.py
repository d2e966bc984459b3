"""The paged KV cache: per layer, one tensor per cache of the layer's spec (dsinfer/base/kv_spec.py),
each ``[num_pages, page_size, width]``: MLA's latent (``kv_lora_rank + qk_rope_head_dim`` values,
FlashMLA's layout once a view adds its single KV-head axis) and, for V3.2, the indexer keys.

Page p of every layer and every cache belongs to the same sequence; a sequence's pages are listed
in its block table. A page as a whole (what the prefix cache's disk tier stores) is the bytes of
page p of every layer's caches, layer after layer, each layer's caches in spec order.

A page may be reserved for good (``PagedKVPool.reserve_dummy_page``): the allocator never hands it
out again and it belongs to no sequence. Padding rows of a CUDA-graph decode step write their
latent and indexer key there and attend to it (dsinfer/engine/cuda_graph.py).
"""

from __future__ import annotations

import torch

from dsinfer.base.config import PAGE_SIZE, ModelConfig
from dsinfer.base.kv_spec import IndexerFormat, KVCacheSpec
from dsinfer.model.batch import LayerCache


class OutOfPagesError(RuntimeError):
    """Not enough free pages for an allocation."""


class PageAllocator:
    """Free list of page ids. References (a prefix page shared by several sequences) are counted
    by the KV cache manager, which frees a page here once nobody holds it."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._allocated = [False] * num_pages
        self.reserved: list[int] = []  # taken for good, never allocated nor freed

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        """Pages sequences can ever hold: all but the reserved ones."""
        return self.num_pages - len(self.reserved)

    def reserve(self) -> int:
        """Take one free page out of circulation for good; OutOfPagesError when none is free."""
        if not self._free:
            raise OutOfPagesError(f"no free page to reserve of {self.num_pages}")
        page = self._free.pop()
        self.reserved.append(page)
        return page

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"{n} pages requested, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._allocated[p] = True
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p in self.reserved:
                raise ValueError(f"page {p} is reserved and cannot be freed")
            if not self._allocated[p]:
                raise ValueError(f"page {p} freed twice")
            self._allocated[p] = False
            self._free.append(p)


class PagePool:
    """What every KV pool shares: pages of ``page_size`` tokens handed out by ``allocator``."""

    allocator: PageAllocator
    page_size: int
    sends_partial_pages = True  # PD: a prompt's last partial page travels with its whole ones
    # write_page may run on another thread for a page no sequence holds (tensor copies only)
    page_writes_off_thread = False

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_usable_pages(self) -> int:
        """Pages sequences can hold (a reserved page, like CUDA graphs' dummy, is not one of them)."""
        return self.allocator.num_usable

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


class PagedKVPool(PagePool):
    page_writes_off_thread = True

    def __init__(
        self, num_layers: int, num_pages: int, spec: KVCacheSpec, *, device: str | torch.device = "cpu"
    ) -> None:
        if num_layers <= 0 or num_pages <= 0:
            raise ValueError(f"num_layers and num_pages must be positive, got {num_layers}, {num_pages}")
        self.spec, self.page_size = spec, spec.page_size
        self.caches = [
            LayerCache(
                **{
                    c.name: torch.zeros(
                        num_pages, spec.page_size, c.width, dtype=getattr(torch, c.dtype), device=device
                    )
                    for c in spec.components
                }
            )
            for _ in range(num_layers)
        ]
        self.allocator = PageAllocator(num_pages)
        self._dummy_page: int | None = None

    def reserve_dummy_page(self) -> int:
        """The page no sequence owns, reserved on the first call (idempotent): padding rows of a
        CUDA-graph decode step write and read only there. Call it before sequences hold pages."""
        if self._dummy_page is None:
            self._dummy_page = self.allocator.reserve()
        return self._dummy_page

    @property
    def dummy_page(self) -> int | None:
        return self._dummy_page

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        num_layers: int,
        num_pages: int,
        dtype: torch.dtype,
        device: str | torch.device,
        indexer: IndexerFormat = "model",
        page_size: int = PAGE_SIZE,
    ) -> PagedKVPool:
        spec = KVCacheSpec.for_model(config, str(dtype).removeprefix("torch."), indexer, page_size)
        return cls(num_layers, num_pages, spec, device=device)

    @staticmethod
    def page_bytes_for(spec: KVCacheSpec, num_layers: int) -> int:
        """Bytes one page takes over all ``num_layers`` layers and every cache of the spec."""
        return num_layers * spec.page_bytes

    @classmethod
    def num_pages_for_budget(cls, spec: KVCacheSpec, num_layers: int, budget_bytes: int) -> int:
        """How many pages fit in ``budget_bytes`` (rounded down; 0 when not even one fits)."""
        if budget_bytes < 0:
            raise ValueError(f"memory budget must be >= 0 bytes, got {budget_bytes}")
        return budget_bytes // cls.page_bytes_for(spec, num_layers)

    # Shape and whole-page access -------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.caches)

    @property
    def device(self) -> torch.device:
        return self.caches[0].latent.device

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every layer and cache."""
        return self.page_bytes_for(self.spec, self.num_layers)

    @property
    def page_layout(self) -> str:
        """What a page's bytes are: two pools exchange pages only when their layouts are equal."""
        return f"{self.num_layers} layers x {self.spec.signature()}"

    @property
    def page_record_bytes(self) -> int:
        """Bytes of a page's record (``read_page``): its bytes in every layer and cache."""
        return self.page_bytes

    @property
    def page_record_layout(self) -> str:
        return self.page_layout

    def layer_tensors(self) -> list[tuple[torch.Tensor, ...]]:
        """Every layer's cache tensors, in spec order (what a KV transfer registers)."""
        return [layer.tensors() for layer in self.caches]

    def transfer_page_groups(self) -> list[dict[str, int]]:
        """Bytes of one page per registered layer, by cache (the latent; V3.2's indexer keys)."""
        page = self.spec.page_size
        return [{c.name: page * c.bytes_per_token for c in self.spec.components}] * self.num_layers

    def transfer_page_bytes(self) -> list[int]:
        """Bytes of one page per registered layer (every cache of the layer)."""
        return [self.spec.page_bytes] * self.num_layers

    def read_page(self, page: int, device: str | torch.device = "cpu") -> torch.Tensor:
        """A copy of ``page`` over every layer and cache: uint8 ``[page_bytes]`` on ``device``,
        one copy per layer and cache straight into the result."""
        self._check_page(page)
        out = torch.empty(self.page_bytes, dtype=torch.uint8, device=device)
        offset = 0
        for layer in self.caches:
            for cache in layer.tensors():
                part = cache[page].view(torch.uint8).reshape(-1)
                out[offset : offset + part.numel()].copy_(part)
                offset += part.numel()
        return out

    def write_page(self, page: int, data: torch.Tensor) -> None:
        """Overwrite ``page`` in every layer and cache with ``data`` (what ``read_page`` returns)."""
        self._check_page(page)
        if data.dtype != torch.uint8 or tuple(data.shape) != (self.page_bytes,):
            raise ValueError(
                f"page data is {data.dtype} {tuple(data.shape)}, the pool expects uint8 ({self.page_bytes},)"
            )
        offset = 0
        for layer in self.caches:
            for cache in layer.tensors():
                target = cache[page].view(torch.uint8)
                target.copy_(data[offset : offset + target.numel()].view(target.shape))
                offset += target.numel()

    def _check_page(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} out of range [0, {self.num_pages})")

    def slots(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        """Flat cache slots of token positions [start, end) of a sequence holding ``pages``."""
        positions = torch.arange(start, end)
        page_ids = torch.tensor(pages, dtype=torch.int64)[positions // self.page_size]
        return page_ids * self.page_size + positions % self.page_size

    def block_table(self, page_lists: list[list[int]]) -> torch.Tensor:
        width = max((len(p) for p in page_lists), default=0)
        table = torch.zeros(len(page_lists), max(width, 1), dtype=torch.int32)
        for i, pages in enumerate(page_lists):
            table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        return table
