"""The disk tier's writer: one background thread writing page snapshots, fed by a bounded queue."""

from __future__ import annotations

import logging
import queue
import threading

import torch

from dsinfer.cache.disk_tier import DiskKVTier

logger = logging.getLogger(__name__)


class DiskWriter:
    """One background thread writing page snapshots to the disk tier.

    Shared with the caller's thread: the queue, and a pending count under a condition for flush.
    """

    def __init__(self, disk: DiskKVTier, max_pending: int) -> None:
        self.disk = disk
        self._queue: queue.Queue[tuple[bytes, torch.Tensor] | None] = queue.Queue(max_pending)
        self._idle = threading.Condition()
        self._pending = 0
        self.failed = 0  # written by the writer thread only
        self._thread = threading.Thread(target=self._run, name="dsinfer-kv-disk-writer", daemon=True)
        self._thread.start()
        self.stopped = False

    def has_room(self) -> bool:
        return not self.stopped and not self._queue.full()

    def submit(self, key: bytes, data: torch.Tensor) -> bool:
        with self._idle:
            self._pending += 1
        try:
            self._queue.put_nowait((key, data))
        except queue.Full:
            self._done()
            return False
        return True

    def flush(self, timeout: float) -> None:
        with self._idle:
            if not self._idle.wait_for(lambda: self._pending == 0, timeout):
                raise TimeoutError(f"{self._pending} KV page writes still pending after {timeout} s")

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self._queue.put(None)
            self._thread.join()

    def _done(self) -> None:
        with self._idle:
            self._pending -= 1
            if self._pending == 0:
                self._idle.notify_all()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            key, data = item
            try:
                if not self.disk.contains(key) and not self.disk.write(key, data):
                    self.failed += 1
            except Exception:  # keep the thread alive: one bad write must not stop the tier
                logger.exception("disk KV tier: write failed")
                self.failed += 1
            finally:
                self._done()
