"""Command-line flags of the gateway (``--port``, ``--api-key`` ...) -> GatewayArgs.

``--model`` is the engine's flag (dsinfer/cli/engine_args.py); when the namespace has it,
``gateway_args_from`` picks it up too. The context length is the pools' (their Register).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from dsinfer.engine.args import parse_size
from dsinfer.gateway.args import BALANCERS, MAX_REQUEST_BODY, REASONING_PARSERS, TOOL_PARSERS, GatewayArgs

API_KEY_ENV = "DSINFER_API_KEY"


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("gateway")
    group.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default: %(default)s)")
    group.add_argument("--port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    group.add_argument("--control-port", type=int, default=None, help="ZMQ port the pools register with")
    group.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients pass (default: the model directory's name)",
    )
    group.add_argument(
        "--chat-template", default=None, help="Jinja file replacing the checkpoint's chat template"
    )
    group.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV} if set)",
    )
    group.add_argument(
        "--reasoning-parser",
        default="think-optional",
        choices=[*REASONING_PARSERS, "none"],
        help="return thinking as reasoning_content (default: %(default)s: a reply that opens with "
        "<think> thinks until </think>, as the built-in model thinks through a multiplication; "
        "deepseek-r1 for R1, whose template opens the thinking in the prompt; none: no split)",
    )
    group.add_argument(
        "--tool-call-parser",
        default="deepseek-v3",
        choices=list(TOOL_PARSERS),
        help="the model's tool-call format: parses tool_calls and constrains tool_choice required/named "
        "(default: %(default)s, the built-in template's; deepseek-v3.1 for V3.1 and V3.2-Exp)",
    )
    group.add_argument(
        "--responses-store-size",
        type=int,
        default=1024,
        help="/v1/responses kept in memory for previous_response_id (default: %(default)s)",
    )
    group.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="while this many requests are queued (choices waiting for their first token; each of n "
        "counts), new requests get 429 (default: %(default)s)",
    )
    group.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds before a request ends in an error"
    )
    group.add_argument(
        "--max-migrations",
        type=int,
        default=3,
        help="times one choice may move to another rank when its rank dies or stops answering (a "
        "streaming choice continues there with the same tokens); past it, it ends with an error "
        "(default: %(default)s)",
    )
    group.add_argument("--max-n", type=int, default=16, help="largest n accepted (default: %(default)s)")
    group.add_argument(
        "--balancer", default="load", choices=BALANCERS, help="worker choice (default: %(default)s)"
    )
    group.add_argument(
        "--http-keep-alive",
        type=float,
        default=75.0,
        help="seconds an idle HTTP connection stays open; keep it above the idle timeout of a load "
        "balancer in front, so that the balancer closes idle connections (default: %(default)s)",
    )
    group.add_argument(
        "--max-request-body",
        type=_size,
        default=MAX_REQUEST_BODY,
        metavar="SIZE",
        help="largest request body (e.g. 8MiB); a larger one gets 413 while it is read (default: 8MiB)",
    )
    group.add_argument(
        "--tokenizer-threads",
        type=int,
        default=None,
        help="threads that template and tokenize prompts off the event loop, at least 2: prompts over "
        "256 KiB never take the last one (default: min(8, cores))",
    )


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def gateway_args_from(args: argparse.Namespace, **overrides: Any) -> GatewayArgs:
    """GatewayArgs from parsed flags; pydantic's ValueError names a bad value."""
    fields = {name: getattr(args, name) for name in GatewayArgs.model_fields if hasattr(args, name)}
    if fields.get("reasoning_parser") == "none":
        fields["reasoning_parser"] = None
    return GatewayArgs(**{**fields, **overrides})
