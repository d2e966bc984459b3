"""All-in-one ``dsinfer serve`` (no ``--role``): a gateway and its pools as child processes here.

Each child is ``dsinfer serve --role ...`` with this command's flags passed through, so the
all-in-one server runs the code paths of a cluster. The children share a cluster secret made
for this run (or the one given), passed in their environment, never on a command line. Pools
restart their own ranks (their launcher); a gateway that dies is started again on the same
ports while the pools keep running (their ranks register with the new one as soon as it is up),
with a back-off that doubles up to 30 s and ``--max-restarts`` restarts. A launcher giving up
stops everything with exit code 1. SIGTERM or Ctrl-C drains the pools, then stops the gateway,
and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from dsinfer.base.cluster_secret import SECRET_ENV, generate_secret, load_secret
from dsinfer.cli.engine_args import add_engine_args, engine_args_from
from dsinfer.cli.flags import POOL_ONLY, actions_of
from dsinfer.cli.gateway_args import API_KEY_ENV, add_gateway_args, gateway_args_from
from dsinfer.cli.layout import Layout, layout_of
from dsinfer.cli.pool_args import add_pool_args, pool_args_from
from dsinfer.workers.args import PoolArgs
from dsinfer.workers.launcher import KILL_GRACE, POLL_INTERVAL, StopSignals, free_port, spawn, terminate

log = logging.getLogger("dsinfer.serve")

CLI_MODULE = "dsinfer.cli.main"
ANY_ADDRESS = ("", "0.0.0.0", "::")
GATEWAY_BACKOFF = 0.5  # seconds before the first restart of a dead gateway (doubles, capped)
MAX_BACKOFF = 30.0
HEALTHY_RESET = 60.0  # a gateway that ran this long resets the back-off and the restart count


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
            threads_per_rank=layout.threads_by_role[spec.role],
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
class Child:
    name: str
    argv: list[str]
    env: dict[str, str] | None = None  # None = this process's environment


def children_of(
    args: argparse.Namespace,
    layout: Layout,
    control_port: int,
    secret: str,
    cli_module: str = CLI_MODULE,
) -> list[Child]:
    """The gateway, then every pool, as ``dsinfer serve --role ...`` with this command's flags.

    The cluster secret and the API key go through the environment, not the command line other
    users can read."""
    base = [sys.executable, "-m", cli_module, "--log-level", args.log_level, "serve"]
    engine = flags_of(args, actions_of(add_engine_args))
    gateway_ns = argparse.Namespace(**{**vars(args), "control_port": control_port})
    gateway_flags = flags_of(gateway_ns, actions_of(add_gateway_args), skip=("api_key",))
    env = {**os.environ, SECRET_ENV: secret}
    gateway_env = {**env, API_KEY_ENV: args.api_key} if args.api_key else env
    children = [Child("gateway", [*base, "--role", "gateway", *engine, *gateway_flags], gateway_env)]
    pool_flags = flags_of(args, actions_of(add_pool_args), skip=(*POOL_ONLY, "threads_per_rank"))
    gateway_addr = f"{connect_host(args.host)}:{control_port}"
    for spec in layout.pools:
        own = ["--role", spec.role, "--pool-id", str(spec.pool_id), "--pool-size", str(spec.size)]
        own += ["--gateway-addr", gateway_addr, "--threads-per-rank", str(layout.threads_by_role[spec.role])]
        children.append(Child(spec.name, [*base, *own, *engine, *pool_flags], env))
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
    control_port = gateway.control_port or free_port(connect_host(gateway.host))
    secret = load_secret(args.cluster_secret_file) or generate_secret()
    specs = children_of(args, layout, control_port, secret, cli_module)
    signals = StopSignals()
    children: list[tuple[str, subprocess.Popen[bytes]]] = []
    try:
        for child in specs:
            children.append((child.name, spawn(child.argv, child.env)))
        log.info(
            "all-in-one: API at http://%s:%d/v1; pools register on control port %d; %s",
            connect_host(gateway.host),
            gateway.port,
            control_port,
            ", ".join(f"{name} pid {proc.pid}" for name, proc in children),
        )
        return _supervise(children, specs[0], signals, args)
    finally:
        _stop(children, args.drain_timeout)
        signals.restore()


class _Restarts:
    """The gateway's restart budget: a doubling back-off, reset by a long enough run."""

    def __init__(self, max_restarts: int) -> None:
        self.max_restarts, self.count, self.backoff = max_restarts, 0, GATEWAY_BACKOFF
        self.started_at = time.monotonic()

    def next_delay(self) -> float | None:
        """Seconds to wait before the next start, or None when the budget is spent."""
        if time.monotonic() - self.started_at >= HEALTHY_RESET:
            self.count, self.backoff = 0, GATEWAY_BACKOFF
        if self.count >= self.max_restarts:
            return None
        self.count += 1
        delay, self.backoff = self.backoff, min(self.backoff * 2, MAX_BACKOFF)
        return delay


def _supervise(
    children: list[tuple[str, subprocess.Popen[bytes]]],
    gateway: Child,
    signals: StopSignals,
    args: argparse.Namespace,
) -> int:
    restarts = _Restarts(args.max_restarts)
    while signals.requested is None:
        for i, (name, proc) in enumerate(children):
            code = proc.poll()
            if code is None:
                continue
            delay = restarts.next_delay() if name == gateway.name else None
            if delay is None:
                print(f"dsinfer: error: {name} exited with code {code}; stopping everything", file=sys.stderr)
                return 1
            log.warning(
                "all-in-one: the gateway exited with code %d; restart %d/%d in %.1f s (the pools keep running)",
                code,
                restarts.count,
                restarts.max_restarts,
                delay,
            )
            if not _sleep(delay, signals):
                break
            children[i] = (name, spawn(gateway.argv, gateway.env))
            restarts.started_at = time.monotonic()
            log.info("all-in-one: gateway pid %d", children[i][1].pid)
        time.sleep(POLL_INTERVAL)
    log.info(
        "all-in-one: stopping (pools drain for up to %.0f s, then the gateway stops)", args.drain_timeout
    )
    return 0


def _sleep(seconds: float, signals: StopSignals) -> bool:
    """Sleep unless a stop is requested; False if one was."""
    deadline = time.monotonic() + seconds
    while signals.requested is None:
        if time.monotonic() >= deadline:
            return True
        time.sleep(min(POLL_INTERVAL, max(0.0, deadline - time.monotonic())))
    return False


def _stop(children: list[tuple[str, subprocess.Popen[bytes]]], drain_timeout: float) -> None:
    """Pools first (they drain, their tokens still reach the gateway), then the gateway."""
    pools = [proc for name, proc in children if name != "gateway"]
    terminate(pools, drain_timeout + KILL_GRACE)
    terminate([proc for name, proc in children if name == "gateway"], KILL_GRACE)
    if children:
        codes = ", ".join(f"{name} {proc.returncode}" for name, proc in children)
        log.info("all-in-one: stopped (exit codes: %s)", codes)
