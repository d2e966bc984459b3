"""Servers as real processes: ``dsinfer serve`` (all-in-one with any topology flags, or one role
such as the gateway alone) or any other OpenAI server (vLLM), on free ports, ready within a bound,
and always stopped.

A server runs in its own session, its output in a log file: one signal to its process group
reaches the all-in-one supervisor, the gateway and the pool launchers; the ranks, in sessions of
their own, die with their launcher (PR_SET_PDEATHSIG) and are killed besides if anything of them
is left. ``Server.pids`` names the gateway, the launchers and the ranks (for kill -9 drills).
Every wait is bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from dsinfer.base.cluster_secret import SECRET_ENV
from dsinfer.base.processes import free_port, terminate
from harness.provenance import parse_cpu_list, source_env
from harness.results import add_output_args

STOP_GRACE = 20.0  # seconds from SIGINT (the supervisor drains its pools) to SIGKILL
TAG_ENV = "DSINFER_TEST_SERVER_TAG"  # in a server's environment, so in every process it starts
RANK_MODULE = "dsinfer.workers.rank"
# The built-in tiny model with dummy weights in float32 (on the CPU, seeded: what the CPU
# benchmarks serve).
TINY_DUMMY = ["--model", "tiny", "--load-format", "dummy", "--dtype", "float32"]
TINY_CPU = [*TINY_DUMMY, "--device", "cpu", "--seed", "0"]


def alive(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until(predicate: Callable[[], Any], what: str, timeout: float, interval: float = 0.02) -> Any:
    """Poll ``predicate()`` every ``interval`` s until it gives something true (-> that), at most
    ``timeout`` s (then AssertionError: a test's failure, naming ``what``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def run_dsinfer(*args: str, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    """``dsinfer ARGS`` run to its end (bounded), its output captured as text."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        dsinfer_command(*args), capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def dsinfer_command(*args: str, python: str = sys.executable) -> list[str]:
    """``python -m dsinfer.cli.main ARGS``."""
    return [python, "-m", "dsinfer.cli.main", *args]


def add_serving_args(parser: argparse.ArgumentParser, output_len: int) -> None:
    """The flags a benchmark against tiny servers shares: prompt and output lengths, the KV budget
    per rank, the seed, where the server logs go (default a temporary folder) and its results."""
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (random ids)")
    parser.add_argument("--output-len", type=int, default=output_len, help="output tokens (ignore_eos)")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="KV cache per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--log-dir", type=Path, default=None, help="server logs (default: a temporary folder)"
    )
    add_output_args(parser)


