"""Command-line flags of one worker pool (``--pool-size`` ...) -> PoolArgs."""

from __future__ import annotations

import argparse
from typing import Any

from dsinfer.cli.errors import UsageError
from dsinfer.engine.args import EngineArgs
from dsinfer.workers.args import TRANSFER_BACKENDS, PoolArgs

DRAIN_TIMEOUT = 30.0


def add_pool_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("pool (--role prefill|decode|colocated)")
    group.add_argument("--pool-size", type=int, default=1, help="ranks in the pool (= EP size = DP size)")
    group.add_argument("--pool-id", type=int, default=0, help="this pool's number among its role's pools")
    group.add_argument("--nnodes", type=int, default=1, help="machines the pool spans")
    group.add_argument("--node-rank", type=int, default=0, help="this machine's index in [0, nnodes)")
    group.add_argument(
        "--dist-init-addr",
        default=None,
        help="HOST:PORT of the pool's torch.distributed store: rank 0's (several nodes), the launcher's "
        "(one node; default: a free port)",
    )
    group.add_argument(
        "--gateway-addr",
        default=None,
        help="HOST:PORT of the gateway's control socket; several gateways: HOST:PORT,HOST:PORT or a "
        "name that resolves to each (the ranks register with every one)",
    )
    group.add_argument(
        "--worker-host",
        default="127.0.0.1",
        help="address this node's ranks bind and advertise their inboxes on",
    )
    group.add_argument("--transfer-backend", default="nixl", choices=TRANSFER_BACKENDS)
    group.add_argument(
        "--kv-transfer-timeout", type=float, default=30.0, help="seconds decode waits for a prefill's KV"
    )
    group.add_argument(
        "--kv-quarantine",
        type=float,
        default=60.0,
        help="seconds an aborted transfer's pages stay unused (decode), or a request fenced before it "
        "arrived is refused (prefill)",
    )
    group.add_argument(
        "--threads-per-rank",
        type=int,
        default=None,
        help="torch threads per rank (default: the cores shared by the local ranks of one role)",
    )
    group.add_argument(
        "--max-restarts", type=int, default=100, help="pool restarts before the launcher gives up"
    )
    group.add_argument(
        "--restart-backoff", type=float, default=1.0, help="seconds before a restart (doubles, capped at 30)"
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
        default=10.0,
        help="seconds a serving pool's collective waits for a peer before a hung one counts as dead "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--drain-timeout",
        type=float,
        default=DRAIN_TIMEOUT,
        help="SIGTERM: seconds ranks get to finish their requests before SIGKILL, and a gateway's "
        "streams before they end with an error event",
    )


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
