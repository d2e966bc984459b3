"""The pool launcher (dsinfer.workers.launcher) with a fake rank module: restart on a rank's death
with PoolDown to the gateway (over CURVE, as the pool's launcher), drain on SIGTERM (a second
SIGINT: at once), max_restarts, children dying with the launcher, no restart of a rank that fails
before the pool was up (one error line, exit 2); the ranks get the cluster secret in their
environment (not their command line), the loopback interface for their libraries' listeners and
a FileStore in a private directory per incarnation.

Each test runs the launcher in a subprocess (it installs signal handlers) with ``fake_rank.py``
from tmp_path on PYTHONPATH, its stderr in a file. A fake rank logs that it is up (the line a
real rank logs), writes ``<incarnation>.<rank>.json`` (pid, threads), exits with code 3 when
``die.<incarnation>.<rank>`` appears, and on SIGTERM writes ``<incarnation>.<rank>.term`` then
exits 0 (or ignores SIGTERM when FAKE_RANK_IGNORE_TERM=1). FAKE_RANK_FAIL=<rank>:raise or
<rank>:report makes that rank fail before it is up, with a traceback or a ``dsinfer: error:`` line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq

from dsinfer.base.processes import free_port
from dsinfer.base.protocol import PoolDown, decode, launcher_identity
from dsinfer.workers.args import PoolArgs
from harness.server import alive, wait_until
from tests.fixtures.control import TEST_SECRET, curve_router

pytestmark = pytest.mark.system

TIMEOUT = 30.0

FAKE_RANK = """
import argparse, json, os, signal, sys, time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--args-json", required=True)
args = json.loads(parser.parse_args().args_json)
out = Path(os.environ["FAKE_RANK_DIR"])
tag = f"{args['incarnation']}.{args['rank']}"

def on_term(signum, frame):
    (out / f"{tag}.term").write_text("")
    sys.exit(0)

signal.signal(signal.SIGTERM, signal.SIG_IGN if os.environ.get("FAKE_RANK_IGNORE_TERM") else on_term)
fail_rank, _, fail_how = os.environ.get("FAKE_RANK_FAIL", "").partition(":")
if fail_rank == str(args["rank"]):
    print("loading the checkpoint", file=sys.stderr, flush=True)
    if fail_how == "report":
        print("dsinfer: error: --fake-flag: not a good value", file=sys.stderr)
        sys.exit(2)
    raise RuntimeError("no weights in /nowhere")
pool = args["pool"]
worker = f"{pool['role']}/{pool['pool_id']}/{args['rank']}"
print(f"2026-01-01 00:00:00,000 INFO dsinfer.worker: rank {worker} up on cpu", file=sys.stderr, flush=True)
info = {
    "pid": os.getpid(), "rank": args["rank"], "local_rank": args["local_rank"],
    "incarnation": args["incarnation"], "omp": os.environ.get("OMP_NUM_THREADS"),
    "threads": args["pool"]["threads_per_rank"], "dist_init_addr": args["dist_init_addr"],
    "store": args["dist_store_file"], "secret": os.environ.get("DSINFER_CLUSTER_SECRET"),
    "argv": sys.argv, "gloo": os.environ.get("GLOO_SOCKET_IFNAME"), "ucx": os.environ.get("UCX_NET_DEVICES"),
}
(out / f"{tag}.tmp").write_text(json.dumps(info))
(out / f"{tag}.tmp").rename(out / f"{tag}.json")
if os.environ.get("FAKE_RANK_EXIT_AT_ONCE"):
    time.sleep(0.3)
    sys.exit(3)
die = out / f"die.{tag}"
while not die.exists():
    time.sleep(0.02)
