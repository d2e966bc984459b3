"""Rank child processes of a benchmark's pool: started, and killed on every exit path.

Shared by eplb_stall.py and overlap.py (run as scripts: this folder is on sys.path).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
from pathlib import Path
from types import TracebackType


def die_with_parent() -> None:
    """In a child, Linux: SIGKILL this process when the parent dies, so no rank outlives the benchmark."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:
            os._exit(1)


def exit_on_sigterm() -> None:
    """In the parent: SIGTERM raises SystemExit, so every ``with RankChildren()`` kills its ranks."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankChildren:
    """The rank processes of one pool run; leaving the ``with`` block kills those still running."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd)
        self.procs.append(proc)
        return proc

    def __enter__(self) -> RankChildren:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
