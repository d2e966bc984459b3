"""Child processes: started so that none outlives its parent, their stderr relayed, stopped within
a bound, restarted with a back-off.

The pool launcher (dsinfer/workers/launcher.py) runs its ranks with these, the all-in-one server
(dsinfer/cli/serve_all_in_one.py) its gateway and pool launchers, the tests and benchmarks their
servers.

A child runs in its own session: a terminal's Ctrl-C reaches only its parent, which stops it in
order. On Linux it also asks the kernel, between fork and exec, for SIGKILL when the process that
started it dies (``PR_SET_PDEATHSIG``): it dies with a parent that is SIGKILLed.

A ``Child``'s stderr passes through its parent's as it comes (progress bars included) and its
last lines are kept, so that the parent can tell in one line why it failed (``error_detail``) and
see the line that says it is ready. Its ``dsinfer: error:`` lines are held back: the parent
reports one of them itself (once) or releases them.

Exit status ``STARTUP_FAILED`` (2, as for a bad flag) says a process failed before it was ever
ready: starting it again would fail alike, so its supervisor stops instead of restarting it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import BinaryIO

KILL_GRACE = 5.0  # seconds between SIGTERM and SIGKILL
MAX_BACKOFF = 30.0  # cap of the doubling restart back-off
HEALTHY_RESET = 60.0  # a process that ran this long since its last start resets its back-off
STARTUP_FAILED = 2  # exit status: failed before it was ever ready (a restart would fail alike)
ERROR_PREFIX = "dsinfer: error: "

_PR_SET_PDEATHSIG = 1
_TCP_LISTEN = "0A"  # the state column of /proc/net/tcp
_TAIL_LINES = 200
_WAIT_STEP = 0.05
_ERROR_PREFIX_BYTES = ERROR_PREFIX.encode()
_LOGGED_ERROR = (
    re.compile(r"^\S+ \S+ (?:ERROR|CRITICAL) [\w.]+: (?P<message>.+)$"),  # dsinfer's log format
    re.compile(r"^(?:ERROR|CRITICAL):\s+(?P<message>.+)$"),  # uvicorn's
)
_STDERR_LOCK = threading.Lock()

_Procs = Sequence[subprocess.Popen[bytes]]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# Starting ----------------------------------------------------------------------------------------
@functools.cache
def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(parent_pid: int | None = None) -> None:
    """In a child: SIGKILL this process when its parent dies (Linux; elsewhere nothing).

    ``parent_pid``: the process that started this one, to catch its death before the request
    took effect; without it, being orphaned (parent pid 1) says so."""
    prctl = _prctl()
    if prctl is None:
        return
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    parent = os.getppid()
    if parent == 1 or (parent_pid is not None and parent != parent_pid):
        os.kill(os.getpid(), signal.SIGKILL)


def spawn(
    cmd: Sequence[str], env: dict[str, str] | None = None, *, stderr: int | None = None
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in a session of its own, dying with this process."""
    _prctl()  # loaded here: between fork and exec the child only calls it
    return subprocess.Popen(
        list(cmd),
        env=env,
        stderr=stderr,
        start_new_session=True,
        preexec_fn=functools.partial(die_with_parent, os.getpid()),
    )


# Stopping ----------------------------------------------------------------------------------------
def send(procs: _Procs, sig: int, *, group: bool = False) -> None:
    """``sig`` to every process still running (``group``: to its whole process group)."""
    for proc in procs:
        if proc.poll() is None:
            if group:
                _signal_group(proc, sig)
            else:
                proc.send_signal(sig)


