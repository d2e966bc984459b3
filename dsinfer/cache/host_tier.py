"""The host-memory tier of the prefix cache: pages the pool evicts, kept by their prefix key.

Between the pool's pages and the disk tier. A cached page the pool hands to a new owner is first
copied here as its record (``read_page``: every layer's bytes; V4's with its resume point), the
least recently used going first once ``capacity_bytes`` is full. A prefix lookup that misses the
pool looks here before the disk: a hit is copied into a free page and cached there again. On a GPU
rank this is the CPU memory behind the device's pages (pinned, so that the copies can run
asynchronously); on a CPU rank, more pages of the same memory for what no running request holds.
Entries are the pool's own bytes in this process (no checksum: nothing leaves the process).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class HostTierStats:
    pages: int = 0
    bytes: int = 0
    pages_written: int = 0  # pages copied in from the pool
    pages_read: int = 0  # hits copied back into the pool
    evictions: int = 0  # pages dropped to make room


class HostKVTier:
    def __init__(self, capacity_bytes: int, record_bytes: int, pin: bool = False) -> None:
        if capacity_bytes < 0 or record_bytes <= 0:
            raise ValueError(f"host tier: capacity {capacity_bytes} and record {record_bytes} bytes")
        self.capacity_bytes, self.record_bytes, self.pin = capacity_bytes, record_bytes, pin
        self._pages: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._stats = HostTierStats()

    @property
    def max_pages(self) -> int:
        return self.capacity_bytes // self.record_bytes

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: bytes) -> bool:
        return key in self._pages

    def put(self, key: bytes, record: torch.Tensor) -> None:
        """Keep ``record`` (a pool page's bytes, this tier's to keep) under ``key``, most recent."""
        if self.max_pages == 0:
            return
        if record.numel() != self.record_bytes:
            raise ValueError(f"host tier: a record of {record.numel()} bytes, expected {self.record_bytes}")
        if key not in self._pages:
            while len(self._pages) >= self.max_pages:
                self._pages.popitem(last=False)
                self._stats.evictions += 1
            self._stats.pages_written += 1
        self._pages[key] = record.pin_memory() if self.pin else record
        self._pages.move_to_end(key)

    def get(self, key: bytes) -> torch.Tensor | None:
        """The record under ``key`` (now the most recent), or None."""
        record = self._pages.get(key)
        if record is not None:
            self._pages.move_to_end(key)
            self._stats.pages_read += 1
        return record

    def stats(self) -> HostTierStats:
        return HostTierStats(
            len(self._pages),
            len(self._pages) * self.record_bytes,
            self._stats.pages_written,
            self._stats.pages_read,
            self._stats.evictions,
        )
