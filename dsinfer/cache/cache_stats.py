"""What the KV cache manager reports: its counters, a prefix match, a prefetch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# per tier: pages copied into the pool, their bytes, seconds from asking to done (summed), pages
# copied to the tier, pages it dropped for room, bytes it holds now
TIER_COUNTERS = ("pages_loaded", "bytes_loaded", "load_seconds", "pages_written", "evictions", "bytes")


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
    # pages copied from a tier into the pool, their bytes, and the seconds from asking to done
    host_pages_loaded: int = 0
    host_bytes_loaded: int = 0
    host_load_seconds: float = 0.0
    disk_pages_loaded: int = 0
    disk_bytes_loaded: int = 0
    disk_load_seconds: float = 0.0

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)

    def tiers(self) -> dict[str, dict[str, float]]:
        """Per tier below the pool ("host", "disk"): ``TIER_COUNTERS`` by name."""
        return {
            t: {name: float(getattr(self, f"{t}_{name}")) for name in TIER_COUNTERS} for t in ("host", "disk")
        }

    def count_load(self, tier: str, nbytes: int, seconds: float) -> None:
        """One page copied from ``tier`` ("host" or "disk") into the pool."""
        pages, moved, spent = (f"{tier}_pages_loaded", f"{tier}_bytes_loaded", f"{tier}_load_seconds")
        setattr(self, pages, getattr(self, pages) + 1)
        setattr(self, moved, getattr(self, moved) + nbytes)
        setattr(self, spent, getattr(self, spent) + seconds)


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
