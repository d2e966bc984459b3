"""The ``dsinfer`` command: ``generate``, ``serve``, ``eval``, ``eplb`` and ``plan``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from dsinfer.base.cluster_secret import SecretError
from dsinfer.base.config import ConfigError
from dsinfer.base.tokenizer import TokenizerError
from dsinfer.cli.engine_args import add_engine_args
from dsinfer.cli.eplb import add_eplb_args
from dsinfer.cli.errors import UsageError
from dsinfer.cli.eval import add_eval_args
from dsinfer.cli.plan import add_plan_args
from dsinfer.cli.serve import add_serve_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsinfer", description="DeepSeek-V3/R1-architecture inference.")
    parser.add_argument(
        "--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default: %(default)s)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="greedy generation of one prompt")
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True, help="the text to continue, as is (no chat template)")
    gen.add_argument(
        "--max-tokens", type=int, default=32, help="most tokens to generate (default: %(default)s)"
    )
    gen.add_argument("--json", action="store_true", help='print {"token_ids": [...], "text": ...}')
    # exit_on_error=False: a bad serve flag is reported by the top parser (short usage, "dsinfer: error:").
    serve = sub.add_parser(
        "serve", help="the OpenAI server: gateway, worker pools, or all-in-one", exit_on_error=False
    )
    add_serve_args(serve)
    add_eval_args(
        sub.add_parser(
            "eval",
            help="exact-match accuracy of the built-in tasks (offline or an endpoint)",
            exit_on_error=False,
        )
    )
    add_eplb_args(
        sub.add_parser("eplb", help="expert placement from expert-load statistics", exit_on_error=False)
    )
    add_plan_args(
        sub.add_parser("plan", help="pools per role for a traffic and SLO (simulated)", exit_on_error=False)
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.command == "generate":
            from dsinfer.cli.generate import run_generate

            return run_generate(args)
        if args.command == "serve":
            from dsinfer.cli.serve import run_serve

            return run_serve(args, argv)
        if args.command == "eval":
            from dsinfer.cli.eval import run_eval_command

            return run_eval_command(args)
        if args.command == "eplb":
            from dsinfer.cli.eplb import run_eplb

            return run_eplb(args)
        if args.command == "plan":
            from dsinfer.cli.plan import run_plan

            return run_plan(args)
    except _one_line_errors() as e:
        print(f"dsinfer: error: {e}", file=sys.stderr)
        return 2
    except ValidationError as e:  # a flag pydantic refused; name it without a traceback
        problems = [_flag_error(err) for err in e.errors()]
        print(f"dsinfer: error: {'; '.join(problems)}", file=sys.stderr)
        return 2
    return 1


def _one_line_errors() -> tuple[type[Exception], ...]:
    """Errors reported in one line. The checkpoint loader's only once it was imported (it
    brings torch, which a gateway process never needs)."""
    errors: list[type[Exception]] = [ConfigError, TokenizerError, FileNotFoundError, UsageError, SecretError]
    loader = sys.modules.get("dsinfer.model.loader")
    if loader is not None:
        errors.append(loader.CheckpointError)
    return tuple(errors)


def _flag_error(err: Any) -> str:
    flag = "--" + "-".join(str(p) for p in err["loc"]).replace("_", "-") if err["loc"] else "arguments"
    return f"{flag}: {str(err['msg']).removeprefix('Value error, ')}"


if __name__ == "__main__":
    sys.exit(main())
