"""The pool launcher: starts the local ranks of one pool, watches them and restarts the pool whole.

A collective cannot lose a member, so any rank exit while the pool should be running (whatever
its exit code) takes the pool down: the survivors are killed, the gateway is told (``PoolDown``)
and, after a back-off, every rank starts again under a new incarnation. SIGTERM or SIGINT to
the launcher drains instead: the ranks get SIGTERM, finish what they hold and exit. The
back-off doubles up to 30 s; a pool that ran 60 s resets it and the count of restarts.

The ranks get the cluster secret in their environment (never on a command line, which any user
can read), and the interface of the worker host for their libraries' listeners
(dsinfer/workers/network.py). A pool on one node forms its torch.distributed group through a
FileStore in a private directory of the launcher's instead of a TCPStore, which would listen on
every interface.

Children die with the launcher even when it is SIGKILLed: on Linux each child asks the kernel
for SIGKILL on its parent's death (``PR_SET_PDEATHSIG``) between fork and exec. They also run in
their own session, so a terminal's Ctrl-C reaches only the launcher, which stops them in order.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType

import zmq

from dsinfer.base.cluster_secret import SECRET_ENV, ControlKeys
from dsinfer.base.control_auth import connect_curve
from dsinfer.base.protocol import PoolDown, encode, launcher_identity
from dsinfer.workers.args import PoolArgs, RankArgs
from dsinfer.workers.channel import gateway_endpoints
from dsinfer.workers.network import rank_network_env

log = logging.getLogger("dsinfer.launcher")

POLL_INTERVAL = 0.2  # seconds between checks of the children
KILL_GRACE = 5.0  # seconds between SIGTERM and SIGKILL when a pool is torn down
MAX_BACKOFF = 30.0  # cap of the doubling restart back-off
HEALTHY_RESET = 60.0  # a pool that ran this long resets the back-off and the restart count
POOL_DOWN_LINGER_MS = 500  # how long an unsent PoolDown may delay the launcher
_PR_SET_PDEATHSIG = 1


# Child processes ---------------------------------------------------------------------------------
def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    """preexec_fn: SIGKILL this child when the process that forked it dies (Linux only)."""

    def preexec() -> None:
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent_pid:  # the parent died before prctl took effect
                os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def spawn(cmd: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a child that dies with this process and ignores the terminal's Ctrl-C."""
    return subprocess.Popen(
        list(cmd), env=env, start_new_session=True, preexec_fn=_die_with_parent(os.getpid())
    )


def terminate(procs: Sequence[subprocess.Popen[bytes]], timeout: float) -> None:
    """SIGTERM every live process, wait up to ``timeout`` s for all, then SIGKILL the rest."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    wait_all(procs, timeout)
    kill(procs)


def wait_all(procs: Sequence[subprocess.Popen[bytes]], timeout: float) -> bool:
    """Poll until every process exited or ``timeout`` s passed; True if all exited."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
    return True


