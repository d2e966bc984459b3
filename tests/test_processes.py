"""dsinfer/base/processes.py: free ports, the restart back-off, stop signals, what a child's stderr
says (its error in one line), and, with real processes (marked system): a process group stopped
within its grace though it ignores SIGTERM, children dying with a SIGKILLed parent, a child's
stderr relayed as it comes with its error lines held back, the ports a process listens on."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dsinfer.base.processes import (
    Backoff,
    Child,
    StopSignals,
    error_detail,
    free_port,
    kill,
    listening_ports,
    reported_error,
    spawn,
    terminate,
)
from harness.server import alive, wait_until

TIMEOUT = 20.0


def wait_for(predicate: Callable[[], object], what: str, timeout: float = TIMEOUT) -> None:
    wait_until(predicate, what, timeout)


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


# Pure parts -----------------------------------------------------------------------------------------
def test_free_port_can_be_bound() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_up_to_its_cap_and_stops_past_max_restarts() -> None:
    backoff = Backoff(0.5, max_restarts=6, cap=4.0, healthy=60.0, clock=Clock())
    assert [backoff.next_delay() for _ in range(7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, None]
    assert backoff.count == 6


def test_backoff_resets_after_a_healthy_run() -> None:
    clock = Clock()
    backoff = Backoff(1.0, max_restarts=3, healthy=60.0, clock=clock)
    assert [backoff.next_delay() for _ in range(4)] == [1.0, 2.0, 4.0, None]  # spent
    backoff.started()
    clock.now += 59.0
    assert backoff.next_delay() is None  # not healthy long enough
    clock.now += 1.0
    assert backoff.next_delay() == 1.0 and backoff.count == 1  # ran 60 s since its start: reset
    clock.now += 120.0  # measured from the last start, not from the last failure
    assert backoff.next_delay() == 1.0 and backoff.count == 1


def test_backoff_zero_stays_zero() -> None:
    backoff = Backoff(0.0, max_restarts=2, clock=Clock())
    assert [backoff.next_delay() for _ in range(3)] == [0.0, 0.0, None]


def test_a_second_stop_signal_forces() -> None:
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN where the suite runs as a background job
    signals = StopSignals()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(lambda: signals.requested is not None, "the handler")
        assert signals.requested == signal.SIGTERM and not signals.forced
        assert not signals.sleep(5.0)  # a stop was requested: no sleep
        os.kill(os.getpid(), signal.SIGINT)
        wait_for(signals.is_forced, "the second signal")
        assert signals.requested == signal.SIGTERM
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGINT) is before


TRACEBACK = [
    "2026-11-27 08:57:41,976 INFO dsinfer.ops: ops backends: gemm=torch (device cpu)",
    "Traceback (most recent call last):",
    '  File "/work/main/dsinfer/model/loader.py", line 83, in load_model',
    "    raise CheckpointError(str(e)) from None",
    "dsinfer.model.checkpoint.CheckpointError: /m/config.json: model_type 'x' is not supported",
]


@pytest.mark.parametrize(
    ("lines", "detail"),
    [
        (TRACEBACK, "CheckpointError: /m/config.json: model_type 'x' is not supported"),
        ([*TRACEBACK, "dsinfer: error: --port: taken", "bye"], "--port: taken"),  # its own words first
        (
            [
                "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 80): address in use"
            ],
            "[Errno 98] error while attempting to bind on address ('127.0.0.1', 80): address in use",
        ),
        (
            ["2026-11-27 08:57:43,414 ERROR dsinfer.worker: rank leaves its pool: peer lost", "done"],
            "rank leaves its pool: peer lost",
        ),
        (
            ["Traceback (most recent call last):", '  File "x.py", line 1', "KeyboardInterrupt"],
            "KeyboardInterrupt",
        ),
        (["2026-11-27 08:57:43,414 WARNING dsinfer.worker: slow", "bye"], None),
        ([], None),
    ],
)
def test_error_detail(lines: list[str], detail: str | None) -> None:
    assert error_detail(lines) == detail


def test_reported_error_is_the_last_error_line() -> None:
    lines = ["dsinfer: error: first", "x", "dsinfer: error: second", "y"]
    assert reported_error(lines) == "dsinfer: error: second"
    assert reported_error(["dsinfer: warning"]) is None


def test_listening_ports_of_a_process() -> None:
    with socket.socket() as listener, socket.socket() as bound:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        bound.bind(("127.0.0.1", 0))
        ports = listening_ports(os.getpid())
        assert listener.getsockname()[1] in ports
        assert bound.getsockname()[1] not in ports
    assert listening_ports(2**22 + 7) == set()  # no such process


# Real processes -------------------------------------------------------------------------------------
IGNORES_TERM = """
import os, signal, subprocess, sys, time
from pathlib import Path
signal.signal(signal.SIGTERM, signal.SIG_IGN)
helper = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
Path(sys.argv[1]).write_text(str(helper.pid))
time.sleep(600)
"""


@pytest.mark.system
def test_terminate_kills_a_group_that_ignores_sigterm_after_the_grace(tmp_path: Path) -> None:
    pid_file = tmp_path / "helper.pid"
    proc = spawn([*python(IGNORES_TERM), str(pid_file)])
    try:
        wait_for(pid_file.exists, "the helper")
        helper = int(pid_file.read_text())
        started = time.monotonic()
        assert not terminate([proc], grace=0.5, group=True)
        took = time.monotonic() - started
        assert 0.5 <= took < 5.0, took
        assert proc.returncode == -signal.SIGKILL
        wait_for(lambda: not alive(helper), "the helper, in the same process group, to die")
    finally:
        kill([proc])


@pytest.mark.system
def test_terminate_returns_as_soon_as_all_exited() -> None:
    procs = [spawn(python("import time; time.sleep(600)")) for _ in range(2)]
    try:
        started = time.monotonic()
        assert terminate(procs, grace=10.0)
        assert time.monotonic() - started < 5.0
        assert [p.returncode for p in procs] == [-signal.SIGTERM] * 2
    finally:
        kill(procs)


@pytest.mark.system
def test_terminate_cut_short() -> None:
    code = "import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', file=sys.stderr)\ntime.sleep(600)"
    child = Child("stubborn", python(code), ready_marker="ready", out=io.BytesIO())
    try:
        assert child.ready.wait(TIMEOUT)
        started = time.monotonic()
        assert not terminate([child.proc], grace=30.0, cut_short=lambda: time.monotonic() - started > 0.3)
        assert time.monotonic() - started < 5.0 and child.proc.returncode == -signal.SIGKILL
    finally:
        kill([child.proc])


SPAWNS_A_SLEEPER = """
import sys, time
from pathlib import Path
from dsinfer.base.processes import spawn
child = spawn([sys.executable, "-c", "import time; time.sleep(600)"])
Path(sys.argv[1]).write_text(str(child.pid))
time.sleep(600)
"""


@pytest.mark.system
def test_a_child_dies_with_its_sigkilled_parent(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([*python(SPAWNS_A_SLEEPER), str(pid_file)])
    child = None
    try:
        wait_for(pid_file.exists, "the child")
        child = int(pid_file.read_text())
        assert alive(child)
        assert os.getsid(child) == child  # a session of its own: a terminal's Ctrl-C misses it
        parent.kill()
        parent.wait(TIMEOUT)
        wait_for(lambda: not alive(child), "the child to die with its parent")
    finally:
        parent.kill()
        parent.wait(TIMEOUT)
        if child is not None and alive(child):
            os.kill(child, signal.SIGKILL)


CHATTY = """
import sys, time
from pathlib import Path
go = Path(sys.argv[1])
sys.stderr.write("loading 10%\\r")
sys.stderr.flush()
while not go.exists():
    time.sleep(0.02)
