"""On-disk KV tier: round trip, restart, capacity eviction, and rejection of every kind of bad file
(format version 1 files, from before the per-layer cache spec, included)."""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import time
from pathlib import Path

import pytest
import torch

from dsinfer.base.hashing import model_root, page_hashes
from dsinfer.base.kv_spec import CacheComponent, KVCacheSpec
from dsinfer.cache.disk_tier import DiskKVTier
from dsinfer.cache.kv_pool import PagedKVPool

PS = 4
SPEC = KVCacheSpec((CacheComponent("latent", 8, "float32"), CacheComponent("indexer", 4, "float32")), PS)
POOL = PagedKVPool(3, 1, SPEC)  # what a page is: 3 layers of latent + indexer keys
ROOT = model_root("test-model", "float32", "4")


def _tier(directory: Path, capacity_pages: int = 100, **kwargs: object) -> DiskKVTier:
    opts: dict = {"root": ROOT, "page_layout": POOL.page_layout, "page_bytes": POOL.page_bytes, **kwargs}
    probe = DiskKVTier(directory, capacity_bytes=1 << 40, **opts)
    return DiskKVTier(directory, capacity_bytes=capacity_pages * probe.file_bytes, **opts)


def _keys(n: int, root: bytes = ROOT) -> list[bytes]:
    return page_hashes(list(range(n * PS)), PS, root)


