"""Chrome trace of a rank's forward steps: compute spans per stage chunk, communication spans.

One JSON file per rank (``{"traceEvents": [...]}``, complete events ``ph: "X"`` with ``ts`` and
``dur`` in microseconds of ``time.perf_counter_ns``, the machine's monotonic clock, so the files
of the ranks of one machine line up), ``pid`` = rank, ``tid`` = ``"compute"`` or ``"comm"``.
Events are buffered and appended every ``flush_every`` steps and at ``close``; the file is valid
JSON after every flush. Open it in chrome://tracing or Perfetto.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

COMPUTE = "compute"
COMM = "comm"
_CLOSING = b"\n]}\n"


def now_ns() -> int:
    return time.perf_counter_ns()


class Tracer:
    def __init__(self, path: Path, pid: int, *, flush_every: int = 50) -> None:
        self.path, self.pid, self.flush_every = Path(path), pid, flush_every
        self.step = 0
        self._events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": COMPUTE, "args": {"name": f"rank {pid}"}},
            *(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": tid}}
                for tid in (COMPUTE, COMM)
            ),
        ]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("wb")
        self._file.write(b'{"traceEvents": [\n')
        self._end = self._file.tell()
        self._first = True
        self._steps_since_flush = 0
        self.flush()

    def add(
        self, name: str, tid: str, start_ns: int, end_ns: int, *, cat: str | None = None, **args: Any
    ) -> None:
        """One complete span; ``args`` go to the event's args (the step index is added)."""
        self._events.append(
            {
                "ph": "X",
                "name": name,
                "cat": cat or tid,
                "pid": self.pid,
                "tid": tid,
                "ts": start_ns / 1e3,
                "dur": max(end_ns - start_ns, 0) / 1e3,
                "args": {"step": self.step, **args},
            }
        )

    @contextmanager
    def span(
        self, name: str, tid: str = COMPUTE, *, cat: str | None = None, **args: Any
    ) -> Iterator[dict[str, Any]]:
        """Times the block; the yielded dict may receive more args before it ends."""
        extra: dict[str, Any] = {}
        start = now_ns()
        try:
            yield extra
        finally:
            self.add(name, tid, start, now_ns(), cat=cat, **args, **extra)

    def end_step(self) -> None:
        self.step += 1
        self._steps_since_flush += 1
        if self._steps_since_flush >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if self._file.closed:
            return
        self._steps_since_flush = 0
        self._file.seek(self._end)
        if self._events:
            body = ",\n".join(json.dumps(e, separators=(",", ":")) for e in self._events)
            self._file.write((body if self._first else ",\n" + body).encode())
            self._first = False
            self._end = self._file.tell()
            self._events.clear()
        self._file.write(_CLOSING)
        self._file.truncate()
        self._file.flush()

    def close(self) -> None:
        self.flush()
        self._file.close()


def load_trace(path: Path) -> list[dict[str, Any]]:
    """The complete events of a trace file written by :class:`Tracer`."""
    return [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X"]
