"""The pool launcher: starts the local ranks of one pool, watches them and restarts them.

Elastic pools (``PoolArgs.elastic``: several ranks on one node): the launcher keeps the pool's
store (a torch.distributed FileStore in a private directory, dsinfer/workers/membership.py). When a rank exits while
the pool serves, the launcher removes it from the membership, tells the gateway (``RankDown``:
its choices move to other ranks) and, after a back-off, starts it again alone: it rejoins the
pool (dsinfer/workers/elastic.py) while the others serve on. A rank that exits before every
rank of the pool served once, or the last one, restarts the pool whole.

Otherwise (one rank, several nodes, ``--no-elastic-ep``) a collective cannot lose a member, so
any rank exit while the pool should be running (whatever its exit code) takes the pool down:
the survivors are killed, the gateway is told (``PoolDown``) and, after a back-off, every rank
starts again under a new incarnation. SIGTERM or SIGINT to the launcher drains instead: the
ranks get SIGTERM, finish what they hold and exit; a second one (a second Ctrl-C) kills them at
once. The back-off doubles up to 30 s; a pool that ran 60 s since its last restart resets it and
the count of restarts.

Until the pool was up once (every local rank logged that it serves: warmed up, registered),
nothing is restarted: a rank that exits then (a broken checkpoint, a bad flag, a port in use)
would fail alike on every restart. The launcher stops the others, prints the rank's error in one
line and exits with ``STARTUP_FAILED``. The ranks' stderr goes through the launcher (dsinfer/base/
processes.py ``Child``), which is how it sees them come up and why they failed.

The ranks get the cluster secret in their environment (never on a command line, which any user
can read), and the interface of the worker host for their libraries' listeners
(dsinfer/workers/network.py). A pool on one node forms its torch.distributed group without a
socket: through a FileStore in a private directory of the launcher's (the launcher's lifetime
for an elastic pool, one per incarnation for any other); torch's own TCPStore would listen on
every interface, and even on loopback it answers any local user.

Children die with the launcher even when it is SIGKILLed and run in their own session, so a
terminal's Ctrl-C reaches only the launcher, which stops them in order (dsinfer/base/processes.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field

import msgspec
import torch.distributed as dist
import zmq

from dsinfer.base.cluster_secret import SECRET_ENV, ControlKeys
from dsinfer.base.control_auth import connect_curve
from dsinfer.base.processes import (
    ERROR_PREFIX,
    KILL_GRACE,
    STARTUP_FAILED,
    Backoff,
    Child,
    StopSignals,
    kill,
    send,
    terminate,
    wait_all,
)
from dsinfer.base.protocol import PoolDown, RankDown, encode, launcher_identity, worker_name
from dsinfer.workers.args import PoolArgs, RankArgs
from dsinfer.workers.channel import gateway_endpoints
from dsinfer.workers.membership import PoolStore, private_store
from dsinfer.workers.network import rank_network_env

log = logging.getLogger("dsinfer.launcher")

POLL_INTERVAL = 0.2  # seconds between checks of the children
POOL_DOWN_LINGER_MS = 500  # how long an unsent PoolDown may delay the launcher
STORE_TIMEOUT = 600.0  # seconds a client of the launcher's store waits for a key
RANK_UP = "rank {worker} up on "  # what dsinfer/workers/rank.py logs once the rank serves


# The pool ----------------------------------------------------------------------------------------
@dataclass
class _Start:
    incarnation: str
    children: list[Child]  # index = local rank
    first_rank: int
    dist_init_addr: str
    store: PoolStore | None = None  # an elastic pool's membership
    incarnations: list[str] = field(default_factory=list)  # each local rank's (a restarted one: its own)
    restarting: dict[int, float] = field(default_factory=dict)  # local rank -> when it starts again
    store_dir: str | None = None  # this start's FileStore directory (a one-node pool, not elastic)
    store_file: str | None = None  # the FileStore its ranks meet in (one-node pools)
    up: bool = False  # every local rank of this start logged that it serves

    @property
    def procs(self) -> list[subprocess.Popen[bytes]]:
        return [child.proc for child in self.children]

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
        self.threads = pool.threads
        self.backoff = Backoff(pool.restart_backoff, pool.max_restarts)
        self.was_up = False  # the pool was up once: from then on a rank's exit restarts it
        self._store: dist.FileStore | None = None  # kept for the launcher's lifetime (elastic)
        self._store_file = ""
        self.secret = secret
        self.keys = ControlKeys.from_secret(secret)
        self.network_env = rank_network_env(pool.host, os.environ)

    def run(self, signals: StopSignals) -> int:
        """-> 0 once stopped; ``STARTUP_FAILED`` when a rank exits before the pool was ever up;
        1 past ``max_restarts`` (counted since the pool last ran ``HEALTHY_RESET`` s)."""
        if not self.pool.elastic:
            return self._run(signals)
        self._store, self._store_file = private_store(STORE_TIMEOUT)
        try:
            return self._run(signals)
        finally:
            shutil.rmtree(os.path.dirname(self._store_file), ignore_errors=True)

    def _run(self, signals: StopSignals) -> int:
        while True:
            start = self._start()
            try:
                exited = self._watch(start, signals)
            except BaseException:
                kill(start.procs)
                start.cleanup()
                raise
            if exited is None:
                self._drain(start, signals)
                start.cleanup()
                return 0
            local, code = exited
            failed = start.children[local]
            reason = f"rank {start.first_rank + local} exited with code {code}"
            self._settle_up(start)
            log.warning("%s: %s; stopping incarnation %s", self.name, reason, start.incarnation)
            terminate(start.procs, self.kill_grace, cut_short=signals.is_forced)
            start.cleanup()
            self._send(
                PoolDown(
                    role=self.pool.role, pool=self.pool.pool_id, incarnation=start.incarnation, reason=reason
                )
            )
            for local, incarnation in enumerate(start.incarnations):
                if incarnation != start.incarnation:  # restarted alone: registered under its own
                    self._send(
                        RankDown(worker=self._worker(start, local), incarnation=incarnation, reason=reason)
                    )
            if not self.was_up:
                print(self._startup_failure(failed, reason), file=sys.stderr)
                return STARTUP_FAILED
            for child in start.children:
                child.release()
            backoff = self._next_backoff(reason)
            if backoff is None:
                return 1
            log.info(
                "%s: restart %d/%d in %.1f s", self.name, self.backoff.count, self.pool.max_restarts, backoff
            )
            if not signals.sleep(backoff, POLL_INTERVAL):
                log.info("%s: stopped during restart back-off", self.name)
                return 0

    def _startup_failure(self, child: Child, reason: str) -> str:
        """The one line that says why the pool never came up: the rank's error, not a traceback."""
        line = f"{ERROR_PREFIX}{self.name}: {reason} before the pool was up"
        detail = child.error_detail()
        return f"{line}: {detail}" if detail else line

    def _next_backoff(self, reason: str) -> float | None:
        """Count a restart (of the pool or of one rank); its back-off, None past ``max_restarts``."""
        backoff = self.backoff.next_delay()
        if backoff is None:
            print(
                f"{ERROR_PREFIX}{self.name}: gave up after {self.backoff.count} restarts (last: {reason})",
                file=sys.stderr,
            )
        return backoff

    def _worker(self, start: _Start, local: int) -> str:
        return worker_name(self.pool.role, self.pool.pool_id, start.first_rank + local)

    def _start(self) -> _Start:
        pool = self.pool
        incarnation = uuid.uuid4().hex
        store_dir = None
        if self._store is None and pool.dist_init_addr is None and pool.nnodes == 1:
            store_dir = tempfile.mkdtemp(prefix="dsinfer-pool-")  # mode 0700
        dist_init_addr = pool.dist_init_addr or ""
        start = _Start(incarnation, [], pool.node_rank * pool.ranks_per_node, dist_init_addr)
        self.backoff.started()
        start.store_dir = store_dir
        start.store_file = self._store_file or (
            None if store_dir is None else os.path.join(store_dir, "store")
        )
        if self._store is not None:
            start.store = PoolStore(self._store, incarnation)
            start.store.start(pool.pool_size)
        try:
            for local in range(pool.ranks_per_node):
                start.children.append(self._spawn_rank(start, local, incarnation))
                start.incarnations.append(incarnation)
        except BaseException:
            kill(start.procs)
            start.cleanup()
            raise
        first, procs = start.first_rank, start.procs
        log.info(
            "%s: started incarnation %s: ranks %d-%d, pids %s, %d thread(s) per rank, dist-init %s",
            self.name,
            incarnation,
            first,
            first + len(procs) - 1,
            ",".join(str(p.pid) for p in procs),
            self.threads,
            dist_init_addr or f"a FileStore in {os.path.dirname(start.store_file or '')}",
        )
        return start

    def _spawn_rank(self, start: _Start, local: int, incarnation: str) -> Child:
        resolved = self.pool.model_copy(
            update={"threads_per_rank": self.threads, "dist_init_addr": start.dist_init_addr or None}
        )
        args = RankArgs(
            pool=resolved,
            rank=start.first_rank + local,
            local_rank=local,
            dist_init_addr=start.dist_init_addr,
            incarnation=incarnation,
            pool_incarnation=start.incarnation,
            joining=incarnation != start.incarnation,
            dist_store_file=start.store_file,
        )
        threads = str(self.threads)
        env = {
            **os.environ,
            **self.network_env,
            SECRET_ENV: self.secret,
            "OMP_NUM_THREADS": threads,
            "NUMBA_NUM_THREADS": threads,
        }
        return Child(
            f"rank {args.rank}",
            [sys.executable, "-m", self.rank_module, "--args-json", args.model_dump_json()],
            env,
            ready_marker=RANK_UP.format(worker=self._worker(start, local)),
        )

    def _watch(self, start: _Start, signals: StopSignals) -> tuple[int, int] | None:
        """Block until the pool must restart whole (-> the local rank that exited and its exit
        code) or a stop is requested (-> None); in an elastic pool a dead rank is restarted alone."""
        while signals.requested is None:
            self._note_up(start)
            for local, proc in enumerate(start.procs):
                code = proc.poll()
                if code is None or local in start.restarting:
                    continue
                if not self._can_shrink(start, local):
                    return local, code
                if not self._shrink(start, local, code):
                    return local, code
            now = time.monotonic()
            for local, at in list(start.restarting.items()):
                if now >= at:
                    del start.restarting[local]
                    self._rejoin(start, local)
            time.sleep(POLL_INTERVAL)
        return None

    def _settle_up(self, start: _Start) -> None:
        """Whether the pool came up, once the last lines of the ranks that exited are in."""
        for child in start.children:
            if child.proc.poll() is not None:
                child.lines()
        self._note_up(start)

    def _note_up(self, start: _Start) -> None:
        if start.up or not all(child.ready.is_set() for child in start.children):
            return
        start.up = self.was_up = True
        last = start.first_rank + len(start.children) - 1
        log.info("%s: ranks %d-%d up (incarnation %s)", self.name, start.first_rank, last, start.incarnation)

    # Elastic pools --------------------------------------------------------------------------------
    def _can_shrink(self, start: _Start, local: int) -> bool:
        """The pool serves on without the rank: every rank served once and another one lives."""
        if start.store is None or not start.store.all_serving(self.pool.pool_size):
            return False
        return any(
            p.poll() is None and i not in start.restarting for i, p in enumerate(start.procs) if i != local
        )

    def _shrink(self, start: _Start, local: int, code: int) -> bool:
        """Take the dead rank out of the membership and rotation; start it again after a back-off.
        False past ``max_restarts``."""
        assert start.store is not None
        rank = start.first_rank + local
        while True:
            members = start.store.members()
            if rank not in members.ranks:
                break
            shrunk = start.store.change(members, tuple(r for r in members.ranks if r != rank))
            if shrunk is not None:
                members = shrunk
                break
        start.store.withdraw_join(rank)
        reason = f"rank {rank} exited with code {code}"
        self._send(
            RankDown(worker=self._worker(start, local), incarnation=start.incarnations[local], reason=reason)
        )
        backoff = self._next_backoff(reason)
        if backoff is None:
            return False
        start.restarting[local] = time.monotonic() + backoff
        log.warning(
            "%s: %s; ranks %s serve on (membership generation %d); rank %d restarts in %.1f s",
            self.name,
            reason,
            ",".join(map(str, members.ranks)),
            members.generation,
            rank,
            backoff,
        )
        return True

    def _rejoin(self, start: _Start, local: int) -> None:
        incarnation = uuid.uuid4().hex
        start.children[local] = self._spawn_rank(start, local, incarnation)
        start.incarnations[local] = incarnation
        self.backoff.started()
        log.info(
            "%s: rank %d started again (pid %d, incarnation %s): it rejoins the pool",
            self.name,
            start.first_rank + local,
            start.children[local].pid,
            incarnation,
        )

    def _drain(self, start: _Start, signals: StopSignals) -> None:
        sig = signal.Signals(signals.requested).name if signals.requested else "stop"
        log.info(
            "%s: %s: draining incarnation %s (SIGTERM to %d rank(s), up to %.0f s)",
            self.name,
            sig,
            start.incarnation,
            len(start.procs),
            self.drain_timeout,
        )
        procs = start.procs
        send(procs, signal.SIGTERM)
        if not wait_all(procs, self.drain_timeout, cut_short=signals.is_forced):
            left = ",".join(str(p.pid) for p in procs if p.poll() is None)
            if signals.forced:
                log.warning(
                    "%s: second stop signal: SIGKILL to pids %s, not waiting for the drain", self.name, left
                )
            else:
                log.warning("%s: drain timed out; SIGKILL to pids %s", self.name, left)
        kill(procs)
        for child in start.children:
            child.release()
        codes = ",".join(str(p.returncode) for p in procs)
        log.info("%s: stopped (rank exit codes %s)", self.name, codes)

    def _send(self, struct: msgspec.Struct) -> None:
        """PoolDown or RankDown to every gateway. Best effort: an absent one delays the launcher by
        at most the linger."""
        pool = self.pool
        message = encode(struct)
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
            log.info(
                "%s: %s sent to the gateway at %s (best effort)",
                self.name,
                type(struct).__name__,
                self.pool.gateway_addr,
            )
        except zmq.ZMQError as e:
            log.warning(
                "%s: could not send %s to %s: %s", self.name, type(struct).__name__, self.pool.gateway_addr, e
            )
        finally:
            ctx.term()


def run_pool(launcher: PoolLauncher) -> int:
    """Run one pool's local ranks until SIGTERM/SIGINT (-> 0), a rank exits before the pool was
    ever up (-> ``STARTUP_FAILED``) or ``max_restarts`` is spent (-> 1)."""
    signals = StopSignals()
    try:
        return launcher.run(signals)
    finally:
        signals.restore()
