"""What a balancer remembers of the pages it sent somewhere: a rank, or a KV tier ranks share.

The record cannot see the cache, so it keeps the page hashes of the requests it dispatched, LRU,
each stamped with the number of pages recorded before it. ``depth(key)`` (pages recorded since
``key`` was last sent) estimates how far down the cache's own LRU order the page is, which says
in which tier it is now: a rank's device pages hold the newest, its host tier the next ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator


class PrefixRecord:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"a prefix record's capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._stamps: OrderedDict[bytes, int] = OrderedDict()
        self._count = 0

    def __len__(self) -> int:
        return len(self._stamps)

    def __contains__(self, key: bytes) -> bool:
        return key in self._stamps

    def depth(self, key: bytes) -> int | None:
        stamp = self._stamps.get(key)
        return None if stamp is None else self._count - stamp - 1

    def leading(self, page_hashes: list[bytes]) -> Iterator[int]:
        """The depths of the leading hashes recorded (hashes are chained: the first miss ends it)."""
        for key in page_hashes:
            depth = self.depth(key)
            if depth is None:
                return
            yield depth

    def remember(self, page_hashes: list[bytes]) -> None:
        # Newest first, so that eviction from the old end drops the deepest pages of a prefix
        # before its first ones and a truncated record still matches from the start.
        for key in reversed(page_hashes):
            self._stamps[key] = self._count
            self._stamps.move_to_end(key)
            self._count += 1
        while len(self._stamps) > self.capacity:
            self._stamps.popitem(last=False)

    def clear(self) -> None:
        self._stamps.clear()
