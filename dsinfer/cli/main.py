"""The ``dsinfer`` command: ``dsinfer generate`` today; the servers join as they are built."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from dsinfer.base.config import ConfigError
from dsinfer.base.presets import DEFAULT_MODEL
from dsinfer.base.tokenizer import TokenizerError
from dsinfer.cli.errors import UsageError
from dsinfer.model.loader import LOAD_FORMATS, CheckpointError


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help=f"checkpoint directory or preset name (default: {DEFAULT_MODEL})"
    )
    parser.add_argument("--load-format", default="auto", choices=LOAD_FORMATS)
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda if present)")
    parser.add_argument("--seed", type=int, default=0, help="seed of dummy weights")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsinfer", description="DeepSeek-V3/R1-architecture inference.")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="greedy generation of one prompt")
    _add_model_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--json", action="store_true", help='print {"token_ids": [...], "text": ...}')
    return parser


def main(argv: Sequence[str] | None = None) -> int:
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
    except (CheckpointError, ConfigError, TokenizerError, FileNotFoundError, UsageError) as e:
        print(f"dsinfer: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
