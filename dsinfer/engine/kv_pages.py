"""The KV pool as a transfer library and a KV connector see it: pages of registered memory.

A pool whose sequences keep a state beside their pages (DeepSeek-V4) sends only a prompt's whole
pages (``sends_partial_pages`` False) and, through a handoff slot (one more registered layer,
``handoff_layer``), the resume point at the last of them: the decode rank computes the rest of
the prompt itself from there (``stage_handoff`` on the prefill rank, ``reserve_handoff`` and
``adopt_handoff`` on the decode rank).
"""

from __future__ import annotations

import torch

from dsinfer.cache.kv_manager import KVCacheManager
from dsinfer.cache.v4_pool import V4StatePool


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
        """Bytes of one page, per registered layer (every cache of the layer; 0: nothing to write)."""
        return self._kv.pool.transfer_page_bytes()

    @property
    def page_groups(self) -> list[dict[str, int]]:
        """``page_bytes`` by cache group, per registered layer (what the transfer counters split)."""
        return self._kv.pool.transfer_page_groups()

    @property
    def sends_partial_pages(self) -> bool:
        return self._kv.pool.sends_partial_pages

    @property
    def handoff_layer(self) -> int | None:
        """The registered layer of handoff slots, or None when the pool has none (V3)."""
        pool = self._kv.pool
        return pool.handoff_layer if isinstance(pool, V4StatePool) else None

    def stage_handoff(self, pages: list[int], num_tokens: int) -> tuple[int, int] | None:
        """Prefill side: (slot, tokens it lets the decode rank skip) holding the state at the
        last whole page of ``num_tokens``, or None (nothing to hand over: the decode rank computes
        from its own cached tokens; or no slot free yet)."""
        return self._v4().stage_point(pages, num_tokens)

    def reserve_handoff(self) -> int | None:
        """Decode side: a slot for an incoming handoff, or None while every slot is held."""
        handoff = self._v4().handoff
        return None if handoff is None else handoff.take()

    def adopt_handoff(self, slot: int, pages: list[int], position: int) -> None:
        """Decode side: the handoff in ``slot`` lets the sequence over ``pages`` resume at
        ``position``; the slot is free again."""
        self._v4().adopt_point(slot, pages, position)

    def release_handoff(self, slot: int) -> None:
        """A slot no write can land in any more (or one the prefill side has written out)."""
        handoff = self._v4().handoff
        assert handoff is not None
        handoff.give(slot)

    def _v4(self) -> V4StatePool:
        pool = self._kv.pool
        if not isinstance(pool, V4StatePool):
            raise RuntimeError("this KV pool hands nothing over beside its pages")
        return pool

    def retain(self, pages: list[int]) -> None:
        """One more reference on each page (a transfer reads it): not evicted nor reused."""
        self._kv.retain(pages)

    def release(self, pages: list[int]) -> None:
        self._kv.release(pages)