sys.exit(3)
"""

DRIVER = """
import logging, sys
from dsinfer.workers.args import PoolArgs
from dsinfer.workers.launcher import PoolLauncher, run_pool
from tests.fixtures.control import TEST_SECRET
logging.basicConfig(level="INFO", format="%(name)s: %(message)s")
pool = PoolArgs.model_validate_json(sys.argv[1])
launcher = PoolLauncher(pool, TEST_SECRET, rank_module="fake_rank", drain_timeout=float(sys.argv[2]), kill_grace=1.0)
sys.exit(run_pool(launcher))
"""
REPO = Path(__file__).resolve().parents[1]


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = TIMEOUT) -> Any:
    return wait_until(predicate, what, timeout)


class Launcher:
    def __init__(self, tmp_path: Path, pool: PoolArgs, drain_timeout: float = 5.0, **env: str) -> None:
        self.dir = tmp_path / "ranks"
        self.dir.mkdir()
        (tmp_path / "fake_rank.py").write_text(FAKE_RANK)
        pythonpath = os.pathsep.join(filter(None, [str(tmp_path), str(REPO), os.environ.get("PYTHONPATH")]))
        self.log_path = tmp_path / "launcher.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", DRIVER, pool.model_dump_json(), str(drain_timeout)],
                env={**os.environ, "PYTHONPATH": pythonpath, "FAKE_RANK_DIR": str(self.dir), **env},
                stderr=log,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, text: str) -> None:
        wait_for(lambda: text in self.log(), repr(text))

    def ranks(self) -> list[dict[str, Any]]:
        return [json.loads(p.read_text()) for p in self.dir.glob("*.json")]

    def incarnation(self, inc: str, size: int) -> list[dict[str, Any]]:
        """Wait until all ``size`` ranks of incarnation ``inc`` wrote their file."""
        found = wait_for(
            lambda: (r := [x for x in self.ranks() if x["incarnation"] == inc]) and len(r) == size and r,
            f"{size} ranks of incarnation {inc}",
        )
        return sorted(found, key=lambda r: r["rank"])

    def incarnations(self) -> list[str]:
        seen: dict[str, float] = {}
        for path in self.dir.glob("*.json"):
            inc = path.name.split(".")[0]
            seen[inc] = min(seen.get(inc, path.stat().st_mtime), path.stat().st_mtime)
        return sorted(seen, key=seen.__getitem__)

    def wait(self, timeout: float = TIMEOUT) -> tuple[int, str]:
        return self.proc.wait(timeout=timeout), self.log()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=TIMEOUT)
        for rank in self.ranks():
            if alive(rank["pid"]):
                os.kill(rank["pid"], signal.SIGKILL)


@pytest.fixture
def router() -> Iterator[tuple[zmq.Socket, str]]:
    ctx = zmq.Context()
    sock, addr, auth = curve_router(ctx)
    try:
        yield sock, addr
    finally:
        sock.close()
        auth.stop()
        ctx.term()


@pytest.fixture
def launchers(closing: list[Launcher]) -> list[Launcher]:
    return closing


def stop_twice(process: Any, stopping: str) -> tuple[int, str, float]:
    """SIGINT to ``process`` (a Launcher, an all-in-one server) and, once its log says
    ``stopping``, a second one: -> its exit code, its log and the seconds it took after the second."""
    process.proc.send_signal(signal.SIGINT)
    process.wait_log(stopping)
    started = time.monotonic()
    process.proc.send_signal(signal.SIGINT)
    code, err = process.wait()
    return code, err, time.monotonic() - started


def recv_pool_down(sock: zmq.Socket) -> tuple[str, PoolDown]:
    assert sock.poll(int(TIMEOUT * 1000)), "no PoolDown reached the gateway"
    identity, frame = sock.recv_multipart()
    message = decode(frame)
    assert isinstance(message, PoolDown), message
    return identity.decode(), message


def test_dead_rank_restarts_pool_and_reports_pool_down(
    tmp_path: Path, router: tuple[zmq.Socket, str], launchers: list[Launcher]
) -> None:
    sock, addr = router
    pool = PoolArgs(
        role="decode", pool_id=2, pool_size=3, gateway_addr=addr, restart_backoff=0.1, elastic_ep=False
    )
    launcher = Launcher(tmp_path, pool)
    launchers.append(launcher)
    first_inc = wait_for(launcher.incarnations, "the first incarnation")[0]
    first = launcher.incarnation(first_inc, 3)
    assert [r["rank"] for r in first] == [0, 1, 2] and [r["local_rank"] for r in first] == [0, 1, 2]
    expected_threads = max(1, (os.cpu_count() or 1) // 3)
    assert all(r["threads"] == expected_threads and r["omp"] == str(expected_threads) for r in first)
    assert all(r["secret"] == TEST_SECRET and TEST_SECRET not in " ".join(r["argv"]) for r in first)
    assert all(r["gloo"] == "lo" and r["ucx"] == "lo" for r in first)  # --worker-host 127.0.0.1
    store = Path(first[0]["store"])  # one FileStore, in a directory only this user can enter
    assert {r["store"] for r in first} == {str(store)} and first[0]["dist_init_addr"] == ""
    assert store.parent.stat().st_mode & 0o777 == 0o700

    launcher.wait_log(f"decode pool 2: ranks 0-2 up (incarnation {first_inc})")
    (launcher.dir / f"die.{first_inc}.1").write_text("")
    sender, down = recv_pool_down(sock)
    assert sender == launcher_identity("decode", 2, 0)
    assert (down.role, down.pool, down.incarnation) == ("decode", 2, first_inc)
    assert down.reason == "rank 1 exited with code 3"
    for survivor in (0, 2):  # got SIGTERM, and are gone
        assert (launcher.dir / f"{first_inc}.{survivor}.term").exists()
        assert not alive(first[survivor]["pid"])

    second_inc = wait_for(lambda: (incs := launcher.incarnations())[1:] and incs[1], "a restart")
    second = launcher.incarnation(second_inc, 3)
    assert second_inc != first_inc
    assert not {r["pid"] for r in second} & {r["pid"] for r in first}
    assert second[0]["store"] != str(store) and not store.parent.exists()  # a fresh store per start

    launcher.proc.send_signal(signal.SIGTERM)
    code, err = launcher.wait()
    assert code == 0, err
    assert all((launcher.dir / f"{second_inc}.{r}.term").exists() for r in range(3)), err
    assert not any(alive(r["pid"]) for r in second)
    assert "draining" in err and "restart 1/100" in err, err


def test_elastic_pool_store_is_private_to_the_user(tmp_path: Path, launchers: list[Launcher]) -> None:
    """An elastic pool's ranks meet on their launcher's membership store: a FileStore in a
    directory only this user can enter, kept across the pool's restarts and removed when the
    launcher exits. No socket listens (a TCPStore, even on loopback, answers any local user)."""
    pool = PoolArgs(role="decode", pool_size=2, gateway_addr=f"127.0.0.1:{free_port()}")
    assert pool.elastic
    launcher = Launcher(tmp_path, pool)
    launchers.append(launcher)
    ranks = launcher.incarnation(wait_for(launcher.incarnations, "the pool to start")[0], 2)
    stores = {r["store"] for r in ranks}
    assert len(stores) == 1 and all(r["dist_init_addr"] == "" for r in ranks), ranks
    store = Path(stores.pop())
    assert store.parent.stat().st_mode & 0o777 == 0o700
    listening = [c for c in psutil.Process(launcher.proc.pid).net_connections("inet") if c.status == "LISTEN"]
    assert listening == []
    launcher.proc.send_signal(signal.SIGTERM)
    code, err = launcher.wait()
    assert code == 0, err
    assert not store.parent.exists()


def test_max_restarts_with_absent_gateway(tmp_path: Path, launchers: list[Launcher]) -> None:
    absent = f"127.0.0.1:{free_port()}"  # nothing listens: PoolDown must not block the launcher
    pool = PoolArgs(role="prefill", pool_size=2, gateway_addr=absent, max_restarts=2, restart_backoff=0.05)
    launcher = Launcher(tmp_path, pool, FAKE_RANK_EXIT_AT_ONCE="1")
    launchers.append(launcher)
    started = time.monotonic()
    code, err = launcher.wait()
    assert code == 1, err
    assert time.monotonic() - started < 20
    assert len(launcher.incarnations()) == 3  # the first start and two restarts
    assert "prefill pool 0: ranks 0-1 up" in err  # so they are restarted
    last = err.strip().splitlines()[-1]
    assert last.startswith("dsinfer: error: prefill pool 0: gave up after 2 restarts"), err
    assert "exited with code 3" in last


def test_drain_timeout_kills_ranks_that_ignore_sigterm(tmp_path: Path, launchers: list[Launcher]) -> None:
    pool = PoolArgs(
        role="colocated", pool_size=2, gateway_addr=f"127.0.0.1:{free_port()}", threads_per_rank=1
    )
    launcher = Launcher(tmp_path, pool, drain_timeout=0.5, FAKE_RANK_IGNORE_TERM="1")
    launchers.append(launcher)
    inc = wait_for(launcher.incarnations, "the pool to start")[0]
    ranks = launcher.incarnation(inc, 2)
    assert all(r["omp"] == "1" for r in ranks)
    launcher.proc.send_signal(signal.SIGINT)
    code, err = launcher.wait()
    assert code == 0, err
    assert "drain timed out" in err
    assert not any(alive(r["pid"]) for r in ranks)


def test_ranks_die_with_a_killed_launcher(tmp_path: Path, launchers: list[Launcher]) -> None:
    pool = PoolArgs(role="decode", pool_size=2, gateway_addr=f"127.0.0.1:{free_port()}")
    launcher = Launcher(tmp_path, pool, FAKE_RANK_IGNORE_TERM="1")
    launchers.append(launcher)
    inc = wait_for(launcher.incarnations, "the pool to start")[0]
    ranks = launcher.incarnation(inc, 2)
    launcher.proc.kill()
    launcher.wait()
    wait_for(lambda: not any(alive(r["pid"]) for r in ranks), "the ranks to die with their launcher")


@pytest.mark.parametrize(
    ("how", "code", "detail"),
    [("raise", 1, "RuntimeError: no weights in /nowhere"), ("report", 2, "--fake-flag: not a good value")],
)
def test_a_rank_failing_before_the_pool_is_up_ends_the_launcher(
    tmp_path: Path, launchers: list[Launcher], how: str, code: int, detail: str
) -> None:
    """Not restarted (it would fail alike): the other ranks stop and the launcher exits 2 at once,
    its last line the rank's error (not its traceback), printed once."""
    pool = PoolArgs(role="decode", pool_size=3, gateway_addr=f"127.0.0.1:{free_port()}", elastic_ep=False)
    started = time.monotonic()
    launcher = Launcher(tmp_path, pool, FAKE_RANK_FAIL=f"1:{how}")
    launchers.append(launcher)
    exit_code, err = launcher.wait()
    assert exit_code == 2, err
    assert time.monotonic() - started < 15, err
    errors = [line for line in err.splitlines() if line.startswith("dsinfer: error:")]
    expected = (
        f"dsinfer: error: decode pool 0: rank 1 exited with code {code} before the pool was up: {detail}"
    )
    assert errors == [expected], err
    assert err.strip().splitlines()[-1] == expected
    assert len(launcher.incarnations()) <= 1 and "restart 1/" not in err, err
    ranks = launcher.ranks()
    assert 1 not in {r["rank"] for r in ranks} and not any(alive(r["pid"]) for r in ranks)


def test_a_second_sigint_stops_the_drain_at_once(tmp_path: Path, launchers: list[Launcher]) -> None:
    pool = PoolArgs(role="decode", pool_size=2, gateway_addr=f"127.0.0.1:{free_port()}")
    launcher = Launcher(tmp_path, pool, drain_timeout=60.0, FAKE_RANK_IGNORE_TERM="1")
    launchers.append(launcher)
    ranks = launcher.incarnation(wait_for(launcher.incarnations, "the pool to start")[0], 2)
    code, err, seconds = stop_twice(launcher, "draining")
    assert code == 0, err
    assert seconds < 5, err
    assert err.count("second stop signal") == 1 and "drain timed out" not in err, err
    assert not any(alive(r["pid"]) for r in ranks)