def kill(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()


def threads_per_rank(pool: PoolArgs) -> int:
    """--threads-per-rank, else this machine's cores shared by the pool's local ranks."""
    return pool.threads_per_rank or max(1, (os.cpu_count() or 1) // pool.ranks_per_node)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class StopSignals:
    """SIGTERM/SIGINT set ``requested`` instead of killing the process; ``restore`` undoes it."""

    def __init__(self) -> None:
        self.requested: int | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# The pool ----------------------------------------------------------------------------------------
@dataclass
class _Start:
    incarnation: str
    procs: list[subprocess.Popen[bytes]]  # index = local rank
    first_rank: int
    started_at: float
    store_dir: str | None = None  # the FileStore's private directory (a pool on one node)

    def cleanup(self) -> None:
        if self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)


class PoolLauncher:
    def __init__(
        self,
        pool: PoolArgs,
        secret: str,
        *,
        rank_module: str = "dsinfer.workers.rank",
        drain_timeout: float = 30.0,
        kill_grace: float = KILL_GRACE,
    ) -> None:
        self.pool = pool
        self.rank_module = rank_module
        self.drain_timeout = drain_timeout
        self.kill_grace = kill_grace
        self.name = f"{pool.role} pool {pool.pool_id}"
        self.threads = threads_per_rank(pool)
        self.secret = secret
        self.keys = ControlKeys.from_secret(secret)
        self.network_env = rank_network_env(pool.host, os.environ)

    def run(self, signals: StopSignals) -> int:
        """Restarts count since the pool last ran ``HEALTHY_RESET`` s; past ``max_restarts`` -> 1."""
        restarts = 0
        backoff = self.pool.restart_backoff
        while True:
            start = self._start()
            try:
                exited = self._watch(start, signals)
            except BaseException:
                kill(start.procs)
                start.cleanup()
                raise
            if exited is None:
                self._drain(start, signals.requested)
                start.cleanup()
                return 0
            rank, code = exited
            reason = f"rank {rank} exited with code {code}"
            log.warning("%s: %s; stopping incarnation %s", self.name, reason, start.incarnation)
            terminate(start.procs, self.kill_grace)
            start.cleanup()
            self._send_pool_down(start.incarnation, reason)
            if time.monotonic() - start.started_at >= HEALTHY_RESET:
                restarts, backoff = 0, self.pool.restart_backoff
            if restarts >= self.pool.max_restarts:
                print(
                    f"dsinfer: error: {self.name}: gave up after {restarts} restarts (last: {reason})",
                    file=sys.stderr,
                )
                return 1
            restarts += 1
            log.info("%s: restart %d/%d in %.1f s", self.name, restarts, self.pool.max_restarts, backoff)
            if not self._sleep(backoff, signals):
                log.info("%s: stopped during restart back-off", self.name)
                return 0
            backoff = min(backoff * 2, MAX_BACKOFF)

    def _start(self) -> _Start:
        pool = self.pool
        incarnation = uuid.uuid4().hex
        store_dir = None
        if pool.dist_init_addr is None and pool.nnodes == 1:
            store_dir = tempfile.mkdtemp(prefix="dsinfer-pool-")  # mode 0700
        dist_init_addr = pool.dist_init_addr or ""
        resolved = pool.model_copy(
            update={"threads_per_rank": self.threads, "dist_init_addr": dist_init_addr or None}
        )
        threads = str(self.threads)
        env = {
            **os.environ,
            **self.network_env,
            SECRET_ENV: self.secret,
            "OMP_NUM_THREADS": threads,
            "NUMBA_NUM_THREADS": threads,
        }
        first = pool.node_rank * pool.ranks_per_node
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for local in range(pool.ranks_per_node):
                args = RankArgs(
                    pool=resolved,
                    rank=first + local,
                    local_rank=local,
                    dist_init_addr=dist_init_addr,
                    incarnation=incarnation,
                    dist_store_file=None if store_dir is None else os.path.join(store_dir, "store"),
                )
                cmd = [sys.executable, "-m", self.rank_module, "--args-json", args.model_dump_json()]
                procs.append(spawn(cmd, env))
        except BaseException:
            kill(procs)
            if store_dir is not None:
                shutil.rmtree(store_dir, ignore_errors=True)
            raise
        log.info(
            "%s: started incarnation %s: ranks %d-%d, pids %s, %d thread(s) per rank, dist-init %s",
            self.name,
            incarnation,
            first,
            first + len(procs) - 1,
            ",".join(str(p.pid) for p in procs),
            self.threads,
            dist_init_addr or "a FileStore in " + str(store_dir),
        )
        return _Start(incarnation, procs, first, time.monotonic(), store_dir)

    def _watch(self, start: _Start, signals: StopSignals) -> tuple[int, int] | None:
        """Block until a rank exits (-> its rank and exit code) or a stop is requested (-> None)."""
        while signals.requested is None:
            for local, proc in enumerate(start.procs):
                code = proc.poll()
                if code is not None:
                    return start.first_rank + local, code
            time.sleep(POLL_INTERVAL)
        return None

    def _drain(self, start: _Start, signum: int | None) -> None:
        sig = signal.Signals(signum).name if signum else "stop"
        log.info(
            "%s: %s: draining incarnation %s (SIGTERM to %d rank(s), up to %.0f s)",
            self.name,
            sig,
            start.incarnation,
            len(start.procs),
            self.drain_timeout,
        )
        for proc in start.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        if not wait_all(start.procs, self.drain_timeout):
            left = [p.pid for p in start.procs if p.poll() is None]
            log.warning("%s: drain timed out; SIGKILL to pids %s", self.name, ",".join(map(str, left)))
        kill(start.procs)
        codes = ",".join(str(p.returncode) for p in start.procs)
        log.info("%s: stopped (rank exit codes %s)", self.name, codes)

    def _sleep(self, seconds: float, signals: StopSignals) -> bool:
        """Sleep unless a stop is requested; False if one was."""
        deadline = time.monotonic() + seconds
        while signals.requested is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(POLL_INTERVAL, left))
        return False

    def _send_pool_down(self, incarnation: str, reason: str) -> None:
        """Best effort, to every gateway: an absent one delays the launcher by at most the linger."""
        pool = self.pool
        message = encode(PoolDown(role=pool.role, pool=pool.pool_id, incarnation=incarnation, reason=reason))
        identity = launcher_identity(pool.role, pool.pool_id, pool.node_rank).encode()
        # A context per message: no ZMQ I/O thread exists while the next ranks are forked.
        ctx = zmq.Context()
        try:
            for endpoint in gateway_endpoints(pool.gateway_addr):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.IDENTITY, identity)
                sock.setsockopt(zmq.LINGER, POOL_DOWN_LINGER_MS)
                connect_curve(sock, self.keys, self.keys.gateway)
                sock.connect(endpoint)
                sock.send(message, zmq.NOBLOCK)
                sock.close()
            log.info("%s: PoolDown sent to the gateway at %s (best effort)", self.name, pool.gateway_addr)
        except zmq.ZMQError as e:
            log.warning("%s: could not send PoolDown to %s: %s", self.name, self.pool.gateway_addr, e)
        finally:
            ctx.term()


def run_pool(
    pool: PoolArgs,
    secret: str,
    *,
    rank_module: str = "dsinfer.workers.rank",
    drain_timeout: float = 30.0,
    kill_grace: float = KILL_GRACE,
) -> int:
    """Run one pool's local ranks until SIGTERM/SIGINT (-> 0) or ``max_restarts`` is spent (-> 1)."""
    launcher = PoolLauncher(
        pool, secret, rank_module=rank_module, drain_timeout=drain_timeout, kill_grace=kill_grace
    )
    signals = StopSignals()
    try:
        return launcher.run(signals)
    finally:
        signals.restore()
