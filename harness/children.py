"""A child process spoken to in JSON lines: requests on its stdin, answers on stdout lines that start
with a mark (other lines there, a library's own log, are passed over). Every wait is bounded; the
child is killed by ``kill`` (or leaving the ``with`` block)."""

from __future__ import annotations

import json
import queue
import subprocess
import threading
from typing import Any


def say(mark: str, message: Any) -> None:
    """In the child: one answer."""
    print(mark + json.dumps(message), flush=True)


class JsonLinesChild:
    """``cmd`` started with pipes; ``recv`` waits at most ``timeout`` s for its next answer."""

    def __init__(self, cmd: list[str], mark: str, timeout: float) -> None:
        self.mark, self.timeout = mark, timeout
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._lines: queue.Queue[Any] = queue.Queue()
        threading.Thread(target=self._read, name=f"stdout of {cmd[-1]}", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(self.mark):
                self._lines.put(json.loads(line[len(self.mark) :]))
        self._lines.put(None)  # its stdout ended: it exited

    def recv(self) -> Any:
        try:
            message = self._lines.get(timeout=self.timeout)
        except queue.Empty:
            raise TimeoutError(
                f"child process {self.proc.pid} said nothing for {self.timeout:.0f} s"
            ) from None
        if message is None:
            raise RuntimeError(
                f"child process {self.proc.pid} exited with status {self.proc.wait(timeout=self.timeout)}"
            )
        return message

    def send(self, message: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def ask(self, message: Any) -> Any:
        self.send(message)
        return self.recv()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=self.timeout)

    def __enter__(self) -> JsonLinesChild:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
