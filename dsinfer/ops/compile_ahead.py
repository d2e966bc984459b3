"""Compiling the CPU kernels (numba) before the first forward, shared by the processes of a machine.

A kernel compiles in seconds (``mla_cpu._decode`` about 14 s of one core, ``experts_cpu._experts``
about 9 s) and lands in numba's on-disk cache, where every later process loads it in well under a
second. On a fresh install every rank of a machine starts with an empty cache; left alone, each
would compile every kernel itself, all at once on the same cores. Instead each process takes the
kernels one at a time under a per-kernel file lock: a kernel another process is compiling is
skipped for one whose lock is free, and taken last (by then it is in the cache). Two ranks thus
compile the two kernels side by side, and the first start waits for the slowest kernel only.

The compiled code is the same whoever compiles it: the signature is the one the entry point
always calls the kernel with (``compile_ahead`` of each module), and numba's cache is keyed by
the kernel's source, so a warm start loads what the first start compiled.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numba

log = logging.getLogger("dsinfer.ops")

Compile = Callable[[], None]


def c_array(dtype: numba.types.Type, ndim: int) -> numba.types.Array:
    """The numba type of a C-contiguous numpy array (what the entry points pass their kernels)."""
    return numba.types.Array(dtype, ndim, "C")


def lock_dir() -> Path:
    """Where the per-kernel locks live: one directory per user of the machine."""
    path = Path(tempfile.gettempdir()) / f"dsinfer-kernel-locks-{os.getuid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def compile_shared(kernels: Mapping[str, Compile], locks: Path | None = None) -> None:
    """Run every ``kernels[name]()`` once in this process, each under its file lock in ``locks``;
    a kernel whose lock another process holds waits until every free one is done."""
    locks = lock_dir() if locks is None else locks
    remaining = dict(kernels)
    while remaining:
        name = next((n for n in remaining if _run_locked(locks / f"{n}.lock", remaining[n], False)), None)
        if name is None:  # all held by other processes: wait for one, then load it from the cache
            name = next(iter(remaining))
            _run_locked(locks / f"{name}.lock", remaining[name], True)
        del remaining[name]


def _run_locked(path: Path, compile_kernel: Compile, wait: bool) -> bool:
    with path.open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            return False
        try:
            start = time.monotonic()
            compile_kernel()
            log.debug("kernel %s ready in %.1f s", path.stem, time.monotonic() - start)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return True
