"""``dsinfer serve``: the gateway, one pool, or everything on this machine (no ``--role``).

Every flag can also come from ``--config FILE``, a YAML mapping of flag names (dashes or
underscores) to values; flags on the command line override the file. ``--dry-run`` prints the
layout and memory plan and exits without starting anything.

A role process (``--role``) needs the cluster secret the gateway and the pools share
(``--cluster-secret-file`` or ``$DSINFER_CLUSTER_SECRET``) and refuses to start without it; the
all-in-one server makes one per run unless given one, and hands it to its children through
their environment.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from dsinfer.base.cluster_secret import load_secret, missing_secret_error
from dsinfer.base.documents import read_document
from dsinfer.base.model_config import is_v4, read_model_config
from dsinfer.base.presets import resolve_model
from dsinfer.base.tracing import endpoint_problem
from dsinfer.cli.engine_args import add_engine_args, engine_args_from
from dsinfer.cli.errors import UsageError
from dsinfer.cli.flags import POOL_ONLY
from dsinfer.cli.gateway_args import add_gateway_args, gateway_args_from
from dsinfer.cli.pool_args import add_pool_args, pool_args_from
from dsinfer.engine.args import parse_size
from dsinfer.workers.args import PoolArgs

log = logging.getLogger("dsinfer.serve")
SERVE_ROLES = ("gateway", "prefill", "decode", "colocated")
ALL_IN_ONE_ONLY = ("prefill_pool_size", "decode_pool_size", "prefill_pools", "decode_pools", "colocated")


class OneLineParser(argparse.ArgumentParser):
    """Reports a bad flag as a UsageError (one line, exit 2 in main) instead of usage + exit."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--role", choices=SERVE_ROLES, default=None, help="one process of a deployment (default: all-in-one)"
    )
    parser.add_argument("--config", default=None, metavar="FILE", help="YAML of flag names -> values")
    parser.add_argument("--dry-run", action="store_true", help="print the layout and memory plan, then exit")
    parser.add_argument(
        "--cluster-secret-file",
        default=None,
        metavar="FILE",
        help="the secret the gateway and every pool share (default: $DSINFER_CLUSTER_SECRET); the "
        "control plane accepts only processes that hold it. The all-in-one server makes its own",
    )
    parser.add_argument(
        "--gpu-memory",
        default=None,
        metavar="SIZE",
        help="memory of one GPU (e.g. 80GB): a pool whose memory plan exceeds it is refused before it starts",
    )
    add_engine_args(parser)
    add_pool_args(parser)
    add_gateway_args(parser)
    group = parser.add_argument_group("all-in-one (no --role)")
    for flag, text in (
        ("--prefill-pool-size", "ranks per prefill pool"),
        ("--decode-pool-size", "ranks per decode (or colocated) pool"),
        ("--prefill-pools", "prefill pools"),
        ("--decode-pools", "decode pools, colocated ones with --colocated"),
    ):
        group.add_argument(flag, type=int, default=1, help=f"{text} (default: %(default)s)")
    group.add_argument(
        "--colocated", action="store_true", help="--decode-pools colocated pools and no prefill pools"
    )


def serve_parser(prog: str = "dsinfer serve") -> OneLineParser:
    parser = OneLineParser(prog=prog, add_help=False)
    add_serve_args(parser)
    return parser


# --config FILE ---------------------------------------------------------------------------------
def apply_config(args: argparse.Namespace, argv: Sequence[str]) -> argparse.Namespace:
    """Re-parse ``serve``'s flags with the file's in front, so that the command line wins."""
    tokens = config_tokens(Path(args.config))
    serve_argv = _after_command(list(argv), "serve")
    merged = serve_parser().parse_args([*tokens, *serve_argv])
    for name in ("command", "log_level"):
        setattr(merged, name, getattr(args, name))
    return merged


def config_tokens(path: Path) -> list[str]:
    """The file's settings as command-line tokens, checked by the serve parser (errors name the file)."""
    data = read_document(path, "YAML", "config", UsageError)
    if data is None:
        return []
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a mapping of flag names to values, got {type(data).__name__}")
    parser = serve_parser(prog=str(path))
    options = {opt: a for a in parser._actions for opt in a.option_strings}
    tokens: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        action = options.get(flag)
        if action is None or flag == "--config":
            raise UsageError(f"{path}: unknown key {key!r} (keys are `dsinfer serve` flag names)")
        tokens += _tokens_for(path, key, flag, action, value)
    parser.parse_args(tokens)
    return tokens


def _tokens_for(path: Path, key: str, flag: str, action: argparse.Action, value: Any) -> list[str]:
    if action.nargs == 0:
        if not isinstance(value, bool):
            raise UsageError(f"{path}: {key} takes true or false, got {value!r}")
        return [flag] if value else []
    if value is None:
        return []
    if isinstance(value, (dict, list)):
        raise UsageError(f"{path}: {key} takes one value, got {value!r}")
    return [flag, str(value).lower() if isinstance(value, bool) else str(value)]


