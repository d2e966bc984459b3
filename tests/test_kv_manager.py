"""KV cache manager: reference counts, LRU eviction, prefix matching, commit, disk write-through and
restart, stats; plus the page hash it keys on. The pool has two caches per layer (a latent and
V3.2-style indexer keys of another width), so every page move is checked on both."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from dsinfer.base.config import ModelConfig
from dsinfer.base.hashing import model_root, page_hash, page_hashes
from dsinfer.base.kv_spec import CacheComponent, KVCacheSpec
from dsinfer.cache.cache_stats import CacheStats, TierLoads
from dsinfer.cache.disk_tier import DiskKVTier
from dsinfer.cache.kv_manager import KVCacheManager
from dsinfer.cache.kv_pool import OutOfPagesError, PagedKVPool

PS = 4  # page size
LAYERS, DIM, INDEX_DIM = 2, 8, 6
SPEC = KVCacheSpec(
    (CacheComponent("latent", DIM, "float32"), CacheComponent("indexer", INDEX_DIM, "float32")), PS
)
PAGE_BYTES = LAYERS * PS * (DIM + INDEX_DIM) * 4
ROOT = model_root("test-model", "float32", str(PS))


def _pool(num_pages: int = 8, spec: KVCacheSpec = SPEC) -> PagedKVPool:
    return PagedKVPool(LAYERS, num_pages, spec)


def _manager(num_pages: int = 8, **kwargs: object) -> KVCacheManager:
    return KVCacheManager(_pool(num_pages), root=ROOT, **kwargs)  # type: ignore[arg-type]


def _disk(directory: Path, capacity: int = 1 << 30) -> DiskKVTier:
    pool = _pool(1)
    return DiskKVTier(
        directory,
        capacity_bytes=capacity,
        root=ROOT,
        page_layout=pool.page_layout,
        page_bytes=pool.page_bytes,
    )


def _fill(mgr: KVCacheManager, pages: list[int], start: int, end: int, seed: int) -> None:
    """Write deterministic 'KV' for token positions [start, end) of a sequence, as a forward would."""
    slots = mgr.pool.slots(pages, start, end)
    gen = torch.Generator().manual_seed(seed)
    for layer in mgr.pool.caches:
        for cache in layer.tensors():
            cache.view(-1, cache.shape[-1])[slots] = torch.randn(end - start, cache.shape[-1], generator=gen)


def _run(mgr: KVCacheManager, tokens: list[int], seed: int = 0) -> list[int]:
    """Match, allocate the rest, 'compute' the uncached tokens, commit; returns the sequence's pages."""
    match = mgr.match_prefix(tokens)
    try:
        pages = match.pages + mgr.allocate(mgr.pool.pages_for(len(tokens)) - len(match.pages))
    except OutOfPagesError:
        mgr.release(match.pages)  # as a scheduler does when it cannot admit
        raise
    _fill(mgr, pages, match.num_tokens, len(tokens), seed)
    mgr.commit(tokens, pages, len(tokens))
    return pages


