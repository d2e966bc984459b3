"""Rank child processes of a benchmark's pool: started, and killed on every exit path.

Shared by eplb_stall.py and overlap.py (run as scripts: this folder is on sys.path).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
from pathlib import Path
from types import TracebackType

from dsinfer.base.processes import die_with_parent as die_with_parent
from dsinfer.base.processes import free_port as free_port


def exit_on_sigterm() -> None:
    """In the parent: SIGTERM raises SystemExit, so every ``with RankChildren()`` kills its ranks."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


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
