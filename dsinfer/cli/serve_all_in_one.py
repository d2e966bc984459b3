"""All-in-one ``dsinfer serve`` (no ``--role``): a gateway and its pools as child processes here.

Each child is ``dsinfer serve --role ...`` with this command's flags passed through, so the
all-in-one server runs the code paths of a cluster. The children share a cluster secret made
for this run (or the one given), passed in their environment, never on a command line. Pools
restart their own ranks (their launcher); a gateway that dies is started again on the same
ports while the pools keep running (their ranks register with the new one as soon as it is up),
with a back-off that doubles up to 30 s and ``--max-restarts`` restarts. A launcher giving up
stops everything with exit code 1. SIGTERM or Ctrl-C drains the pools, then stops the gateway,
and exits 0; a second Ctrl-C stops everything at once.

A child that fails before it was ever ready is not restarted: it would fail alike (a bad flag, a
checkpoint the ranks cannot load, a port in use). The gateway is ready once it listens on its
HTTP port; a launcher exits with ``STARTUP_FAILED`` itself when its ranks fail before its pool was
up. Then everything else stops at once and the command exits with ``STARTUP_FAILED``, its last
line the child's error. The children's stderr goes through this process (dsinfer/base/processes.py
``Child``), their ``dsinfer: error:`` lines held back so that the one reported is printed once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from dsinfer.base import processes
from dsinfer.base.cluster_secret import SECRET_ENV, generate_secret, load_secret
from dsinfer.cli.engine_args import add_engine_args, engine_args_from
from dsinfer.cli.flags import POOL_ONLY, SHARED_WITH_GATEWAY, actions_of
from dsinfer.cli.gateway_args import API_KEY_ENV, add_gateway_args, gateway_args_from
from dsinfer.cli.layout import Layout, layout_of
from dsinfer.cli.pool_args import add_pool_args, pool_args_from
from dsinfer.workers.args import PoolArgs

log = logging.getLogger("dsinfer.serve")

CLI_MODULE = "dsinfer.cli.main"
ANY_ADDRESS = ("", "0.0.0.0", "::")
GATEWAY_BACKOFF = 0.5  # seconds before the first restart of a dead gateway (doubles, capped)
POLL_INTERVAL = 0.2  # seconds between checks of the children


def connect_host(host: str) -> str:
    """Where processes on this machine reach a socket bound at ``host``."""
    return "127.0.0.1" if host in ANY_ADDRESS else host


def pool_args_of(args: argparse.Namespace, layout: Layout, gateway_addr: str) -> list[PoolArgs]:
    engine = engine_args_from(args)
    return [
        pool_args_from(
            args,
            spec.role,
            engine,
            pool_id=spec.pool_id,
            pool_size=spec.size,
            gateway_addr=gateway_addr,
            threads_per_rank=layout.threads,
        )
        for spec in layout.pools
    ]


# Child command lines ---------------------------------------------------------------------------
def flags_of(
    args: argparse.Namespace, actions: list[argparse.Action], skip: tuple[str, ...] = ()
) -> list[str]:
    """The command-line tokens that reproduce ``args``' values of ``actions``."""
    tokens: list[str] = []
    for action in actions:
        if action.dest in skip or not action.option_strings or action.default == argparse.SUPPRESS:
            continue
        value = getattr(args, action.dest)
        flag = max(action.option_strings, key=len)
        if action.nargs == 0:
            tokens += [flag] if value == action.const else []
        elif isinstance(value, list):
            tokens += [flag, *map(str, value)]
        elif value is not None:
            tokens += [flag, str(value)]
    return tokens


@dataclass(frozen=True)
class ChildCommand:
    name: str
    argv: list[str]
    env: dict[str, str] | None = None  # None = this process's environment


