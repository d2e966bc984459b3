"""What every stage shares: its context (where to write, how long it may take, CPU smoke or GPU),
its result (pass, fail or skip, with figures and checks) and small helpers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULT_FILE = "result.json"
STATUSES = ("pass", "fail", "skip")


@dataclass(frozen=True)
class StageContext:
    """``out``: this stage's folder; ``budget_s``: its time limit (the kit kills it after that);
    ``cpu_smoke``: tiny sizes on the CPU (the plumbing only); ``device``: "cuda" or "cpu"."""

    name: str
    out: Path
    budget_s: float
    cpu_smoke: bool
    device: str

    def deadline(self, fraction: float = 0.9) -> float:
        """A monotonic time by which the stage should wrap up (a share of its budget)."""
        return time.monotonic() + self.budget_s * fraction

    @classmethod
    def from_json(cls, text: str) -> StageContext:
        data = json.loads(text)
        return cls(data["name"], Path(data["out"]), data["budget_s"], data["cpu_smoke"], data["device"])

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "out": str(self.out)})


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class StageResult:
    """One stage's outcome. ``status`` is derived unless ``skipped`` names why the stage did not run:
    fail when a check failed, else pass."""

    stage: str
    summary: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    skipped: str | None = None
    error: str | None = None
    seconds: float = 0.0
    partial: bool = False  # written before the stage ended: it was killed at its limit
    autosave: Path | None = field(default=None, repr=False)  # where each check saves a partial result

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, bool(ok), detail))
        if self.autosave is not None:  # a stage killed at its limit keeps what it checked
            self.partial = True
            self.write(self.autosave)
            self.partial = False
        return bool(ok)

    @property
    def status(self) -> str:
        if self.error is not None or any(not c.ok for c in self.checks):
            return "fail"
        return "skip" if self.skipped is not None else "pass"

    def to_dict(self) -> dict[str, Any]:
        data = {**asdict(self), "status": self.status}
        data.pop("autosave")
        return data

    def write(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / (RESULT_FILE + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, default=str) + "\n")
        tmp.replace(out / RESULT_FILE)


def log(msg: str) -> None:
    print(f"gpu-check: {msg}", file=sys.stderr, flush=True)


def run_logged(
    argv: list[str], log_path: Path, timeout: float, env: dict[str, str] | None = None
) -> tuple[int | None, str]:
    """Run ``argv`` from the repository root in its own session, output to ``log_path``; kill the
    whole session after ``timeout`` s. -> (exit code or None on timeout, the log's last 3,000 chars)."""
    with log_path.open("wb") as out:
        process = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        try:
            code: int | None = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            kill_session(process)
    return code, log_path.read_text(errors="replace")[-3000:]


def kill_session(process: subprocess.Popen[bytes]) -> None:
    """Kill ``process``'s session (it was started with ``start_new_session``) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


@contextlib.contextmanager
def timed(result: StageResult, key: str) -> Iterator[None]:
    """Seconds of the block into ``result.figures[key]``."""
    start = time.monotonic()
    try:
        yield
    finally:
        result.figures[key] = round(time.monotonic() - start, 3)
