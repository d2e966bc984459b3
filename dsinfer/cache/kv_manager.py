"""Page lifecycle over the paged KV pool: reference counts, the hash-chained prefix cache with
LRU eviction, an optional host-memory tier behind it and write-through to an optional on-disk
tier.

Every page is in exactly one state:

- free: on the pool allocator's free list;
- referenced: used by one or more sequences (``refcount > 0``), cached (registered under its
  prefix key, read-only) or not (still being written by its only owner);
- evictable: cached with no reference; kept in an LRU and reused for new allocations only when
  the free list runs short.

``num_available_pages() == free + evictable``; once every sequence has released its pages it is
the pool size again. The manager holds one allocator reference for every page it owns (referenced
or evictable) and keeps sequence reference counts itself.

Tiers below the pool, looked up in this order when a prefix misses it: the host-memory tier
(``host``: an evicted cached page is copied there just before its page gets a new owner) and the
disk. Disk writes run on one background thread fed by a bounded queue: ``commit`` snapshots each newly
cached page to host memory (one copy) and enqueues it; when the queue is full the write is dropped
(counted), never waited for.

Loads from those tiers run ahead of the step that needs them: ``prefetch`` takes free pages for a
waiting prompt's pages that a lower tier holds and hands the reads to a background thread
(dsinfer/cache/tier_loader.py); ``finish_loads`` caches the pages whose loads are done, each
tagged with the tier it came from until a match counts it. The scheduler admits the prompt once
its loads are done (``loading``) and matches with ``load=False``, so no step waits for a tier.
``match_prefix`` with ``load=True`` (the default; PD's decode side) still loads on the caller's
thread.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

import torch

from dsinfer.base.hashing import page_hashes
from dsinfer.cache.cache_stats import CacheStats, Prefetch, PrefixMatch
from dsinfer.cache.disk_tier import DiskKVTier
from dsinfer.cache.disk_writer import DiskWriter
from dsinfer.cache.host_tier import HostKVTier
from dsinfer.cache.kv_pool import OutOfPagesError, PagedKVPool
from dsinfer.cache.tier_loader import PageLoad, TierLoader

logger = logging.getLogger(__name__)


class KVCacheManager:
    def __init__(
        self,
        pool: PagedKVPool,
        *,
        root: bytes,
        enable_prefix_cache: bool = True,
        disk: DiskKVTier | None = None,
        max_pending_writes: int = 64,
        resumable: Callable[[int], bool] | None = None,
        on_allocate: Callable[[list[int]], None] | None = None,
        host: HostKVTier | None = None,
    ) -> None:
        """``resumable`` (models with per-sequence state beside their pages, V4): whether a prefix
        hit may end after this page; a hit is cut back to the last such page. ``on_allocate``: told
        the pages each allocation hands out (new owners), evicted cached ones included. ``host``:
        the tier evicted cached pages are copied to (and looked up in before the disk)."""
        if disk is not None:
            if disk.page_layout != pool.page_record_layout or disk.payload_bytes != pool.page_record_bytes:
                raise ValueError(
                    f"disk tier pages ({disk.page_layout}) do not match the pool's ({pool.page_record_layout})"
                )
            if disk.root != root:
                raise ValueError("the disk tier was opened for another model root")
        self._pool = pool
        self._resumable, self._on_allocate = resumable, on_allocate
        self._alloc = pool.allocator
        self.root = root
        self.enable_prefix_cache = enable_prefix_cache
        self.disk = disk if enable_prefix_cache else None
        self._refs: dict[int, int] = {}  # page -> sequence references (> 0), for referenced pages
        self._cached: dict[bytes, int] = {}  # prefix key -> the page registered under it
        self._key_of: dict[int, bytes] = {}  # page -> its key, for every owned page whose key is known
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self._stats = CacheStats()
        self._writer = DiskWriter(self.disk, max_pending_writes) if self.disk is not None else None
        self.host = host if enable_prefix_cache else None
        self._loader: TierLoader | None = None
        if self.host is not None or self.disk is not None:
            self._loader = TierLoader(pool)
        self._loading: dict[bytes, int] = {}  # key -> the page its load writes
        self._origin: dict[int, str] = {}  # a cached page loaded from a tier -> that tier, until matched
        self.max_loading_pages = max(1, self.num_pages // 2)

    # Sizes -----------------------------------------------------------------------------------
    @property
    def pool(self) -> PagedKVPool:
        return self._pool

    @property
    def page_size(self) -> int:
        return self._pool.page_size

    @property
    def num_pages(self) -> int:
        """Pages sequences can hold: the pool's, less a reserved dummy page (CUDA graphs)."""
        return self._pool.num_usable_pages

    def num_available_pages(self) -> int:
        return self._alloc.num_free + len(self._evictable)

    def num_cached_pages(self) -> int:
        return len(self._cached)

    def ref_count(self, page: int) -> int:
        return self._refs.get(page, 0)

    def is_cached(self, page: int) -> bool:
        key = self._key_of.get(page)
        return key is not None and self._cached.get(key) == page

    @property
    def stats(self) -> CacheStats:
        """A snapshot of the counters (disk ones include the writer thread's progress)."""
        s = copy.deepcopy(self._stats)
        if self.host is not None:
            host = self.host.stats()
            s.host_pages_written, s.host_evictions, s.host_bytes = (
                host.pages_written,
                host.evictions,
                host.bytes,
            )
        if self.disk is not None and self._writer is not None:  # both or neither
            disk = self.disk.stats()
            s.disk_pages_written = disk.pages_written
            s.disk_files_rejected = disk.files_rejected
            s.disk_writes_dropped += self._writer.failed
            s.disk_evictions, s.disk_bytes = disk.files_evicted, disk.bytes
        return s

    def tier_report(self, stats: CacheStats) -> dict[str, dict[str, float]]:
        """``stats.tiers()`` (a ``stats`` snapshot) plus each tier's capacity in pages (0: off)."""
        tiers = stats.tiers()
        tiers["host"]["capacity_pages"] = float(self.host.max_pages if self.host is not None else 0)
        disk = self.disk
        tiers["disk"]["capacity_pages"] = float(
            disk.capacity_bytes // disk.file_bytes if disk is not None else 0
        )
        return tiers

    @property
    def disk_tier_id(self) -> str:
        return self.disk.tier_id if self.disk is not None else ""

    # Allocation ------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` pages with one reference each; evicts cached unreferenced pages (LRU first) when
        the free list is short. Raises OutOfPagesError, changing nothing, when it cannot."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        free, evictable = self._alloc.num_free, len(self._evictable)
        if n > free + evictable:
            raise OutOfPagesError(
                f"{n} pages requested, {free + evictable} available ({free} free + {evictable} "
                f"evictable cached) of {self.num_pages}; {len(self._refs)} referenced"
            )
        pages = self._alloc.allocate(min(n, free))
        pages += [self._evict_one() for _ in range(n - len(pages))]
        for p in pages:
            self._refs[p] = 1
        if self._on_allocate is not None:
            self._on_allocate(pages)
        return pages

    def release(self, pages: list[int]) -> None:
        """Drop one reference from each page. At zero a cached page becomes evictable (most
        recently used); within one call later pages are queued to go before earlier ones, so a
        sequence's tail is evicted before the prefix it hangs from. An uncached page is freed."""
        for p, n in Counter(pages).items():
            if self._refs.get(p, 0) < n:
                raise ValueError(
                    f"page {p} released {n} time(s) but holds {self._refs.get(p, 0)} reference(s)"
                )
        for p in reversed(pages):
            count = self._refs[p] - 1
            if count > 0:
                self._refs[p] = count
                continue
            del self._refs[p]
            if self.is_cached(p):
                self._evictable[p] = None
            else:
                self._key_of.pop(p, None)
                self._alloc.free([p])

    def retain(self, pages: list[int]) -> None:
        """One more reference on pages that are already referenced (e.g. while a transfer reads
        them); undone by ``release``."""
        for p in pages:
            if self._refs.get(p, 0) < 1:
                raise ValueError(f"page {p} holds no reference to add to")
        for p in pages:
            self._refs[p] += 1

    def _evict_one(self) -> int:
        page, _ = self._evictable.popitem(last=False)
        key = self._key_of.pop(page)
        del self._cached[key]
        self._origin.pop(page, None)
        if self.host is not None:  # before the page gets its new owner
            self.host.put(key, self._pool.read_page(page))
        return page

    def _take_page(self) -> int | None:
        """One page with one reference, or None when none is free or evictable."""
        return self.allocate(1)[0] if self.num_available_pages() > 0 else None

    def _reference(self, page: int) -> None:
        self._evictable.pop(page, None)
        self._refs[page] = self._refs.get(page, 0) + 1

    # Prefix cache ----------------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], *, load: bool = True) -> PrefixMatch:
        """Reference the longest cached run of full pages at the start of ``token_ids``, from
        memory then (``load``) the host tier and the disk, stopping at the first miss. The last
        token is never covered. A page ``prefetch`` loaded counts as a hit of its tier."""
        self._stats.queried_tokens += len(token_ids)
        pages: list[int] = []
        if not self.enable_prefix_cache or len(token_ids) <= self.page_size:
            return PrefixMatch(pages, 0, 0, 0, len(token_ids))
        origins: list[str] = []  # the tier each page came from
        for key in page_hashes(token_ids[:-1], self.page_size, self.root):
            page = self._cached.get(key)
            if page is not None:
                self._reference(page)
                origins.append(self._origin.pop(page, "memory"))
            elif load and (page := self._load_from_host(key)) is not None:
                origins.append("host")
            elif load and (page := self._load_from_disk(key)) is not None:
                origins.append("disk")
            else:
                break
            pages.append(page)
        if self._resumable is not None:
            usable = max((i + 1 for i, page in enumerate(pages) if self._resumable(page)), default=0)
            self.release(pages[usable:])
            pages, origins = pages[:usable], origins[:usable]
        memory, host_pages, disk_pages = (origins.count(t) for t in ("memory", "host", "disk"))
        self._stats.memory_hit_tokens += memory * self.page_size
        self._stats.host_hit_tokens += host_pages * self.page_size
        self._stats.disk_hit_tokens += disk_pages * self.page_size
        self._stats.disk_pages_read += disk_pages
        return PrefixMatch(
            pages, len(pages) * self.page_size, memory, disk_pages, len(token_ids), host_pages, origins
        )

    def abandon(self, match: PrefixMatch) -> None:
        """Give back a match the caller could not use (it will ask again): release its pages and
        take its tokens out of the hit statistics, so that a request waiting for pages counts
        once. Pages read from disk stay read (``disk_pages_read``) and cached in memory."""
        self.release(match.pages)
        for page, origin in zip(match.pages, match.origins, strict=True):
            if origin != "memory" and self.is_cached(page):
                self._origin[page] = origin  # counted as that tier's hit when matched again
        self._stats.queried_tokens -= match.queried_tokens
        self._stats.memory_hit_tokens -= match.memory_pages * self.page_size
        self._stats.disk_hit_tokens -= match.disk_pages * self.page_size
        self._stats.host_hit_tokens -= match.host_pages * self.page_size

    def _load_from_host(self, key: bytes) -> int | None:
        if self.host is None or key not in self.host:
            return None
        page = self._take_page()
        if page is None:
            return None
        start = time.perf_counter()
        record = self.host.get(key)
        assert record is not None
        self._pool.write_page(page, record)
        self._install(key, page)
        self._stats.count_load("host", record.numel(), time.perf_counter() - start)
        return page

    def _load_from_disk(self, key: bytes) -> int | None:
        if self.disk is None or not self.disk.contains(key):
            return None
        page = self._take_page()
        if page is None:
            return None
        start = time.perf_counter()
        data = self.disk.read(key)
        if data is None:  # bad file: the tier counted and deleted it
            self.release([page])
            return None
        self._pool.write_page(page, data)
        self._install(key, page)
        self._stats.count_load("disk", data.numel(), time.perf_counter() - start)
        return page

    def _install(self, key: bytes, page: int) -> None:
        self._cached[key] = page
        self._key_of[page] = key

    # Loads ahead of the step -----------------------------------------------------------------
    @property
    def loads_ahead(self) -> bool:
        """Whether lower tiers exist to ``prefetch`` from (else ``match_prefix`` finds all)."""
        return self._loader is not None

    @property
    def loads_pending(self) -> bool:
        return bool(self._loading)

    def prefetch(self, token_ids: list[int]) -> Prefetch | None:
        """Start loading, in the background, the pages of ``token_ids``' cached prefix that only a
        lower tier holds, each into a page taken now (at most ``max_loading_pages`` in flight);
        pages in the pool are touched. None when nothing is loading for it."""
        if self._loader is None or len(token_ids) <= self.page_size:
            return None
        held: list[int] = []
        keys: list[bytes] = []
        try:
            for key in page_hashes(token_ids[:-1], self.page_size, self.root):
                if (page := self._cached.get(key)) is not None:
                    self._reference(page)  # not evicted by this prefetch's own allocations
                    held.append(page)
                    continue
                if key not in self._loading:
                    source = self._tier_reader(key) if len(self._loading) < self.max_loading_pages else None
                    if source is None or (page := self._take_page()) is None:
                        break
                    self._loading[key] = page
                    self._loader.submit(PageLoad(key, page, *source))
                keys.append(key)
        finally:
            self.release(held)
        return Prefetch(keys) if keys else None

    def loading(self, prefetch: Prefetch) -> bool:
        return any(key in self._loading for key in prefetch.keys)

    def finish_loads(self) -> None:
        """Cache the pages whose loads are done (a failed one is freed: a miss, computed)."""
        if self._loader is None:
            return
        for load in self._loader.completed():
            del self._loading[load.key]
            if load.data is not None:  # a pool written on this thread only
                self._pool.write_page(load.page, load.data)
            if load.ok and load.key not in self._cached:
                self._install(load.key, load.page)
                self._origin[load.page] = load.tier
                self._stats.count_load(load.tier, load.nbytes, load.seconds)
            self.release([load.page])

    def wait_for_loads(self, timeout: float) -> None:
        """Wait until a load is done or ``timeout`` seconds pass (for a rank with nothing else to do)."""
        if self._loader is not None and self._loading:
            self._loader.wait(timeout)

    def _tier_reader(self, key: bytes) -> tuple[str, Callable[[], torch.Tensor | None]] | None:
        if self.host is not None and (record := self.host.get(key)) is not None:
            return "host", lambda: record
        disk = self.disk
        if disk is not None and disk.contains(key):
            return "disk", lambda: disk.read(key)
        return None

    def commit(self, token_ids: list[int], pages: list[int], num_computed_tokens: int) -> None:
        """Cache every full page whose tokens are all computed (idempotent). A page whose key
        another page already holds stays uncached. New cached pages are written to disk behind."""
        if not self.enable_prefix_cache:
            return
        ps = self.page_size
        num_full = min(num_computed_tokens, len(token_ids)) // ps
        if num_full > len(pages):
            raise ValueError(f"{num_full} full pages computed but the sequence holds {len(pages)} pages")
        for page in pages[:num_full]:
            if self._refs.get(page, 0) <= 0:
                raise ValueError(f"page {page} committed but not referenced")
        # hashes are chained: resume after the last leading page whose key is already known
        known = 0
        while known < num_full and pages[known] in self._key_of:
            known += 1
        prev = self._key_of[pages[known - 1]] if known else self.root
        new_keys = page_hashes(token_ids[known * ps : num_full * ps], ps, prev)
        for i in range(num_full):
            page = pages[i]
            key = self._key_of.get(page) if i < known else new_keys[i - known]
            assert key is not None
            self._key_of[page] = key
            if key in self._cached:  # this page (idempotent) or a duplicate
                continue
            self._cached[key] = page
            self._write_behind(key, page)

    def _write_behind(self, key: bytes, page: int) -> None:
        if self._writer is None or self.disk is None or self.disk.is_indexed(key):
            return
        # snapshot here (one copy), write on the writer thread; never wait for the disk
        if not self._writer.has_room() or not self._writer.submit(key, self._pool.read_page(page)):
            self._stats.disk_writes_dropped += 1

    # Shutdown --------------------------------------------------------------------------------
    def flush(self, timeout: float = 10.0) -> None:
        """Wait until every queued disk write is done; TimeoutError after ``timeout`` seconds."""
        if self._writer is not None:
            self._writer.flush(timeout)

    def close(self) -> None:
        """Flush and stop the writer and loader threads (idempotent). The cache keeps serving from
        memory and disk; pages committed afterwards are no longer written to disk."""
        if self._loader is not None:
            self._loader.stop()
        if self._writer is None or self._writer.stopped:
            return
        try:
            self.flush()
        except TimeoutError as e:
            logger.warning("closing the KV cache manager: %s", e)
        self._writer.stop()