def children_of(
    args: argparse.Namespace,
    layout: Layout,
    control_port: int,
    secret: str,
    cli_module: str = CLI_MODULE,
) -> list[ChildCommand]:
    """The gateway, then every pool, as ``dsinfer serve --role ...`` with this command's flags.

    The cluster secret and the API key go through the environment, not the command line other
    users can read."""
    base = [sys.executable, "-m", cli_module, "--log-level", args.log_level, "serve"]
    engine = flags_of(args, actions_of(add_engine_args))
    gateway_ns = argparse.Namespace(**{**vars(args), "control_port": control_port})
    shared = [a for a in actions_of(add_pool_args) if a.dest in SHARED_WITH_GATEWAY]
    gateway_flags = flags_of(gateway_ns, [*actions_of(add_gateway_args), *shared], skip=("api_key",))
    env = {**os.environ, SECRET_ENV: secret}
    gateway_env = {**env, API_KEY_ENV: args.api_key} if args.api_key else env
    children = [ChildCommand("gateway", [*base, "--role", "gateway", *engine, *gateway_flags], gateway_env)]
    pool_flags = flags_of(args, actions_of(add_pool_args), skip=(*POOL_ONLY, "threads_per_rank"))
    gateway_addr = f"{connect_host(args.host)}:{control_port}"
    for spec in layout.pools:
        own = ["--role", spec.role, "--pool-id", str(spec.pool_id), "--pool-size", str(spec.size)]
        own += ["--gateway-addr", gateway_addr, "--threads-per-rank", str(layout.threads)]
        children.append(ChildCommand(spec.name, [*base, *own, *engine, *pool_flags], env))
    return children


# Run and supervise -----------------------------------------------------------------------------
def run_all_in_one(args: argparse.Namespace, *, cli_module: str = CLI_MODULE) -> int:
    layout = layout_of(args)
    pools = pool_args_of(args, layout, "127.0.0.1:0")  # every pool is checked before anything starts
    gateway = gateway_args_from(args)
    if args.dry_run:
        from dsinfer.cli.serve_plan import print_all_in_one_plan

        print_all_in_one_plan(layout, gateway, pools, gateway.control_port)
        return 0
    control_port = gateway.control_port or processes.free_port(connect_host(gateway.host))
    secret = load_secret(args.cluster_secret_file) or generate_secret()
    specs = children_of(args, layout, control_port, secret, cli_module)
    signals = processes.StopSignals()
    children: list[processes.Child] = []
    failure: _Failure | None = None
    try:
        for spec in specs:
            children.append(processes.Child(spec.name, spec.argv, spec.env))
        log.info(
            "all-in-one: API at http://%s:%d/v1; pools register on control port %d; %s",
            connect_host(gateway.host),
            gateway.port,
            control_port,
            ", ".join(f"{child.name} pid {child.pid}" for child in children),
        )
        gateway_ports = _GatewayPorts(gateway.port, control_port)
        failure = _supervise(children, specs[0], gateway_ports, signals, args.max_restarts)
    finally:
        if failure is not None and failure.at_once:
            _stop_at_once(children)
            _log_stopped(children)
        else:
            _stop(children, args.drain_timeout, signals)
        signals.restore()
    if failure is None:
        return 0
    print(failure.line, file=sys.stderr)
    return failure.code


@dataclass(frozen=True)
class _GatewayPorts:
    http: int  # 0: any free port
    control: int

    def ready(self, gateway: processes.Child) -> bool:
        """The gateway listens on its HTTP port (this process, not another one on that port)."""
        ports = processes.listening_ports(gateway.pid)
        return self.http in ports if self.http else bool(ports - {self.control})


@dataclass(frozen=True)
class _Failure:
    line: str  # printed once everything stopped
    code: int  # the command's exit status
    at_once: bool  # nothing ever served: the others stop without a drain


