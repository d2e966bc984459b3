"""Command-line flags of one worker pool (``--pool-size`` ...) -> PoolArgs."""

from __future__ import annotations

import argparse
from typing import Any

from dsinfer.cli.engine_args import FieldFlags, field_default
from dsinfer.cli.errors import UsageError
from dsinfer.engine.args import EngineArgs
from dsinfer.gateway.args import GatewayArgs
from dsinfer.workers.args import TRANSFER_BACKENDS, PoolArgs


def add_pool_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("pool (--role prefill|decode|colocated)")
    flag = FieldFlags(group, PoolArgs)
    flag("pool_size", int)
    flag("pool_id", int)
    flag("nnodes", int)
    flag("node_rank", int)
    flag(
        "dist_init_addr",
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
    flag(
        "host",
        flag="--worker-host",
        help="address this node's ranks bind and advertise their inboxes on (default: %(default)s)",
    )
    flag("transfer_backend", choices=TRANSFER_BACKENDS)
    flag("kv_transfer_timeout", float)
    flag(
        "kv_quarantine",
        float,
        help="seconds an aborted transfer's pages stay unused (decode), or a request fenced before it "
        "arrived is refused (prefill) (default: %(default)s)",
    )
    flag(
        "threads_per_rank",
        int,
        help="torch threads per rank (default: the machine's cores shared by its ranks: a pool's local "
        "ranks, or every pool's in the all-in-one server)",
    )
    flag("max_restarts", int)
    flag("restart_backoff", float)
    group.add_argument(
        "--no-elastic-ep",
        dest="elastic_ep",
        action="store_false",
        help="a dead rank of a pool of several restarts the pool whole (default: the others serve on "
        "and the rank rejoins)",
    )
    flag("ep_timeout", float)
    group.add_argument(
        "--otlp-traces-endpoint",
        # one flag for both: the gateway's spans (GatewayArgs) and its pools' ranks' (PoolArgs)
        default=None,
        metavar="URL",
        help="OpenTelemetry collector (OTLP/HTTP, e.g. http://otel-collector:4318) that the gateway and "
        "the ranks send one trace per request to; needs pip install 'dsinfer[tracing]' (default: off)",
    )
    group.add_argument(
        "--drain-timeout",
        type=float,
        # one flag drains both: a pool's ranks (run_pool) and the gateway's streams (GatewayArgs)
        default=field_default(GatewayArgs, "drain_timeout"),
        help="SIGTERM: seconds ranks get to finish their requests before SIGKILL, and a gateway's "
        "streams before they end with an error event (default: %(default)s)",
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
    # every other field has a flag of its name; --host is the gateway's, the pool's is --worker-host
    named = {"role": role, "host": args.worker_host, "engine": engine}
    fields = {name: getattr(args, name) for name in PoolArgs.model_fields if name not in named}
    return PoolArgs(**{**fields, **named, **overrides})