sys.stderr.write("loading 100%\\n")
print("dsinfer: error: --flag: bad", file=sys.stderr)
print("2026-01-01 00:00:00,000 INFO x: rank a/0/0 up on cpu", file=sys.stderr)
sys.exit(2)
"""


@pytest.mark.system
def test_child_relays_stderr_as_it_comes_and_holds_back_error_lines(tmp_path: Path) -> None:
    out = io.BytesIO()
    go = tmp_path / "go"
    child = Child("chatty", [*python(CHATTY), str(go)], ready_marker="rank a/0/0 up on ", out=out)
    try:
        wait_for(lambda: b"loading 10%\r" in out.getvalue(), "the unfinished progress line")
        assert not child.ready.is_set()
        go.write_text("")
        assert child.ready.wait(TIMEOUT)
        assert child.proc.wait(TIMEOUT) == 2
        assert child.lines() == [
            "loading 100%",
            "dsinfer: error: --flag: bad",
            "2026-01-01 00:00:00,000 INFO x: rank a/0/0 up on cpu",
        ]
        assert (
            out.getvalue()
            == b"loading 10%\rloading 100%\n2026-01-01 00:00:00,000 INFO x: rank a/0/0 up on cpu\n"
        )
        assert child.reported_error() == "dsinfer: error: --flag: bad"
        assert child.error_detail() == "--flag: bad"
        child.release()
        assert out.getvalue().endswith(b"dsinfer: error: --flag: bad\n")
    finally:
        kill([child.proc])


@pytest.mark.system
def test_child_relay_keeps_up_with_a_lot_of_output() -> None:
    out = io.BytesIO()
    code = "import sys\nfor i in range(20000): print(f'line {i}', file=sys.stderr)\nraise SystemExit(3)"
    child = Child("loud", python(code), out=out)
    try:
        assert child.proc.wait(TIMEOUT) == 3
        assert child.lines()[-1] == "line 19999" and len(child.lines()) == 200
        wait_for(lambda: out.getvalue().endswith(b"line 19999\n"), "all of it to pass")
        assert out.getvalue().count(b"\n") == 20000
    finally:
        kill([child.proc])


@pytest.mark.system
def test_child_listening_ports() -> None:
    port = free_port()
    code = f"import socket, time\ns = socket.socket()\ns.bind(('127.0.0.1', {port}))\ns.listen()\ntime.sleep(600)"
    child = Child("listener", python(code), out=io.BytesIO())
    try:
        wait_for(lambda: port in listening_ports(child.pid), "the child to listen")
    finally:
        kill([child.proc])
    assert listening_ports(child.pid) == set()