def engine_env(
    engine: str, scratch: Path, cores: str, kv_space_gb: int, vllm_reserved_cpus: int | None
) -> dict[str, str]:
    """This environment for an engine or server pinned to ``cores`` (``taskset -c``): vLLM's caches
    and temporary files under ``scratch``, its KV space and reserved CPUs; the others one OpenMP
    thread per core."""
    env = dict(os.environ)
    env.update(
        {
            "TMPDIR": str(scratch / "tmp"),
            "VLLM_CACHE_ROOT": str(scratch / "vllm-cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor-cache"),
            "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gb),
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    if engine == "vllm":
        env.pop("OMP_NUM_THREADS", None)  # vLLM binds its own OpenMP threads
        if vllm_reserved_cpus is not None:  # default: it keeps one core for its scheduler
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(vllm_reserved_cpus)
    else:
        env["OMP_NUM_THREADS"] = str(len(parse_cpu_list(cores)))
    return env


def rank_spec(argv: list[str]) -> dict[str, Any] | None:
    """The JSON spec of a rank process (``--args-json``) from its command line; None for others."""
    if "--args-json" not in argv:
        return None
    with contextlib.suppress(IndexError, ValueError):
        return dict(json.loads(argv[argv.index("--args-json") + 1]))
    return None


def role_of(argv: list[str]) -> str:
    """What a process below a server is, from its command line: gateway, launcher, rank, the
    all-in-one supervisor, a vLLM API server or engine core, or other."""
    line = " ".join(argv)
    for needle, role in (
        ("--role gateway", "gateway"),
        (RANK_MODULE, "rank"),
        ("--role prefill", "launcher"),
        ("--role decode", "launcher"),
        ("--role colocated", "launcher"),
        ("vllm.entrypoints", "vllm api server"),
        ("dsinfer.cli.main serve", "all-in-one parent"),
    ):
        if needle in line:
            return role
    return "vllm engine core" if "python" in line or "VLLM" in line else "other"


def descendants(pid: int) -> list[psutil.Process]:
    """Every live process below ``pid`` (psutil guards each against pid reuse)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


@dataclass
class Server:
    """One server process: ``argv`` run with its output in ``log_path``, listening on ``port``
    (``control``: the gateway's control address, where it has one)."""

    argv: list[str]
    port: int
    log_path: Path
    control: str | None = None
    process: subprocess.Popen[bytes] | None = None
    started: float = field(default=0.0, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    def start(self, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        """Run ``argv`` in a session of its own (``env``: the whole environment; default this one's)."""
        env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
        self.started = time.monotonic()
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=cwd
            )

    # What it says ------------------------------------------------------------------------------
    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, chars: int = 4000) -> str:
        return self.log()[-chars:]

    def openai_client(self, api_key: str = "unused", timeout: float = 60.0, max_retries: int = 0) -> Any:
        """The official ``openai`` client for this server (no retries unless asked)."""
        import openai  # a test dependency: only what talks to a server through it needs it

        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=api_key, timeout=timeout, max_retries=max_retries
        )

    def metrics(self) -> str:
        """The Prometheus text of ``/metrics``."""
        return httpx.get(f"{self.base_url}/metrics", timeout=10).text

    def answers(self, path: str = "/ready") -> bool:
        """``path`` answers 200; ``/ready`` falls back to ``/health`` on a commit from before it."""
        status = httpx.get(f"{self.base_url}{path}", timeout=2).status_code
        if status == 404 and path == "/ready":
            status = httpx.get(f"{self.base_url}/health", timeout=2).status_code
        return status == 200

    def wait_ready(
        self,
        timeout: float,
        ready: Callable[[], bool] | None = None,
        give_up_on: str | None = None,
    ) -> float:
        """Until ``ready()`` (default: ``/ready`` answers 200, the pools can serve), at most
        ``timeout`` s; fails at once if the server exits or its log shows ``give_up_on``.
        -> seconds since the start."""
        ready = ready or self.answers
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log_tail()}")
            if give_up_on is not None and give_up_on in self.log():
                raise RuntimeError(f"the server's log says {give_up_on!r}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if ready():
                    return time.monotonic() - self.started
            time.sleep(0.25)
        raise TimeoutError(f"server not ready after {timeout:.0f} s:\n{self.log_tail()}")

    # Its processes -----------------------------------------------------------------------------
    def processes(self) -> list[psutil.Process]:
        """Every live process below the server (the gateway, launchers, ranks...)."""
        return descendants(self.pid)

    def tree(self) -> list[psutil.Process]:
        """The server's process and every live process below it."""
        return [psutil.Process(self.pid), *self.processes()]

    def pids(self) -> dict[str, list[int]]:
        """role (``role_of``) -> pids of the server's processes; "server" is the one started."""
        out: dict[str, list[int]] = {"server": [self.pid]}
        for proc in self.processes():
            out.setdefault(role_of(_cmdline(proc)), []).append(proc.pid)
        return {role: sorted(pids) for role, pids in out.items()}

    def ranks(self) -> list[tuple[int, dict[str, Any]]]:
        """(pid, spec) of every rank process below the server, the spec its ``--args-json``."""
        found = []
        for proc in self.processes():
            argv = _cmdline(proc)
            spec = rank_spec(argv) if RANK_MODULE in argv else None
            if spec is not None:
                found.append((proc.pid, spec))
        return sorted(found, key=lambda r: r[0])

    def rank_pids(
        self, role: str | None = None, pool: int | None = None, rank: int | None = None
    ) -> list[int]:
        """Pids of the rank processes of ``role``, ``pool`` and ``rank`` (each: any when None)."""
        return [
            pid
            for pid, spec in self.ranks()
            if (role is None or spec["pool"]["role"] == role)
            and (pool is None or spec["pool"]["pool_id"] == pool)
            and (rank is None or spec.get("rank") == rank)
        ]

    # Stopping ----------------------------------------------------------------------------------
    def stop(self, grace: float = STOP_GRACE) -> int | None:
        """SIGINT to the process group (the supervisor drains its pools), SIGKILL to it after
        ``grace`` s; then SIGKILL to every process that was below it and is still there.
        -> its exit code (None if never started)."""
        if self.process is None:
            return None
        below = self.processes()
        terminate([self.process], grace, signal.SIGINT, group=True)
        for proc in below:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(below, timeout=5)
        return self.process.returncode


@contextlib.contextmanager
def running(
    server: Server,
    timeout: float,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    ready: Callable[[], bool] | None = None,
    give_up_on: str | None = None,
    stop_grace: float = STOP_GRACE,
    say: Callable[[str], None] | None = None,
) -> Iterator[Server]:
    """``server`` started and ready (``Server.wait_ready``) within ``timeout`` s, and stopped
    when the block ends however it ends; ``say``: where its start, readiness and stop are told."""
    say = say or (lambda _: None)
    say(f"starting: {shlex.join(server.argv)} (log {server.log_path})")
    try:
        server.start(env, cwd)
        seconds = server.wait_ready(timeout, ready, give_up_on)
        say(f"ready after {seconds:.1f} s")
        yield server
    finally:
        stopping = time.monotonic()
        code = server.stop(stop_grace)
        say(f"stopped in {time.monotonic() - stopping:.1f} s (exit code {code})")


@contextlib.contextmanager
def serve(
    args: list[str],
    log_dir: Path,
    *,
    startup_timeout: float = 120.0,
    name: str | None = None,
    source: Path | None = None,
    env: dict[str, str] | None = None,
    python: str = sys.executable,
    prefix: list[str] | None = None,
    give_up_on: str | None = None,
    stop_grace: float = STOP_GRACE,
    say: Callable[[str], None] | None = None,
) -> Iterator[Server]:
    """``dsinfer serve --port P ARGS`` (any topology: ``--prefill-pools 2 --decode-pools 2
    --pool-size 2``...) until ``/ready`` says 200; stopped, whole process group, on exit.

    ``source``: a commit's export (``provenance.export_commit``) to run instead of the installed
    dsinfer; ``env``: on top of this environment; ``prefix``: before the command (``taskset -c
    0,1``); the log is ``log_dir/NAME.log`` (default ``serve-PORT``)."""
    port = free_port()
    argv = [*(prefix or []), *dsinfer_command("serve", "--port", str(port), *args, python=python)]
    server = Server(argv, port, log_dir / f"{name or f'serve-{port}'}.log")
    with running(
        server,
        startup_timeout,
        env=source_env(source, env),
        cwd=source,
        give_up_on=give_up_on,
        stop_grace=stop_grace,
        say=say,
    ) as s:
        yield s


@contextlib.contextmanager
def gateway(
    log_path: Path,
    secret: str,
    flags: list[str] | None = None,
    *,
    source: Path | None = None,
    startup_timeout: float = 120.0,
    stop_grace: float = STOP_GRACE,
) -> Iterator[Server]:
    """A gateway alone (``dsinfer serve --role gateway``) with the cluster ``secret``, on free HTTP
    and control ports (``Server.control``), until ``/health`` says 200; ranks register with it
    (``harness.played_rank``)."""
    port, control = free_port(), free_port()
    argv = dsinfer_command("serve", "--role", "gateway", "--port", str(port), "--control-port", str(control))
    server = Server([*argv, *(flags or [])], port, log_path, control=f"127.0.0.1:{control}")
    env = source_env(source, {SECRET_ENV: secret})
    ready = lambda: server.answers("/health")  # noqa: E731
    with running(server, startup_timeout, env=env, cwd=source, ready=ready, stop_grace=stop_grace) as s:
        yield s


# A server that must fail -------------------------------------------------------------------------
@dataclass
class Exit:
    code: int | None  # None: still running at the timeout (then killed)
    seconds: float
    log: str
    left: list[int]  # processes it started still alive once it exited (then killed)


def tagged_processes(tag: str) -> list[int]:
    """Pids of the live processes whose environment holds ``TAG_ENV=tag``."""
    needle = f"{TAG_ENV}={tag}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes()  # a zombie's is empty
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            pids.append(int(proc.name))
    return pids


def serve_until_exit(args: list[str], log_dir: Path, timeout: float, settle: float = 3.0) -> Exit:
    """``dsinfer serve ARGS`` until it exits, at most ``timeout`` s; then what it left running
    (``settle`` s after its exit), which is killed."""
    tag = uuid.uuid4().hex
    server = Server(dsinfer_command("serve", *args), 0, log_dir / f"serve-{tag}.log")
    server.start({**os.environ, TAG_ENV: tag})
    process = server.process
    assert process is not None
    left: list[int] = []
    try:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=timeout)
        seconds = time.monotonic() - server.started
        code = process.returncode
        deadline = time.monotonic() + settle
        while (left := tagged_processes(tag)) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        terminate([process], 0.0, signal.SIGKILL, group=True)
        for pid in tagged_processes(tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return Exit(code, seconds, server.log(), left)
