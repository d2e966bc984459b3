"""On-disk tier of the prefix cache: one content-addressed file per KV page (all layers and caches).

A file is named by the page key's hex (see ``dsinfer.base.hashing``) and holds a fixed header
then the raw page bytes (``PagedKVPool.read_page``)::

    magic | format version | header size | blake2b(root) | key | blake2b(page layout)
    | payload length | blake2b-256 of the payload | payload

The page layout (``PagedKVPool.page_layout``: layers, tokens per page, and each cache's width and
dtype, V3.2's indexer keys included) must match the reader's exactly. Version 1 files (one latent
cache, its shape and dtype in the header) are rejected as any foreign file is.

Writes are atomic (temporary file in the same directory, then ``os.replace``), so a reader sees
either the whole old file, the whole new one, or none. A read validates everything before it
serves a page: a truncated, corrupt or foreign file (other model root, shape, dtype or magic) is
counted, deleted and reported as a miss; ``read`` never raises and never returns a bad page.

The directory is capped at ``capacity_bytes``; the least recently used file (written or read)
goes first. The order lives in memory and is rebuilt at start-up from the files' mtimes (reads
touch the mtime), so a restarted process reuses what an earlier one wrote.

Several processes may share a directory (every rank of a server, or of a cluster on a shared
filesystem: the cluster-wide tier). Each keeps its own index and adopts files others wrote when it
looks them up; a writer rescans the directory at most every ``rescan_seconds`` and then evicts by
mtime over every file, its own or not, so the cap holds jointly (two processes may evict the same
file: one unlink fails, harmlessly; a reader that opened a file before it was unlinked still reads
it whole). ``tier_id`` names the directory itself, not its path: it is read from (or, first,
created in) the directory's ``.tier-id`` file, so ranks that report the same id share their pages,
and two nodes mounting different disks at the same path do not.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MAGIC = b"DSKVPAGE"
FORMAT_VERSION = 2
MAX_KEY_BYTES = 32
_PREFIX = struct.Struct("<8sHH")  # magic, version, header size: the same in every version
# magic, version, header size, root digest, key length, key, layout digest, payload length, checksum
_HEADER = struct.Struct("<8sHH16sB32s16sQ32s")
_NAME = re.compile(r"^(?:[0-9a-f]{2}){1,32}$")
_TMP_SUFFIX = ".tmp"
_STALE_TMP_SECONDS = 300.0
_TIER_ID_FILE = ".tier-id"


@dataclass
class DiskTierStats:
    files: int
    bytes: int
    pages_written: int
    pages_read: int
    files_rejected: int
    files_evicted: int
    write_errors: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class DiskKVTier:
    def __init__(
        self,
        directory: str | Path,
        *,
        capacity_bytes: int,
        root: bytes,
        page_layout: str,
        page_bytes: int,
        rescan_seconds: float = 10.0,
    ) -> None:
        """``page_layout`` and ``page_bytes``: the pool's (``PagedKVPool.page_layout`` and
        ``page_bytes``); a file written for another layout is rejected."""
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.root = bytes(root)
        self.page_layout = page_layout
        self.payload_bytes = page_bytes
        self.file_bytes = _HEADER.size + self.payload_bytes
        self._root_digest = hashlib.blake2b(self.root, digest_size=16).digest()
        self._layout_digest = hashlib.blake2b(page_layout.encode(), digest_size=16).digest()
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key hex -> file size, LRU first
        self._total = 0
        self._counts = dict.fromkeys(("written", "read", "rejected", "evicted", "write_errors"), 0)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.tier_id = _tier_id(self.directory)
        self.rescan_seconds = rescan_seconds
        self._scan()
        self._scanned_at = time.monotonic()

    # Public API ------------------------------------------------------------------------------
    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return self._total

    def stats(self) -> DiskTierStats:
        with self._lock:
            c = self._counts
            return DiskTierStats(
                files=len(self._index),
                bytes=self._total,
                pages_written=c["written"],
                pages_read=c["read"],
                files_rejected=c["rejected"],
                files_evicted=c["evicted"],
                write_errors=c["write_errors"],
            )

    def is_indexed(self, key: bytes) -> bool:
        """Whether this process knows a file for ``key`` (no I/O)."""
        with self._lock:
            return key.hex() in self._index

    def contains(self, key: bytes) -> bool:
        """Whether a file for ``key`` exists (known, or written by another process since start-up).

        The file is not validated here; ``read`` does that.
        """
        name = key.hex()
        with self._lock:
            if name in self._index:
                return True
        try:
            size = (self.directory / name).stat().st_size
        except OSError:
            return False
        with self._lock:
            if name not in self._index:
                self._index[name] = size
                self._total += size
        return True

    def write(self, key: bytes, data: torch.Tensor) -> bool:
        """Store one page (uint8 ``[page_bytes]``). False when it was not stored (larger than the
        whole capacity, or an I/O error: counted, logged, not raised)."""
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"page key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
        if data.dtype != torch.uint8 or tuple(data.shape) != (self.payload_bytes,):
            raise ValueError(
                f"page of {data.dtype} {tuple(data.shape)} does not fit this tier (uint8 ({self.payload_bytes},))"
            )
        if self.file_bytes > self.capacity_bytes:
            return False
        payload = data.detach().to("cpu").contiguous().numpy()
        header = self._header(key, hashlib.blake2b(payload, digest_size=32).digest())
        name = key.hex()
        path = self.directory / name
        tmp = self.directory / f".{name}.{os.getpid()}.{threading.get_ident()}{_TMP_SUFFIX}"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            logger.warning("disk KV tier: could not write %s: %s", path, e)
            _unlink(tmp)
            with self._lock:
                self._counts["write_errors"] += 1
            return False
        with self._lock:
            self._total += self.file_bytes - self._index.pop(name, 0)
            self._index[name] = self.file_bytes
            self._counts["written"] += 1
            victims = self._evict_over_capacity()
        for victim in victims:  # outside the lock: lookups from other threads never wait on unlink
            _unlink(victim)
        if time.monotonic() - self._scanned_at >= self.rescan_seconds:
            self._scanned_at = time.monotonic()
            self._scan()  # adopt what other processes wrote, so that the cap holds jointly
        return True

    def read(self, key: bytes) -> torch.Tensor | None:
        """The page stored under ``key`` (a CPU uint8 tensor), or None when absent or bad."""
        name = key.hex()
        path = self.directory / name
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                blob = bytearray(size)
                got = f.readinto(blob)
        except FileNotFoundError:
            with self._lock:
                self._total -= self._index.pop(name, 0)
            return None
        except OSError as e:
            self._reject(name, f"unreadable ({e})")
            return None
        page, problem = self._decode(key, blob, got)
        if page is None:
            self._reject(name, problem)
            return None
        with self._lock:
            self._total += size - self._index.pop(name, 0)
            self._index[name] = size
            self._counts["read"] += 1
        with contextlib.suppress(OSError):
            os.utime(path)  # the LRU order survives a restart
        return page

    # Internals -------------------------------------------------------------------------------
    def _header(self, key: bytes, checksum: bytes) -> bytes:
        return _HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            _HEADER.size,
            self._root_digest,
            len(key),
            key,
            self._layout_digest,
            self.payload_bytes,
            checksum,
        )

    def _decode(self, key: bytes, blob: bytearray, got: int) -> tuple[torch.Tensor | None, str]:
        if got != len(blob) or len(blob) < _PREFIX.size:
            return None, f"truncated ({len(blob)} bytes)"
        magic, version, header_size = _PREFIX.unpack_from(blob)
        if magic != MAGIC:
            return None, "not a dsinfer KV page (bad magic)"
        if version != FORMAT_VERSION or header_size != _HEADER.size:
            return None, f"format version {version} (expected {FORMAT_VERSION})"
        if len(blob) < _HEADER.size:
            return None, f"truncated ({len(blob)} bytes)"
        _, _, _, root, key_len, stored_key, layout, length, checksum = _HEADER.unpack_from(blob)
        if root != self._root_digest:
            return None, "written for another model root"
        if stored_key[:key_len] != key or key_len != len(key):
            return None, "holds another page key"
        if layout != self._layout_digest:
            return None, f"written for another page layout (expected {self.page_layout})"
        if length != self.payload_bytes or len(blob) - _HEADER.size != length:
            return None, f"truncated payload ({len(blob) - _HEADER.size} of {self.payload_bytes} bytes)"
        payload = memoryview(blob)[_HEADER.size :]
        if hashlib.blake2b(payload, digest_size=32).digest() != checksum:
            return None, "payload checksum mismatch"
        return torch.frombuffer(blob, dtype=torch.uint8, offset=_HEADER.size, count=length), ""

    def _reject(self, name: str, problem: str) -> None:
        logger.warning("disk KV tier: rejected %s: %s", self.directory / name, problem)
        _unlink(self.directory / name)
        with self._lock:
            self._total -= self._index.pop(name, 0)
            self._counts["rejected"] += 1

    def _evict_over_capacity(self) -> list[Path]:
        """Drop least recently used files from the index until under the cap (caller holds the
        lock) and return their paths, for the caller to delete after releasing the lock. After a
        write the new file, most recent and no larger than the cap, is never the one dropped."""
        victims = []
        while self._total > self.capacity_bytes and self._index:
            name, size = self._index.popitem(last=False)
            self._total -= size
            self._counts["evicted"] += 1
            victims.append(self.directory / name)
        return victims

    def _scan(self) -> None:
        """Rebuild the LRU index from the files present, oldest mtime first, and evict over the cap."""
        found: list[tuple[float, str, int]] = []
        now = time.time()
        with os.scandir(self.directory) as entries:
            for entry in entries:
                try:
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if entry.name.startswith(".") and entry.name.endswith(_TMP_SUFFIX):
                    if now - st.st_mtime > _STALE_TMP_SECONDS:  # left by a crashed writer
                        _unlink(Path(entry.path))
                elif _NAME.match(entry.name):
                    found.append((st.st_mtime, entry.name, st.st_size))
        found.sort()
        with self._lock:
            self._index.clear()
            self._total = 0
            for _, name, size in found:
                self._index[name] = size
                self._total += size
            victims = self._evict_over_capacity()
        for victim in victims:
            _unlink(victim)


def _tier_id(directory: Path) -> str:
    """The directory's id: whichever process comes first links a written file into place."""
    path = directory / _TIER_ID_FILE
    if not path.exists():
        tmp = directory / f"{_TIER_ID_FILE}.{os.getpid()}.{threading.get_ident()}{_TMP_SUFFIX}"
        tmp.write_text(os.urandom(8).hex())
        try:
            os.link(tmp, path)  # atomic, and never replaces an id another process put there
        except FileExistsError:
            pass
        finally:
            _unlink(tmp)
    return path.read_text().strip()


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
