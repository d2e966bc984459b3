"""What the KV cache manager reports: its counters, a prefix match, a prefetch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# per tier: pages copied into the pool, their bytes, seconds from asking to done (summed), pages
# copied to the tier, pages it dropped for room, bytes it holds now
TIER_COUNTERS = ("pages_loaded", "bytes_loaded", "load_seconds", "pages_written", "evictions", "bytes")


@dataclass
class TierLoads:
    """Pages copied from one tier into the pool, their bytes, the seconds from asking to done."""

    pages: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def as_tuple(self) -> tuple[int, int, float]:
        return self.pages, self.bytes, self.seconds


@dataclass
class CacheStats:
    memory_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    host_hit_tokens: int = 0
    host_pages_written: int = 0  # evicted pages copied to the host tier
    host_evictions: int = 0  # pages the host tier dropped for room
    host_bytes: int = 0  # what the host tier holds now
    queried_tokens: int = 0  # prompt tokens passed to match_prefix (the hit-rate denominator)
    disk_pages_written: int = 0
    disk_pages_read: int = 0
    disk_files_rejected: int = 0
    disk_writes_dropped: int = 0  # write queue full or I/O error
    disk_evictions: int = 0  # files the disk tier deleted for room
    disk_bytes: int = 0  # what the disk tier holds now (this process's index)
    host_loads: TierLoads = field(default_factory=TierLoads)
    disk_loads: TierLoads = field(default_factory=TierLoads)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def tiers(self) -> dict[str, dict[str, float]]:
        """Per tier below the pool ("host", "disk"): ``TIER_COUNTERS`` by name."""
        out = {}
        for tier, loads in (("host", self.host_loads), ("disk", self.disk_loads)):
            kept = (getattr(self, f"{tier}_{name}") for name in ("pages_written", "evictions", "bytes"))
            out[tier] = dict(zip(TIER_COUNTERS, map(float, (*loads.as_tuple(), *kept)), strict=True))
        return out

    def count_load(self, tier: str, nbytes: int, seconds: float) -> None:
        """One page copied from ``tier`` ("host" or "disk") into the pool."""
        loads = self.host_loads if tier == "host" else self.disk_loads
        loads.pages, loads.bytes, loads.seconds = (
            loads.pages + 1,
            loads.bytes + nbytes,
            loads.seconds + seconds,
        )


@dataclass
class PrefixMatch:
    pages: list[int]  # referenced for the caller: release them like allocated pages
    num_tokens: int  # len(pages) * page_size
    memory_pages: int
    disk_pages: int
    queried_tokens: int = 0
    host_pages: int = 0
    origins: list[str] = field(default_factory=list)  # per page: "memory", "host" or "disk"


@dataclass
class Prefetch:
    """The pages a prefetch waits for (keys being loaded when it was made)."""

    keys: list[bytes]