def _supervise(
    children: list[processes.Child],
    gateway: ChildCommand,
    ports: _GatewayPorts,
    signals: processes.StopSignals,
    max_restarts: int,
) -> _Failure | None:
    """Watch the children until a stop is requested (-> None) or one fails for good."""
    restarts = processes.Backoff(GATEWAY_BACKOFF, max_restarts)
    gateway_up = False  # the gateway listened once: from then on its exits are restarted
    while signals.requested is None:
        if not gateway_up and ports.ready(children[0]):
            gateway_up = True
            log.info("all-in-one: the gateway listens on port %d", ports.http)
        for i, child in enumerate(children):
            code = child.proc.poll()
            if code is None:
                continue
            if child.name != gateway.name:
                return _pool_failure(child, code)
            if not gateway_up:
                return _Failure(_startup_failure(child, code), processes.STARTUP_FAILED, at_once=True)
            delay = restarts.next_delay()
            if delay is None:
                line = f"{processes.ERROR_PREFIX}{child.name} exited with code {code}; stopping everything"
                return _Failure(line, 1, at_once=False)
            child.release()
            log.warning(
                "all-in-one: the gateway exited with code %d; restart %d/%d in %.1f s (the pools keep running)",
                code,
                restarts.count,
                restarts.max_restarts,
                delay,
            )
            if not signals.sleep(delay, POLL_INTERVAL):
                break
            children[i] = processes.Child(gateway.name, gateway.argv, gateway.env)
            restarts.started()
            log.info("all-in-one: gateway pid %d", children[i].pid)
        time.sleep(POLL_INTERVAL)
    return None


def _pool_failure(launcher: processes.Child, code: int) -> _Failure:
    """A pool launcher exited: never restarted here (it restarts its own ranks). Its own error
    line, if it printed one, is the one to show."""
    reported = launcher.reported_error()
    line = reported or f"{processes.ERROR_PREFIX}{launcher.name} exited with code {code}; stopping everything"
    startup = code == processes.STARTUP_FAILED
    return _Failure(line, processes.STARTUP_FAILED if startup else 1, at_once=startup)


def _startup_failure(child: processes.Child, code: int) -> str:
    reported = child.reported_error()
    if reported is not None:
        return reported
    line = f"{processes.ERROR_PREFIX}{child.name} exited with code {code} before it was ready"
    detail = child.error_detail()
    return f"{line}: {detail}" if detail else line


def _split(children: list[processes.Child]) -> tuple[list[processes.Child], list[processes.Child]]:
    """-> (the pool launchers, the gateway)."""
    pools = [child for child in children if child.name != "gateway"]
    return pools, [child for child in children if child.name == "gateway"]


def _stop(children: list[processes.Child], drain_timeout: float, signals: processes.StopSignals) -> None:
    """Pools first (they drain, their tokens still reach the gateway), then the gateway; a second
    Ctrl-C (or SIGTERM) on the way stops whatever is left at once."""
    log.info(
        "all-in-one: stopping (pools drain for up to %.0f s, then the gateway stops; a second "
        "Ctrl-C stops everything at once)",
        drain_timeout,
    )
    pools, gateway = (_procs(group) for group in _split(children))
    processes.send(pools, signal.SIGTERM)
    processes.wait_all(pools, drain_timeout + processes.KILL_GRACE, cut_short=signals.is_forced)
    if not signals.forced:
        processes.kill(pools)
        processes.send(gateway, signal.SIGTERM)
        processes.wait_all(gateway, processes.KILL_GRACE, cut_short=signals.is_forced)
    if signals.forced:
        log.warning("all-in-one: second stop signal: stopping every process now, not waiting for the drain")
        _stop_at_once(children)
    processes.kill(_procs(children))
    for child in children:
        child.release()
    _log_stopped(children)


def _stop_at_once(children: list[processes.Child]) -> None:
    """Nothing to drain: the gateway is killed; a launcher gets a second stop signal, on which it
    kills its ranks and cleans up, and SIGKILL if it is not gone after ``KILL_GRACE``."""
    pools, gateway = (_procs(group) for group in _split(children))
    processes.kill(gateway)
    processes.send(pools, signal.SIGTERM)
    processes.send(pools, signal.SIGINT)
    processes.wait_all(pools, processes.KILL_GRACE)
    processes.kill(pools)


def _log_stopped(children: list[processes.Child]) -> None:
    if children:
        codes = ", ".join(f"{child.name} {child.proc.returncode}" for child in children)
        log.info("all-in-one: stopped (exit codes: %s)", codes)


def _procs(children: list[processes.Child]) -> list[subprocess.Popen[bytes]]:
    return [child.proc for child in children]
