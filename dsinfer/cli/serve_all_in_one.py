"""All-in-one ``dsinfer serve`` (no ``--role``): a gateway and its pools as child processes here.

Each child is ``dsinfer serve --role ...`` with this command's flags passed through, so the
all-in-one server runs the code paths of a cluster. Pools restart their own ranks (their
launcher); the gateway dying, or a launcher giving up, stops everything with exit code 1.
SIGTERM or Ctrl-C drains the pools, then stops the gateway, and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from dsinfer.cli.engine_args import add_engine_args, engine_args_from
from dsinfer.cli.errors import UsageError
from dsinfer.cli.gateway_args import API_KEY_ENV, add_gateway_args, gateway_args_from
from dsinfer.cli.pool_args import add_pool_args, pool_args_from
from dsinfer.cli.serve import POOL_ONLY, actions_of
from dsinfer.workers.args import PoolArgs
from dsinfer.workers.launcher import KILL_GRACE, POLL_INTERVAL, StopSignals, free_port, spawn, terminate

log = logging.getLogger("dsinfer.serve")

CLI_MODULE = "dsinfer.cli.main"
ANY_ADDRESS = ("", "0.0.0.0", "::")


@dataclass(frozen=True)
class PoolSpec:
    role: str
    pool_id: int
    size: int

    @property
    def name(self) -> str:
        return f"{self.role} pool {self.pool_id}"


@dataclass(frozen=True)
class Layout:
    pools: tuple[PoolSpec, ...]
    threads_per_rank: int

    @property
    def num_ranks(self) -> int:
        return sum(p.size for p in self.pools)


def layout_of(args: argparse.Namespace) -> Layout:
    for flag in ("prefill_pool_size", "decode_pool_size", "prefill_pools", "decode_pools"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.colocated:
        pools = tuple(PoolSpec("colocated", i, args.decode_pool_size) for i in range(args.decode_pools))
    else:
        pools = tuple(PoolSpec("prefill", i, args.prefill_pool_size) for i in range(args.prefill_pools))
        pools += tuple(PoolSpec("decode", i, args.decode_pool_size) for i in range(args.decode_pools))
    ranks = sum(p.size for p in pools)
    threads = args.threads_per_rank or max(1, (os.cpu_count() or 1) // ranks)
    return Layout(pools, threads)


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
            threads_per_rank=layout.threads_per_rank,
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
    args: argparse.Namespace, layout: Layout, control_port: int, cli_module: str = CLI_MODULE
) -> list[Child]:
    """The gateway, then every pool, as ``dsinfer serve --role ...`` with this command's flags.

    The API key goes through the environment, not the command line other users can read."""
    base = [sys.executable, "-m", cli_module, "--log-level", args.log_level, "serve"]
    engine = flags_of(args, actions_of(add_engine_args))
    gateway_ns = argparse.Namespace(**{**vars(args), "control_port": control_port})
    gateway_flags = flags_of(gateway_ns, actions_of(add_gateway_args), skip=("api_key",))
    env = {**os.environ, API_KEY_ENV: args.api_key} if args.api_key else None
    children = [Child("gateway", [*base, "--role", "gateway", *engine, *gateway_flags], env)]
    pool_flags = flags_of(args, actions_of(add_pool_args), skip=(*POOL_ONLY, "threads_per_rank"))
    gateway_addr = f"{connect_host(args.host)}:{control_port}"
    for spec in layout.pools:
        own = ["--role", spec.role, "--pool-id", str(spec.pool_id), "--pool-size", str(spec.size)]
        own += ["--gateway-addr", gateway_addr, "--threads-per-rank", str(layout.threads_per_rank)]
        children.append(Child(spec.name, [*base, *own, *engine, *pool_flags]))
    return children


# Run and supervise -----------------------------------------------------------------------------
def run_all_in_one(args: argparse.Namespace, *, cli_module: str = CLI_MODULE) -> int:
    layout = layout_of(args)
    gateway = gateway_args_from(args)
    pools = pool_args_of(args, layout, "127.0.0.1:0")  # every pool is checked before anything starts
    if args.dry_run:
        from dsinfer.cli.serve_plan import print_all_in_one_plan

        print_all_in_one_plan(layout, gateway, pools, gateway.control_port)
        return 0
    control_port = gateway.control_port or free_port(connect_host(gateway.host))
    specs = children_of(args, layout, control_port, cli_module)
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
        return _supervise(children, signals, args.drain_timeout)
    finally:
        _stop(children, args.drain_timeout)
        signals.restore()


def _supervise(
    children: list[tuple[str, subprocess.Popen[bytes]]], signals: StopSignals, drain_timeout: float
) -> int:
    while signals.requested is None:
        for name, proc in children:
            code = proc.poll()
            if code is not None:
                print(f"dsinfer: error: {name} exited with code {code}; stopping everything", file=sys.stderr)
                return 1
        time.sleep(POLL_INTERVAL)
    log.info("all-in-one: stopping (pools drain for up to %.0f s, then the gateway stops)", drain_timeout)
    return 0


def _stop(children: list[tuple[str, subprocess.Popen[bytes]]], drain_timeout: float) -> None:
    """Pools first (they drain, their tokens still reach the gateway), then the gateway."""
    pools = [proc for name, proc in children if name != "gateway"]
    terminate(pools, drain_timeout + KILL_GRACE)
    terminate([proc for name, proc in children if name == "gateway"], KILL_GRACE)
    if children:
        codes = ", ".join(f"{name} {proc.returncode}" for name, proc in children)
        log.info("all-in-one: stopped (exit codes: %s)", codes)