# Hashing ----------------------------------------------------------------------------------------
def test_page_hashes_chain_and_roots() -> None:
    tokens = list(range(10))
    keys = page_hashes(tokens, 4, ROOT)
    assert len(keys) == 2 and all(len(k) == 16 for k in keys)  # the partial page gets no key
    assert keys[0] == page_hash(ROOT, tokens[:4]) and keys[1] == page_hash(keys[0], tokens[4:8])
    assert page_hashes(tokens[4:], 4, keys[0]) == keys[1:]  # resumable
    assert page_hashes(tokens, 4, model_root("other"))[0] != keys[0]
    assert page_hashes([9, *tokens[1:]], 4, ROOT)[1] != keys[1]  # a change early changes later keys
    assert model_root("ab", "c") != model_root("a", "bc") and model_root("x") == model_root(b"x")
    # deterministic across processes (no salted hash())
    code = (
        "from dsinfer.base.hashing import *; print(page_hashes(list(range(10)), 4, model_root('m'))[1].hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == page_hashes(tokens, 4, model_root("m"))[1].hex()


# Pool extensions ----------------------------------------------------------------------------------
def test_pool_page_io_and_budget() -> None:
    pool = _pool(4)
    assert pool.page_bytes == PAGE_BYTES
    latent = torch.randn(LAYERS, PS, DIM)
    keys = torch.randn(LAYERS, PS, INDEX_DIM)
    # a page's bytes: layer after layer, each layer's latent then its indexer keys
    data = torch.cat(
        [
            torch.cat([latent[i].view(torch.uint8).flatten(), keys[i].view(torch.uint8).flatten()])
            for i in range(LAYERS)
        ]
    )
    pool.write_page(2, data)
    assert torch.equal(pool.read_page(2), data)
    assert torch.equal(pool.caches[1].latent[2], latent[1]) and torch.equal(
        pool.caches[1].indexer[2], keys[1]
    )
    assert not pool.caches[0].latent[1].any()  # other pages untouched
    with pytest.raises(ValueError, match="uint8"):
        pool.write_page(2, torch.zeros(PAGE_BYTES + 1, dtype=torch.uint8))
    repo = Path(__file__).parents[1] / "configs/models"
    v3 = KVCacheSpec.for_model(ModelConfig.from_file(repo / "deepseek-v3/config.json"), "bfloat16")
    per_page = 61 * 64 * 576 * 2
    assert PagedKVPool.page_bytes_for(v3, 61) == per_page
    assert PagedKVPool.num_pages_for_budget(v3, 61, 10 * per_page + 5) == 10
    v32 = ModelConfig.from_file(repo / "deepseek-v3.2/config.json")  # + the indexer keys: 128 values
    assert KVCacheSpec.for_model(v32, "bfloat16").bytes_per_token == (576 + 128) * 2
    assert KVCacheSpec.for_model(v32, "bfloat16", "fp8").bytes_per_token == 576 * 2 + 128 + 4


# Reference counts and eviction ------------------------------------------------------------------
def test_allocate_release_refcounts() -> None:
    mgr = _manager(4)
    a = mgr.allocate(3)
    assert len(set(a)) == 3 and mgr.num_available_pages() == 1
    assert all(mgr.ref_count(p) == 1 for p in a)
    mgr.release(a[:1])  # uncached: straight back to the free list
    assert mgr.num_available_pages() == 2 and mgr.ref_count(a[0]) == 0
    with pytest.raises(ValueError, match="released"):
        mgr.release(a[:1])
    with pytest.raises(ValueError, match="released"):
        mgr.release([a[1], a[1]])
    mgr.release(a[1:])
    assert mgr.num_available_pages() == 4


def test_out_of_pages_when_everything_is_referenced() -> None:
    mgr = _manager(4)
    pages = _run(mgr, list(range(16)))  # 4 full pages, all cached and referenced
    with pytest.raises(OutOfPagesError, match=r"1 pages requested, 0 available"):
        mgr.allocate(1)
    mgr.release(pages)
    assert mgr.num_available_pages() == 4
    assert mgr.allocate(4)  # evicts all cached pages
    with pytest.raises(OutOfPagesError):
        mgr.allocate(1)


def test_lru_eviction_order() -> None:
    mgr = _manager(6)
    seqs = [[100 * s + i for i in range(PS * 2)] for s in range(3)]  # 2 full pages each
    pages = [_run(mgr, t, seed=s) for s, t in enumerate(seqs)]
    assert mgr.num_cached_pages() == 6 and mgr.num_available_pages() == 0
    mgr.release(pages[1])
    mgr.release(pages[0])
    mgr.release(pages[2])
    assert mgr.num_available_pages() == 6
    # LRU: sequence 1 first (its tail page before its head), then 0, then 2
    order = [pages[1][1], pages[1][0], pages[0][1], pages[0][0], pages[2][1], pages[2][0]]
    for i, expected in enumerate(order):
        assert mgr.allocate(1) == [expected]
        assert mgr.num_cached_pages() == 5 - i
    # a prefix hit refreshes a page: it leaves the LRU while referenced, re-enters at the end
    mgr2 = _manager(4)
    p0, p1 = _run(mgr2, seqs[0]), _run(mgr2, seqs[1])
    mgr2.release(p0)
    mgr2.release(p1)
    hit = mgr2.match_prefix([*seqs[0], 7])  # 8 matchable tokens: both pages of seqs[0]
    assert hit.pages == p0 and hit.memory_pages == 2
    mgr2.release(hit.pages)
    assert mgr2.allocate(2) == [p1[1], p1[0]]


# Prefix matching ------------------------------------------------------------------------------
def test_shared_prefix_references_same_pages() -> None:
    mgr = _manager(16)
    prefix = list(range(3 * PS))
    a = _run(mgr, [*prefix, 50, 51], seed=1)
    b_tokens = [*prefix, 60, 61, 62, 63, 64]
    match = mgr.match_prefix(b_tokens)
    assert match.pages == a[:3] and match.num_tokens == 3 * PS
    assert (match.memory_pages, match.disk_pages) == (3, 0)
    assert all(mgr.ref_count(p) == 2 for p in a[:3]) and mgr.ref_count(a[3]) == 1
    b = match.pages + mgr.allocate(mgr.pool.pages_for(len(b_tokens)) - 3)
    _fill(mgr, b, 3 * PS, len(b_tokens), seed=2)
    mgr.commit(b_tokens, b, len(b_tokens))
    assert mgr.is_cached(b[3]) and not mgr.is_cached(a[3])  # a's 4th page is partial
    mgr.release(a)
    assert all(mgr.ref_count(p) == 1 for p in a[:3])
    mgr.release(b)
    assert mgr.num_available_pages() == mgr.num_pages


def test_abandoned_match_counts_once() -> None:
    mgr = _manager(8)
    tokens = list(range(3 * PS + 2))
    mgr.release(_run(mgr, tokens))
    before = mgr.stats
    match = mgr.match_prefix(tokens)
    assert match.memory_pages == 3 and mgr.stats.memory_hit_tokens == before.memory_hit_tokens + 3 * PS
    mgr.abandon(match)  # the caller could not admit it: pages back, hits and query not counted
    assert mgr.stats == before and mgr.num_available_pages() == 8
    assert all(mgr.is_cached(p) for p in match.pages)
    again = mgr.match_prefix(tokens)
    assert again.pages == match.pages
    assert mgr.stats.queried_tokens == before.queried_tokens + len(tokens)
    assert mgr.stats.memory_hit_tokens == before.memory_hit_tokens + 3 * PS
    mgr.release(again.pages)


def test_scheduler_counts_a_request_waiting_for_pages_once() -> None:
    from dsinfer.base.sampling_params import SamplingParams
    from dsinfer.engine.scheduler import Scheduler
    from dsinfer.engine.sequence import Sequence

    mgr = _manager(8)
    tokens = list(range(3 * PS + 2))
    mgr.release(_run(mgr, tokens))  # 3 cached pages
    before = mgr.stats
    sched = Scheduler(mgr, max_num_seqs=4, max_num_batched_tokens=64)
    held = mgr.allocate(5)  # 3 evictable pages left: the prefix fits, its last page does not
    seq = Sequence(
        request_id="r",
        choice=0,
        prompt_len=len(tokens),
        token_ids=list(tokens),
        params=SamplingParams(max_tokens=1),
        seed=0,
        max_tokens=1,
        eos_ids=frozenset(),
    )
    sched.add(seq)
    for _ in range(3):  # waits, asking the cache every step
        assert not sched.schedule().seqs
    assert mgr.stats == before
    mgr.release(held)
    batch = sched.schedule()
    assert [s.seq for s in batch.seqs] == [seq] and seq.num_cached_prompt_tokens == 3 * PS
    assert mgr.stats.queried_tokens == before.queried_tokens + len(tokens)
    assert mgr.stats.memory_hit_tokens == before.memory_hit_tokens + 3 * PS


def test_never_matches_the_last_token() -> None:
    mgr = _manager(8)
    tokens = list(range(2 * PS))
    pages = _run(mgr, tokens)
    assert mgr.is_cached(pages[0]) and mgr.is_cached(pages[1])
    again = mgr.match_prefix(tokens)  # both pages cached, but the last token must be computed
    assert again.pages == pages[:1] and again.num_tokens == PS
    longer = mgr.match_prefix([*tokens, 99])
    assert longer.pages == pages and longer.num_tokens == 2 * PS
    assert mgr.match_prefix(tokens[:1]).pages == [] and mgr.match_prefix([]).pages == []
    mgr.release(pages + again.pages + longer.pages)
    assert mgr.num_available_pages() == mgr.num_pages


def test_commit_only_full_computed_pages_and_idempotent() -> None:
    mgr = _manager(8)
    tokens = list(range(3 * PS + 2))
    pages = mgr.allocate(4)
    mgr.commit(tokens, pages, PS - 1)
    assert mgr.num_cached_pages() == 0
    mgr.commit(tokens, pages, 2 * PS + 1)  # chunked prefill: 2 full pages computed so far
    assert [mgr.is_cached(p) for p in pages] == [True, True, False, False]
    mgr.commit(tokens, pages, len(tokens))
    mgr.commit(tokens, pages, len(tokens))
    assert [mgr.is_cached(p) for p in pages] == [True, True, True, False]
    assert mgr.num_cached_pages() == 3
    # decode appends tokens: the 4th page fills and is cached with the right chained key
    tokens += [7, 8]
    mgr.commit(tokens, pages, len(tokens))
    assert mgr.num_cached_pages() == 4
    assert mgr.match_prefix([*tokens, 1]).pages == pages  # incremental keys == keys in one go
    with pytest.raises(ValueError, match="not referenced"):
        mgr.commit(tokens, [7, 6, 5, 4], len(tokens))


def test_duplicate_hash_pages_stay_uncached() -> None:
    mgr = _manager(8)
    tokens = list(range(2 * PS + 1))
    a = mgr.allocate(3)
    b = mgr.allocate(3)  # the same prompt computed twice concurrently (no prefix hit for b)
    mgr.commit(tokens, a, len(tokens))
    mgr.commit(tokens, b, len(tokens))
    assert mgr.is_cached(a[0]) and mgr.is_cached(a[1])
    assert not mgr.is_cached(b[0]) and not mgr.is_cached(b[1]) and mgr.num_cached_pages() == 2
    assert mgr.match_prefix(tokens).pages == a[:2]
    mgr.release(a[:2])
    mgr.release(b)  # duplicates go straight back to the free list
    assert mgr.num_available_pages() == 8 - 3
    mgr.release(a)
    assert mgr.num_available_pages() == 8
    # once the original is evicted, committing the duplicate again registers it
    mgr = _manager(4)
    a = mgr.allocate(2)
    b = mgr.allocate(2)
    mgr.commit(tokens[:PS], a, PS)
    mgr.commit(tokens[:PS], b, PS)
    mgr.release(a)
    assert mgr.allocate(2) == [a[1], a[0]]  # a[0] evicted
    mgr.commit(tokens[:PS], b, PS)
    assert mgr.is_cached(b[0])


def test_release_returns_every_page() -> None:
    mgr = _manager(12)
    gen = torch.Generator().manual_seed(0)
    live: list[list[int]] = []
    for step in range(40):
        if live and (len(live) > 3 or torch.rand(1, generator=gen).item() < 0.4):
            mgr.release(live.pop(int(torch.randint(len(live), (1,), generator=gen))))
            continue
        base = int(torch.randint(3, (1,), generator=gen))  # a few shared prompt families
        n = int(torch.randint(1, 3 * PS, (1,), generator=gen))
        tokens = [base * 1000 + i for i in range(n)] + [step]
        with contextlib.suppress(OutOfPagesError):
            live.append(_run(mgr, tokens, seed=step))
    for pages in live:
        mgr.release(pages)
    assert mgr.num_available_pages() == mgr.num_pages


def test_prefix_cache_disabled() -> None:
    mgr = _manager(4, enable_prefix_cache=False)
    tokens = list(range(2 * PS + 1))
    pages = _run(mgr, tokens)
    assert mgr.num_cached_pages() == 0 and mgr.match_prefix(tokens).pages == []
    mgr.release(pages)
    assert mgr.pool.allocator.num_free == 4


# Disk tier --------------------------------------------------------------------------------------
def test_disk_write_through_and_restart(tmp_path: Path) -> None:
    mgr = _manager(8, disk=_disk(tmp_path))
    tokens = list(range(3 * PS + 2))
    pages = _run(mgr, tokens, seed=3)
    mgr.flush()
    expected = [mgr.pool.read_page(p) for p in pages[:3]]
    assert mgr.stats.disk_pages_written == 3 and len(list(tmp_path.glob("[0-9a-f]*"))) == 3
    mgr.release(pages)
    mgr.close()

    # a new process: new pool, new tier over the same directory and root
    fresh = _manager(8, disk=_disk(tmp_path))
    match = fresh.match_prefix([*tokens[: 3 * PS], 1, 2, 3])
    assert match.num_tokens == 3 * PS and (match.memory_pages, match.disk_pages) == (0, 3)
    for page, data in zip(match.pages, expected, strict=True):
        assert torch.equal(fresh.pool.read_page(page), data)
        assert fresh.is_cached(page)
    # now in memory: a second match hits memory, nothing is written back to disk
    again = fresh.match_prefix(tokens)
    assert again.pages == match.pages and again.memory_pages == 3
    fresh.flush()
    stats = fresh.stats
    assert stats.disk_loads.seconds > 0 and fresh.disk is not None
    page_bytes = fresh.pool.page_record_bytes
    assert stats == CacheStats(
        memory_hit_tokens=3 * PS,
        disk_hit_tokens=3 * PS,
        queried_tokens=3 * PS + 3 + len(tokens),
        disk_pages_written=0,
        disk_pages_read=3,
        disk_files_rejected=0,
        disk_bytes=3 * fresh.disk.file_bytes,
        disk_loads=TierLoads(3, 3 * page_bytes, stats.disk_loads.seconds),
    )
    assert stats.as_dict()["disk_hit_tokens"] == 3 * PS
    fresh.release(match.pages + again.pages)
    assert fresh.num_available_pages() == 8
    fresh.close()
    fresh.close()  # idempotent


def test_disk_hit_evicts_and_stops_when_no_page(tmp_path: Path) -> None:
    writer = _manager(8, disk=_disk(tmp_path))
    tokens = list(range(4 * PS + 1))
    writer.release(_run(writer, tokens))
    writer.close()
    mgr = _manager(3, disk=_disk(tmp_path))
    held = mgr.allocate(1)
    match = mgr.match_prefix(tokens)  # 4 pages on disk, only 2 pages can be had
    assert match.disk_pages == 2 and match.num_tokens == 2 * PS
    mgr.release(match.pages)
    # the cached pages are evicted for a new allocation; disk still serves them afterwards
    other = mgr.allocate(2)
    assert mgr.num_cached_pages() == 0
    mgr.release(other)
    match = mgr.match_prefix(tokens)
    assert match.disk_pages == 2
    mgr.release(held + match.pages)
    assert mgr.num_available_pages() == 3
    mgr.close()


def test_corrupt_disk_file_is_a_miss(tmp_path: Path) -> None:
    writer = _manager(8, disk=_disk(tmp_path))
    tokens = list(range(2 * PS + 1))
    writer.release(_run(writer, tokens))
    writer.close()
    second = page_hashes(tokens, PS, ROOT)[1]
    blob = bytearray((tmp_path / second.hex()).read_bytes())
    blob[-1] ^= 1
    (tmp_path / second.hex()).write_bytes(bytes(blob))
    mgr = _manager(8, disk=_disk(tmp_path))
    match = mgr.match_prefix(tokens)
    assert match.disk_pages == 1 and mgr.stats.disk_files_rejected == 1
    mgr.release(match.pages)
    assert mgr.num_available_pages() == 8
    mgr.close()


def test_disk_tier_must_match_pool(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="do not match"):
        KVCacheManager(_pool(4, KVCacheSpec.latent(DIM, "float32", PS)), root=ROOT, disk=_disk(tmp_path))
    with pytest.raises(ValueError, match="root"):
        KVCacheManager(_pool(4), root=model_root("other"), disk=_disk(tmp_path))


class _SlowDisk(DiskKVTier):
    """A tier whose writes wait for the test: shows that commit never waits for the disk."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.entered, self.go = threading.Event(), threading.Event()

    def write(self, key: bytes, data: torch.Tensor) -> bool:
        self.entered.set()
        assert self.go.wait(10)
        return super().write(key, data)


def test_commit_never_waits_for_disk(tmp_path: Path) -> None:
    disk = _SlowDisk(
        tmp_path, capacity_bytes=1 << 30, root=ROOT, page_layout=_pool(1).page_layout, page_bytes=PAGE_BYTES
    )
    mgr = _manager(8, disk=disk, max_pending_writes=1)
    tokens = list(range(3 * PS + 1))
    pages = mgr.allocate(4)
    _fill(mgr, pages, 0, len(tokens), seed=5)
    mgr.commit(tokens, pages, PS)  # page 0: taken by the writer, which now blocks
    assert disk.entered.wait(10)
    mgr.commit(tokens, pages, 2 * PS)  # page 1: queued
    _fill(mgr, pages, 0, PS, seed=6)  # the snapshot of page 0 was taken at commit: later writes don't leak in
    mgr.commit(tokens, pages, len(tokens))  # page 2: queue full, dropped rather than waited for
    assert mgr.stats.disk_writes_dropped == 1 and mgr.stats.disk_pages_written == 0
    with pytest.raises(TimeoutError, match="pending"):
        mgr.flush(timeout=0.05)
    disk.go.set()
    mgr.flush()
    assert mgr.stats.disk_pages_written == 2
    keys = page_hashes(tokens, PS, ROOT)
    assert disk.contains(keys[0]) and disk.contains(keys[1]) and not disk.contains(keys[2])
    first = disk.read(keys[0])
    assert first is not None and not torch.equal(first, mgr.pool.read_page(pages[0]))
    mgr.release(pages)
    mgr.close()
