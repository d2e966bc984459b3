"""Loads of prefix-cache pages from the tiers below the pool, on a background thread.

A load reads one page's record from the host-memory or the disk tier (the disk tier validates it)
and, where the pool allows writes from another thread (``PagePool.page_writes_off_thread``),
writes it into the pool page the caller took for it. The pages being written belong to no
sequence, so no step reads them; on a CUDA pool the copy runs on the loader's own stream, which
the loader waits for before it reports the load done. The caller (the KV cache manager, on the
scheduler's thread) submits loads and collects finished ones with ``completed``; it never waits
for one, so a slow tier delays only the requests whose pages it holds, never the step (and never
the other ranks of a pool stepping in lockstep with this one).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsinfer.cache.kv_pool import PagedKVPool, PagePool

logger = logging.getLogger(__name__)


@dataclass
class PageLoad:
    key: bytes
    page: int  # the pool page the record goes into (referenced by the caller until it is done)
    tier: str  # "host" or "disk"
    read: Callable[[], torch.Tensor | None]  # the record, or None when the tier no longer has it
    data: torch.Tensor | None = None  # the record, when the caller must still write it
    written: bool = False  # written into the pool page by the loader
    nbytes: int = 0
    seconds: float = 0.0  # from submission to done

    @property
    def ok(self) -> bool:
        return self.written or self.data is not None


class TierLoader:
    def __init__(self, pool: PagePool) -> None:
        """Finished loads carry their ``data`` for the caller to write where ``pool`` takes
        writes on the caller's thread only."""
        self._write_page: Callable[[int, torch.Tensor], None] | None = None
        self._stream: torch.cuda.Stream | None = None
        if isinstance(pool, PagedKVPool) and pool.page_writes_off_thread:
            self._write_page = pool.write_page
            self._stream = torch.cuda.Stream(pool.device) if pool.device.type == "cuda" else None
        self._jobs: queue.SimpleQueue[tuple[PageLoad, float] | None] = queue.SimpleQueue()
        self._done: list[PageLoad] = []
        self._cond = threading.Condition()
        self.pending = 0  # submitted and not yet collected (the caller's thread only)
        self._thread = threading.Thread(target=self._run, name="dsinfer-kv-tier-loader", daemon=True)
        self._thread.start()

    def submit(self, load: PageLoad) -> None:
        self.pending += 1
        self._jobs.put((load, time.perf_counter()))

    def completed(self) -> list[PageLoad]:
        """The loads finished since the last call (never waits)."""
        with self._cond:
            done, self._done = self._done, []
        self.pending -= len(done)
        return done

    def wait(self, timeout: float) -> None:
        """Wait until a load is done to collect, or ``timeout`` seconds (idle callers only)."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._done), timeout)

    def stop(self) -> None:
        """Ends the thread once the loads queued before are done (idempotent)."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    def _run(self) -> None:
        for load, submitted in iter(self._jobs.get, None):  # type: ignore[misc]
            try:
                self._load(load)
            except Exception:  # a bad load is a miss; the thread serves the next one
                logger.exception("KV tier loader: loading a page from the %s tier failed", load.tier)
                load.data, load.written = None, False
            load.seconds = time.perf_counter() - submitted
            with self._cond:
                self._done.append(load)
                self._cond.notify_all()

    def _load(self, load: PageLoad) -> None:
        data = load.read()
        if data is None:
            return
        load.nbytes = data.numel()
        if self._write_page is None:
            load.data = data
        elif self._stream is not None:
            with torch.cuda.stream(self._stream):
                self._write_page(load.page, data)
            self._stream.synchronize()
            load.written = True
        else:
            self._write_page(load.page, data)
            load.written = True