def _page(seed: int, nbytes: int = POOL.page_bytes) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_round_trip(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    key = _keys(1)[0]
    assert not tier.contains(key) and tier.read(key) is None
    data = _page(0)
    assert tier.write(key, data)
    assert tier.contains(key) and len(tier) == 1
    got = tier.read(key)
    assert got is not None and got.dtype == torch.uint8 and torch.equal(got, data)
    stats = tier.stats()
    assert (stats.pages_written, stats.pages_read, stats.files_rejected) == (1, 1, 0)
    assert stats.bytes == tier.file_bytes and not list(tmp_path.glob(".*.tmp"))


def test_page_through_a_pool(tmp_path: Path) -> None:
    """A pool page with both caches of every layer written survives the tier byte for byte."""
    pool = PagedKVPool(3, 4, SPEC)
    for layer in pool.caches:
        for cache in layer.tensors():
            cache.normal_(generator=torch.Generator().manual_seed(cache.shape[-1]))
    tier, key = _tier(tmp_path), _keys(1)[0]
    assert tier.write(key, pool.read_page(2))
    other = PagedKVPool(3, 4, SPEC)
    got = tier.read(key)
    assert got is not None
    other.write_page(1, got)
    for a, b in zip(pool.caches, other.caches, strict=True):
        assert torch.equal(a.latent[2], b.latent[1]) and torch.equal(a.indexer[2], b.indexer[1])
    with pytest.raises(ValueError, match="does not fit"):
        tier.write(key, torch.zeros(POOL.page_bytes, dtype=torch.float32))


def test_restart_rebuilds_index(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    keys = _keys(3)
    for i, key in enumerate(keys):
        tier.write(key, _page(i))
        os.utime(tmp_path / key.hex(), (time.time() - 100 + i, time.time() - 100 + i))
    (tmp_path / "README").write_text("not a page")  # ignored: not a key name
    again = _tier(tmp_path, capacity_pages=3)
    assert len(again) == 3 and again.total_bytes == 3 * again.file_bytes
    for i, key in enumerate(keys):
        got = again.read(key)
        assert got is not None and torch.equal(got, _page(i))
    # the restarted index keeps the mtime order: keys[0] is least recently used, unless read
    for i, key in enumerate(keys):
        os.utime(tmp_path / key.hex(), (time.time() - 50 + i, time.time() - 50 + i))
    again = _tier(tmp_path, capacity_pages=3)
    assert again.read(keys[0]) is not None
    extra = _keys(4)[3]
    again.write(extra, _page(3))
    assert not again.contains(keys[1]) and again.contains(keys[0]) and again.contains(extra)


def test_capacity_evicts_least_recently_used(tmp_path: Path) -> None:
    tier = _tier(tmp_path, capacity_pages=2)
    a, b, c = _keys(3)
    tier.write(a, _page(0))
    tier.write(b, _page(1))
    assert tier.read(a) is not None  # a is now more recent than b
    tier.write(c, _page(2))
    assert tier.contains(a) and tier.contains(c) and not tier.contains(b)
    assert not (tmp_path / b.hex()).exists()
    assert len(tier) == 2 and tier.total_bytes <= tier.capacity_bytes
    assert tier.stats().files_evicted == 1
    # a capacity below one page stores nothing
    tiny = DiskKVTier(
        tmp_path / "tiny",
        capacity_bytes=10,
        root=ROOT,
        page_layout=POOL.page_layout,
        page_bytes=POOL.page_bytes,
    )
    assert not tiny.write(a, _page(0)) and not tiny.contains(a)


def test_restart_with_smaller_capacity_evicts(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    for i, key in enumerate(_keys(4)):
        tier.write(key, _page(i))
    again = _tier(tmp_path, capacity_pages=2)
    assert len(again) == 2 and len(list(tmp_path.glob("[0-9a-f]*"))) == 2


def test_bad_files_are_rejected_never_served(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    truncated, corrupt, foreign, junk, shape, header, good = _keys(7)
    for i, key in enumerate((truncated, corrupt, foreign, shape, header, good)):
        tier.write(key, _page(i))
    path = lambda key: tmp_path / key.hex()  # noqa: E731

    blob = path(truncated).read_bytes()
    path(truncated).write_bytes(blob[: len(blob) - 7])
    blob = bytearray(path(corrupt).read_bytes())
    blob[-5] ^= 0x40  # one flipped bit in the payload
    path(corrupt).write_bytes(bytes(blob))
    other = DiskKVTier(
        tmp_path / "other",
        capacity_bytes=1 << 30,
        root=model_root("other"),
        page_layout=POOL.page_layout,
        page_bytes=POOL.page_bytes,
    )
    other.write(foreign, _page(9))  # another model's file under our key's name
    os.replace(tmp_path / "other" / foreign.hex(), path(foreign))
    latent_only = PagedKVPool(3, 1, KVCacheSpec.latent(12, "float32", PS))  # same bytes, another layout
    assert latent_only.page_bytes == POOL.page_bytes
    wide = DiskKVTier(
        tmp_path / "wide",
        capacity_bytes=1 << 30,
        root=ROOT,
        page_layout=latent_only.page_layout,
        page_bytes=latent_only.page_bytes,
    )
    wide.write(shape, _page(8))
    os.replace(tmp_path / "wide" / shape.hex(), path(shape))
    path(junk).write_bytes(os.urandom(tier.file_bytes))  # valid-looking name, random bytes
    tier.contains(junk)  # adopted into the index
    blob = bytearray(path(header).read_bytes())
    blob[0:8] = b"NOTMAGIC"
    path(header).write_bytes(bytes(blob))

    bad = (truncated, corrupt, foreign, junk, shape, header)
    for key in bad:
        assert tier.read(key) is None
        assert not path(key).exists(), "a bad file is deleted"
        assert not tier.contains(key)
    assert tier.stats().files_rejected == len(bad)
    got = tier.read(good)
    assert got is not None and torch.equal(got, _page(5))
    assert len(tier) == 1 and tier.total_bytes == tier.file_bytes

    # a restarted tier also rejects what it finds: empty file, junk under a key name
    path(truncated).write_bytes(b"")
    path(junk).write_bytes(b"\x00" * 3)
    again = _tier(tmp_path)
    assert again.read(truncated) is None and again.read(junk) is None
    assert again.stats().files_rejected == 2


def test_missing_file_is_a_plain_miss(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    key = _keys(1)[0]
    tier.write(key, _page(0))
    (tmp_path / key.hex()).unlink()  # e.g. evicted by another process sharing the directory
    assert tier.read(key) is None
    assert tier.stats().files_rejected == 0 and len(tier) == 0


def test_file_written_by_another_process_is_found(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    other = _tier(tmp_path)
    key = _keys(1)[0]
    other.write(key, _page(0))
    assert not tier.is_indexed(key) and tier.contains(key)
    got = tier.read(key)
    assert got is not None and torch.equal(got, _page(0))


def test_a_shared_directory_has_one_id_and_one_cap(tmp_path: Path) -> None:
    """Two processes' tiers over one directory: the same id (another directory: another id), and
    a writer that rescans evicts the other's files too, oldest first, so the cap holds jointly."""
    shared, other = (
        _tier(tmp_path / "d", capacity_pages=3, rescan_seconds=0),
        _tier(tmp_path / "d", capacity_pages=3),
    )
    assert shared.tier_id == other.tier_id != _tier(tmp_path / "e").tier_id
    keys = _keys(5)
    for i, key in enumerate(keys[:3]):
        other.write(key, _page(i))
        os.utime(tmp_path / "d" / key.hex(), (1000.0 + i, 1000.0 + i))  # written in this order
    shared.write(keys[3], _page(3))
    shared.write(keys[4], _page(4))
    left = sorted(p.name for p in (tmp_path / "d").glob("[0-9a-f]*"))
    assert left == sorted(k.hex() for k in (keys[2], keys[3], keys[4]))
    assert len(shared) == 3 and shared.stats().files_evicted == 2
    assert other.read(keys[0]) is None and other.read(keys[2]) is not None


def _version1_file(key: bytes, payload: bytes) -> bytes:
    """A page file as format version 1 wrote it: one latent cache, its shape and dtype in the header."""
    header = struct.Struct("<8sHH16sB32s3I16sQ32s")
    return (
        header.pack(
            b"DSKVPAGE",
            1,
            header.size,
            hashlib.blake2b(ROOT, digest_size=16).digest(),
            len(key),
            key,
            3,
            PS,
            len(payload) // (3 * PS * 4),
            b"float32",
            len(payload),
            hashlib.blake2b(payload, digest_size=32).digest(),
        )
        + payload
    )


def test_version1_files_are_rejected_cleanly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Files of the format before the cache spec (same model, same page size) are counted, deleted
    and reported as a miss; the tier keeps serving and rewrites the page in the new format."""
    key = _keys(1)[0]
    (tmp_path / key.hex()).write_bytes(_version1_file(key, bytes(_page(3))))
    tier = _tier(tmp_path)
    assert tier.contains(key)
    with caplog.at_level(logging.WARNING, logger="dsinfer.cache.disk_tier"):
        assert tier.read(key) is None
    assert "format version 1 (expected 2)" in caplog.text
    assert not (tmp_path / key.hex()).exists() and tier.stats().files_rejected == 1
    assert tier.write(key, _page(3)) and torch.equal(tier.read(key), _page(3))
