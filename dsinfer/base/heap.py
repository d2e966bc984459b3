"""Handing freed heap memory back to the operating system (glibc's allocator).

After a burst (a thousand streams, multi-megabyte prompts) the gateway frees what it held, but
glibc keeps the pages: its threshold for serving large blocks by ``mmap`` rises to the largest
block freed (so later multi-megabyte bodies come from the heap), and free pages inside the heaps
of its arenas (one per thread that allocated) stay mapped. ``pin_mmap_threshold`` fixes that
threshold, so every large block is unmapped when freed; ``trim`` (``malloc_trim(0)``) returns the
free pages of every arena. Elsewhere than glibc both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger("dsinfer")

M_MMAP_THRESHOLD = -3  # mallopt parameter numbers (malloc.h)
MMAP_THRESHOLD = 1 << 20  # blocks of 1 MiB and more are mapped, and unmapped when freed


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim, libc.mallopt  # noqa: B018 - glibc has both; musl and others lack them
    except (OSError, AttributeError):
        return None
    return libc


def pin_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Serve blocks of ``threshold`` bytes and more by mmap for good -> whether glibc took it."""
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, threshold))


def trim() -> bool:
    """Return every arena's free pages to the OS -> whether any memory was released."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))
