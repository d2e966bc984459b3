"""The paged latent KV cache: one tensor per layer, ``[num_pages, page_size, kv_lora_rank + qk_rope_head_dim]``.

Page p of every layer belongs to the same sequence; a sequence's pages are listed in its block
table. This is FlashMLA's layout (a view adds its single KV-head axis).

A page may be reserved for good (``LatentKVPool.reserve_dummy_page``): the allocator never hands
it out again and it belongs to no sequence. Padding rows of a CUDA-graph decode step write their
latent there and attend to it (dsinfer/engine/cuda_graph.py).
"""

from __future__ import annotations

import torch

from dsinfer.base.config import PAGE_SIZE, ModelConfig


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


class LatentKVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        dim: int,
        *,
        page_size: int = PAGE_SIZE,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_layers <= 0 or num_pages <= 0 or dim <= 0 or page_size <= 0:
            raise ValueError(
                f"num_layers, num_pages, dim and page_size must be positive, got "
                f"{num_layers}, {num_pages}, {dim}, {page_size}"
            )
        self.page_size, self.dim = page_size, dim
        self.caches = [
            torch.zeros(num_pages, page_size, dim, dtype=dtype, device=device) for _ in range(num_layers)
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
        page_size: int = PAGE_SIZE,
    ) -> LatentKVPool:
        return cls(
            num_layers, num_pages, config.kv_cache_dim, page_size=page_size, dtype=dtype, device=device
        )

    @staticmethod
    def page_bytes_for(
        config: ModelConfig, num_layers: int, dtype: torch.dtype, page_size: int = PAGE_SIZE
    ) -> int:
        """Bytes one page takes over all ``num_layers`` caches."""
        return num_layers * page_size * config.kv_cache_dim * dtype.itemsize

    @classmethod
    def num_pages_for_budget(
        cls,
        config: ModelConfig,
        num_layers: int,
        budget_bytes: int,
        dtype: torch.dtype,
        page_size: int = PAGE_SIZE,
    ) -> int:
        """How many pages fit in ``budget_bytes`` (rounded down; 0 when not even one fits)."""
        if budget_bytes < 0:
            raise ValueError(f"memory budget must be >= 0 bytes, got {budget_bytes}")
        return budget_bytes // cls.page_bytes_for(config, num_layers, dtype, page_size)

    # Shape and whole-page access -------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.caches)

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_usable_pages(self) -> int:
        """Pages sequences can hold (the dummy page, when reserved, is not one of them)."""
        return self.allocator.num_usable

    @property
    def dtype(self) -> torch.dtype:
        return self.caches[0].dtype

    @property
    def page_shape(self) -> tuple[int, int, int]:
        """Shape of one page over all layers: ``(num_layers, page_size, dim)``."""
        return (self.num_layers, self.page_size, self.dim)

    def read_page(self, page: int, device: str | torch.device = "cpu") -> torch.Tensor:
        """A copy of ``page`` over all layers, ``[num_layers, page_size, dim]``, on ``device``.

        One copy per layer straight into the result (no intermediate stack on the cache device).
        """
        self._check_page(page)
        out = torch.empty(self.page_shape, dtype=self.dtype, device=device)
        for layer, cache in enumerate(self.caches):
            out[layer].copy_(cache[page])
        return out

    def write_page(self, page: int, data: torch.Tensor) -> None:
        """Overwrite ``page`` in every layer with ``data`` (``[num_layers, page_size, dim]``)."""
        self._check_page(page)
        if tuple(data.shape) != self.page_shape:
            raise ValueError(f"page data has shape {tuple(data.shape)}, the pool expects {self.page_shape}")
        for layer, cache in enumerate(self.caches):
            cache[page].copy_(data[layer])

    def _check_page(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} out of range [0, {self.num_pages})")

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

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
