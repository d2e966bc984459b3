"""Progress of a long run: one line per event, with the seconds since the run started."""

from __future__ import annotations

import sys
import time

T0 = time.monotonic()


def progress(msg: str) -> None:
    """``[  12.3s] msg`` on stdout, flushed."""
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def log(msg: str) -> None:
    """``msg`` on stderr, flushed (where a command's stdout is its result)."""
    print(msg, file=sys.stderr, flush=True)