def wait_all(procs: _Procs, timeout: float, cut_short: Callable[[], bool] | None = None) -> bool:
    """Poll until every process exited (-> True), or ``timeout`` s passed or ``cut_short()``
    says stop waiting (-> False)."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() >= deadline or (cut_short is not None and cut_short()):
            return False
        time.sleep(min(_WAIT_STEP, max(0.0, deadline - time.monotonic())))
    return True


def kill(procs: _Procs) -> None:
    """SIGKILL every process not reaped yet, with the rest of its process group; reap them all."""
    for proc in procs:
        if proc.returncode is None:
            _signal_group(proc, signal.SIGKILL)
    for proc in procs:
        proc.wait()


def terminate(
    procs: _Procs,
    grace: float = KILL_GRACE,
    sig: int = signal.SIGTERM,
    *,
    group: bool = False,
    cut_short: Callable[[], bool] | None = None,
) -> bool:
    """``sig`` to every live process, up to ``grace`` s (less if ``cut_short()``) for all to
    exit, then ``kill`` the rest. True if all exited within the grace."""
    send(procs, sig, group=group)
    exited = wait_all(procs, grace, cut_short)
    kill(procs)
    return exited


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    # Unreaped (a zombie included), the process keeps its pid: no other group can have its number.
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:  # it leads no group: started without a session of its own
        proc.send_signal(sig)


# Restarting --------------------------------------------------------------------------------------
@dataclass
class Backoff:
    """A restart budget: the first restart waits ``initial`` s, each next one twice as long up to
    ``cap``; past ``max_restarts`` restarts ``next_delay`` says stop. A process that ran
    ``healthy`` s since it last ``started`` resets the delay and the count."""

    initial: float
    max_restarts: int
    cap: float = MAX_BACKOFF
    healthy: float = HEALTHY_RESET
    clock: Callable[[], float] = time.monotonic
    count: int = field(default=0, init=False)
    _delay: float = field(default=0.0, init=False)
    _started: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self._delay = self.initial
        self.started()

    def started(self) -> None:
        """The process (re)started now."""
        self._started = self.clock()

    def next_delay(self) -> float | None:
        """Count a restart: the seconds to wait before it, or None when the budget is spent."""
        if self.clock() - self._started >= self.healthy:
            self.count, self._delay = 0, self.initial
        if self.count >= self.max_restarts:
            return None
        self.count += 1
        delay, self._delay = self._delay, min(self._delay * 2, self.cap)
        return delay


# Signals -----------------------------------------------------------------------------------------
class StopSignals:
    """SIGTERM and SIGINT set ``requested`` instead of ending the process; a second one (a second
    Ctrl-C while draining) sets ``forced``: stop at once. ``restore`` puts the previous handlers
    back."""

    def __init__(self) -> None:
        self.requested: int | None = None
        self.forced = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is None:
            self.requested = signum
        else:
            self.forced = True

    def is_forced(self) -> bool:
        return self.forced

    def sleep(self, seconds: float, poll: float = 0.2) -> bool:
        """Sleep ``seconds`` unless a stop is requested; False if one was."""
        deadline = time.monotonic() + seconds
        while self.requested is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(poll, left))
        return False

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# What a process says -----------------------------------------------------------------------------
def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (from /proc: empty elsewhere or once it is gone)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    sockets = set()
    for fd in fds:
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                sockets.add(link[len("socket:[") : -1])
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == _TCP_LISTEN and cols[9] in sockets:
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def reported_error(lines: Sequence[str]) -> str | None:
    """The last ``dsinfer: error: ...`` line."""
    return next((line for line in reversed(lines) if line.startswith(ERROR_PREFIX)), None)


def error_detail(lines: Sequence[str]) -> str | None:
    """Why a process failed, in one line, from the end of its stderr: its last ``dsinfer: error:``
    message, else the exception that ended its last traceback, else its last line logged at
    ERROR or CRITICAL."""
    reported = reported_error(lines)
    if reported is not None:
        return reported.removeprefix(ERROR_PREFIX)
    raised = _raised(lines)
    if raised is not None:
        return raised
    for line in reversed(lines):
        for pattern in _LOGGED_ERROR:
            if match := pattern.match(line):
                return match["message"]
    return None


def _raised(lines: Sequence[str]) -> str | None:
    """``Type: message`` of the exception that ended the last traceback (the type's module left out)."""
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if not starts:
        return None
    for line in lines[starts[-1] + 1 :]:
        if line and not line[0].isspace():
            kind, sep, message = line.partition(": ")
            return f"{kind.rsplit('.', 1)[-1]}{sep}{message}"
    return None


class Child:
    """A process from ``spawn`` whose stderr goes through this process's (or ``out``) as it
    comes. Its last lines are kept; a line holding ``ready_marker`` sets ``ready``; its
    ``dsinfer: error:`` lines are held back until ``release``."""

    def __init__(
        self,
        name: str,
        cmd: Sequence[str],
        env: dict[str, str] | None = None,
        *,
        ready_marker: str | None = None,
        out: BinaryIO | None = None,
    ) -> None:
        self.name = name
        self.ready = threading.Event()
        self._marker = ready_marker.encode() if ready_marker else None
        self._out = out
        self._lock = threading.Lock()
        self._tail: deque[str] = deque(maxlen=_TAIL_LINES)
        self._held: list[bytes] = []
        self._line = bytearray()  # the line being received
        self._passed = 0  # how much of it went out already
        self.proc = spawn(cmd, env, stderr=subprocess.PIPE)
        self._relay = threading.Thread(target=self._relay_stderr, name=f"stderr of {name}", daemon=True)
        self._relay.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def lines(self, timeout: float = 2.0) -> list[str]:
        """The last lines of its stderr, once that ended (waited for up to ``timeout`` s)."""
        self._relay.join(timeout)
        with self._lock:
            return list(self._tail)

    def reported_error(self, timeout: float = 2.0) -> str | None:
        return reported_error(self.lines(timeout))

    def error_detail(self, timeout: float = 2.0) -> str | None:
        return error_detail(self.lines(timeout))

    def release(self) -> None:
        """Pass on the held-back ``dsinfer: error:`` lines (nobody reports them for it)."""
        with self._lock:
            held, self._held = self._held, []
        for line in held:
            self._pass(line)

    def _relay_stderr(self) -> None:
        assert self.proc.stderr is not None
        fd = self.proc.stderr.fileno()
        while data := os.read(fd, 65536):
            self._receive(data)
        self._end_line()
        self.proc.stderr.close()

    def _receive(self, data: bytes) -> None:
        start = 0
        while start < len(data):
            end = data.find(b"\n", start)
            stop = len(data) if end < 0 else end + 1
            self._line += data[start:stop]
            if end < 0:
                self._pass_partial()
            else:
                self._end_line()
            start = stop

    def _pass_partial(self) -> None:
        """Pass on what came of an unfinished line, unless it may become an error line."""
        if not _ERROR_PREFIX_BYTES.startswith(bytes(self._line[: len(_ERROR_PREFIX_BYTES)])):
            self._pass(bytes(self._line[self._passed :]))
            self._passed = len(self._line)

    def _end_line(self) -> None:
        line = bytes(self._line)
        self._line.clear()
        passed, self._passed = self._passed, 0
        if not line:
            return
        text = line.decode(errors="replace").rstrip("\r\n").rsplit("\r", 1)[-1]  # a progress bar's last state
        held = line.startswith(_ERROR_PREFIX_BYTES)
        with self._lock:
            self._tail.append(text)
            if held:
                self._held.append(line)
        if not held:
            self._pass(line[passed:])
        if self._marker is not None and self._marker in line:
            self.ready.set()

    def _pass(self, data: bytes) -> None:
        if data:
            _write_stderr(data, self._out)


def _write_stderr(data: bytes, out: BinaryIO | None) -> None:
    with _STDERR_LOCK:
        try:
            if out is not None:
                out.write(data)
                out.flush()
                return
            sys.stderr.flush()
            buffer = getattr(sys.stderr, "buffer", None)
            if buffer is None:
                sys.stderr.write(data.decode(errors="replace"))
                sys.stderr.flush()
            else:
                buffer.write(data)
                buffer.flush()
        except (OSError, ValueError):  # this process's stderr is gone: the child's still drains
            pass
