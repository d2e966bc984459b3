"""The KV pool as a transfer library and a KV connector see it: pages of registered memory."""

from __future__ import annotations

import torch

from dsinfer.cache.kv_manager import KVCacheManager


class KVPages:
    """Page geometry, the tensors to register, and page references that hold a page still
    (not evicted, not reused) while a transfer reads or writes it."""

    def __init__(self, manager: KVCacheManager) -> None:
        self._kv = manager

    @property
    def page_size(self) -> int:
        return self._kv.page_size

    @property
    def num_pages(self) -> int:
        return self._kv.num_pages

    def pages_for(self, num_tokens: int) -> int:
        return self._kv.pool.pages_for(num_tokens)

    def regions(self) -> list[tuple[torch.Tensor, ...]]:
        """The KV cache's tensors, per cache layer in layer order its caches in the pool's spec
        order (the latent; V3.2's indexer keys): what the transfer library registers (a page of
        layer l is page ``p`` of every tensor of ``regions()[l]``)."""
        return self._kv.pool.layer_tensors()

    @property
    def page_bytes(self) -> list[int]:
        """Bytes of one page, per cache layer (every cache of the layer)."""
        return [self._kv.pool.spec.page_bytes] * self._kv.pool.num_layers

    def retain(self, pages: list[int]) -> None:
        """One more reference on each page (a transfer reads it): not evicted nor reused."""
        self._kv.retain(pages)

    def release(self, pages: list[int]) -> None:
        self._kv.release(pages)