def _after_command(argv: list[str], command: str) -> list[str]:
    for i, token in enumerate(argv):
        if token == command and (i == 0 or argv[i - 1] != "--log-level"):
            return argv[i + 1 :]
    raise ValueError(f"no {command!r} in {argv}")


# Which flags go with which role ----------------------------------------------------------------
def pristine_defaults() -> argparse.Namespace:
    return serve_parser().parse_args([])


def check_role_flags(args: argparse.Namespace) -> None:
    defaults = pristine_defaults()

    def given(names: Sequence[str]) -> list[str]:
        return ["--" + n.replace("_", "-") for n in names if getattr(args, n) != getattr(defaults, n)]

    if args.role is None:
        wrong = given(POOL_ONLY)
        if wrong:
            raise UsageError(
                f"{wrong[0]} applies to one pool (--role prefill|decode|colocated); the all-in-one "
                f"server takes --prefill-pool-size/--decode-pool-size/--prefill-pools/--decode-pools"
            )
        if args.colocated:
            wrong = given(("prefill_pool_size", "prefill_pools"))
            if wrong:
                raise UsageError(f"{wrong[0]} does not apply with --colocated (it runs no prefill pool)")
        return
    wrong = given(ALL_IN_ONE_ONLY)
    if wrong:
        raise UsageError(f"{wrong[0]} applies to the all-in-one server (no --role)")
    if args.role == "gateway":
        wrong = given(POOL_ONLY)
        if wrong:
            raise UsageError(
                f"{wrong[0]} applies to a pool (--role prefill|decode|colocated), not the gateway"
            )
    elif args.gateway_addr is None:
        raise UsageError(f"--role {args.role} needs --gateway-addr HOST:PORT (the gateway's control socket)")


def gpu_memory_of(args: argparse.Namespace) -> int | None:
    if args.gpu_memory is None:
        return None
    try:
        size = parse_size(args.gpu_memory)
    except ValueError as e:
        raise UsageError(f"--gpu-memory: {e}") from None
    if size <= 0:
        raise UsageError(f"--gpu-memory must be positive, got {args.gpu_memory!r}")
    return size


def pool_args_for_role(args: argparse.Namespace) -> PoolArgs:
    return pool_args_from(args, args.role, engine_args_from(args))


def role_secret(args: argparse.Namespace) -> str:
    """The cluster secret a role process must have (SecretError names where it comes from)."""
    secret = load_secret(args.cluster_secret_file)
    if secret is None:
        what = "the gateway" if args.role == "gateway" else f"a {args.role} pool"
        raise missing_secret_error(what)
    return secret


# Dispatch ----------------------------------------------------------------------------------------
def model_is_v4(model: str | None) -> bool:
    return is_v4(read_model_config(resolve_model(model)[0] / "config.json"))


def check_model(args: argparse.Namespace) -> None:
    """A checkpoint whose config dsinfer cannot serve ends the command here (ConfigError: one
    line), before any process starts that would fail on it, and be restarted, again and again.
    DeepSeek-V4 is served in every topology V3 is (MTP, EPLB and elastic EP included)."""
    model_is_v4(args.model)


def run_serve(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if args.config is not None:
        args = apply_config(args, argv)
    check_role_flags(args)
    problem = None if args.otlp_traces_endpoint is None else endpoint_problem(args.otlp_traces_endpoint)
    if problem is not None:
        raise UsageError(problem)
    if args.dry_run and args.role != "gateway" and model_is_v4(args.model):
        from dsinfer.cli.v4_plan import v4_plan_lines

        ranks = (
            args.pool_size if args.role is not None else max(args.prefill_pool_size, args.decode_pool_size)
        )
        print("\n".join(v4_plan_lines(engine_args_from(args), gpu_memory_of(args), ranks or 1)))
        return 0
    if not args.dry_run:
        check_model(args)
    if args.role is None:
        from dsinfer.cli.serve_all_in_one import run_all_in_one

        return run_all_in_one(args)
    if args.role == "gateway":
        gateway = gateway_args_from(args)
        if args.dry_run:
            from dsinfer.cli.serve_plan import print_gateway_plan

            print_gateway_plan(gateway)
            return 0
        from dsinfer.base.cluster_secret import ControlKeys
        from dsinfer.gateway.server import run_gateway

        return run_gateway(gateway, ControlKeys.from_secret(role_secret(args)))
    pool = pool_args_for_role(args)
    gpu_memory = gpu_memory_of(args)
    if args.dry_run:
        from dsinfer.cli.serve_plan import print_pool_plan

        print_pool_plan(pool, args.drain_timeout, gpu_memory)
        return 0
    if gpu_memory is not None:
        from dsinfer.cli.memory_plan import check_pool_fits

        check_pool_fits(pool, gpu_memory)
    secret = role_secret(args)
    from dsinfer.workers.launcher import PoolLauncher, run_pool

    return run_pool(PoolLauncher(pool, secret, drain_timeout=args.drain_timeout))
