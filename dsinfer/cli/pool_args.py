"""Command-line flags of one worker pool (``--pool-size`` ...) -> PoolArgs."""

from __future__ import annotations

import argparse
from typing import Any

from dsinfer.cli.engine_args import field_default, field_help
from dsinfer.cli.errors import UsageError
from dsinfer.engine.args import EngineArgs
from dsinfer.gateway.args import GatewayArgs
from dsinfer.workers.args import TRANSFER_BACKENDS, PoolArgs


def add_pool_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("pool (--role prefill|decode|colocated)")
    group.add_argument(
        "--pool-size",
        type=int,
        default=_default("pool_size"),
        help=f"{_help('pool_size')} (default: %(default)s)",
    )
    group.add_argument(
        "--pool-id", type=int, default=_default("pool_id"), help=f"{_help('pool_id')} (default: %(default)s)"
    )
    group.add_argument(
        "--nnodes", type=int, default=_default("nnodes"), help=f"{_help('nnodes')} (default: %(default)s)"
    )
    group.add_argument(
        "--node-rank",
        type=int,
        default=_default("node_rank"),
        help=f"{_help('node_rank')} (default: %(default)s)",
    )
    group.add_argument(
        "--dist-init-addr",
        default=_default("dist_init_addr"),
        help="HOST:PORT of the pool's torch.distributed store: rank 0's (several nodes), the launcher's "
        "(one node; default: a free port)",
    )
    group.add_argument(
        "--gateway-addr",
        # PoolArgs requires it; None here is "not given", which check_role_flags refuses for a pool
        default=None,
        help="HOST:PORT of the gateway's control socket; several gateways: HOST:PORT,HOST:PORT or a "
        "name that resolves to each (the ranks register with every one)",
    )
    group.add_argument(
        "--worker-host",
        default=_default("host"),
        help="address this node's ranks bind and advertise their inboxes on (default: %(default)s)",
    )
    group.add_argument(
        "--transfer-backend",
        default=_default("transfer_backend"),
        choices=TRANSFER_BACKENDS,
        help=f"{_help('transfer_backend')} (default: %(default)s)",
    )
    group.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=_default("kv_transfer_timeout"),
        help=f"{_help('kv_transfer_timeout')} (default: %(default)s)",
    )
    group.add_argument(
        "--kv-quarantine",
        type=float,
        default=_default("kv_quarantine"),
        help="seconds an aborted transfer's pages stay unused (decode), or a request fenced before it "
        "arrived is refused (prefill) (default: %(default)s)",
    )
    group.add_argument(
        "--threads-per-rank",
        type=int,
        default=_default("threads_per_rank"),
        help="torch threads per rank (default: the cores shared by the local ranks of one role)",
    )
    group.add_argument(
        "--max-restarts",
        type=int,
        default=_default("max_restarts"),
        help=f"{_help('max_restarts')} (default: %(default)s)",
    )
    group.add_argument(
        "--restart-backoff",
        type=float,
        default=_default("restart_backoff"),
        help=f"{_help('restart_backoff')} (default: %(default)s)",
    )
    group.add_argument(
        "--no-elastic-ep",
        dest="elastic_ep",
        action="store_false",
        help="a dead rank of a pool of several restarts the pool whole (default: the others serve on "
        "and the rank rejoins)",
    )
    group.add_argument(
        "--ep-timeout",
        type=float,
        default=_default("ep_timeout"),
        help=f"{_help('ep_timeout')} (default: %(default)s)",
    )
    group.add_argument(
        "--drain-timeout",
        type=float,
        # one flag drains both: a pool's ranks (run_pool) and the gateway's streams (GatewayArgs)
        default=field_default(GatewayArgs, "drain_timeout"),
        help="SIGTERM: seconds ranks get to finish their requests before SIGKILL, and a gateway's "
        "streams before they end with an error event (default: %(default)s)",
    )


def _default(name: str) -> Any:
    return field_default(PoolArgs, name)


def _help(name: str) -> str:
    return field_help(PoolArgs, name)


def check_launcher_flags(args: argparse.Namespace) -> None:
    """Flags PoolArgs does not validate itself."""
    checks = [
        (args.pool_id >= 0, f"--pool-id must be >= 0, got {args.pool_id}"),
        (args.threads_per_rank is None or args.threads_per_rank >= 1, "--threads-per-rank must be >= 1"),
        (args.max_restarts >= 0, f"--max-restarts must be >= 0, got {args.max_restarts}"),
        (args.restart_backoff >= 0, f"--restart-backoff must be >= 0, got {args.restart_backoff}"),
        (args.drain_timeout > 0, f"--drain-timeout must be positive, got {args.drain_timeout}"),
    ]
    for ok, message in checks:
        if not ok:
            raise UsageError(message)


def pool_args_from(args: argparse.Namespace, role: str, engine: EngineArgs, **overrides: Any) -> PoolArgs:
    """PoolArgs from parsed flags (``overrides`` win); pydantic's ValidationError names a bad value."""
    check_launcher_flags(args)
    fields = dict(
        role=role,
        pool_id=args.pool_id,
        pool_size=args.pool_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr,
        gateway_addr=args.gateway_addr,
        host=args.worker_host,
        engine=engine,
        transfer_backend=args.transfer_backend,
        kv_transfer_timeout=args.kv_transfer_timeout,
        kv_quarantine=args.kv_quarantine,
        threads_per_rank=args.threads_per_rank,
        max_restarts=args.max_restarts,
        restart_backoff=args.restart_backoff,
        elastic_ep=args.elastic_ep,
        ep_timeout=args.ep_timeout,
    )
    return PoolArgs(**{**fields, **overrides})
