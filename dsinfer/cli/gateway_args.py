"""Command-line flags of the gateway (``--port``, ``--api-key`` ...) -> GatewayArgs.

``--model`` is the engine's flag (dsinfer/cli/engine_args.py); when the namespace has it,
``gateway_args_from`` picks it up too. The context length is the pools' (their Register).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from dsinfer.cli.engine_args import field_default, field_help, size_text
from dsinfer.engine.args import parse_size
from dsinfer.gateway.args import BALANCERS, REASONING_PARSERS, TOOL_PARSERS, GatewayArgs

API_KEY_ENV = "DSINFER_API_KEY"


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("gateway")
    group.add_argument("--host", default=_default("host"), help="HTTP bind address (default: %(default)s)")
    group.add_argument("--port", type=int, default=_default("port"), help="HTTP port (default: %(default)s)")
    group.add_argument(
        "--control-port",
        type=int,
        default=_default("control_port"),
        help="ZMQ port the pools register with",
    )
    group.add_argument(
        "--served-model-name",
        default=_default("served_model_name"),
        help="the model name clients pass (default: the model directory's name)",
    )
    group.add_argument(
        "--chat-template",
        default=_default("chat_template"),
        help="Jinja file replacing the checkpoint's chat template",
    )
    group.add_argument(
        "--api-key",
        # the environment's key is the default, so that it stays off command lines others can read
        default=os.environ.get(API_KEY_ENV, _default("api_key")),
        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV} if set)",
    )
    group.add_argument(
        "--reasoning-parser",
        default=_default("reasoning_parser"),
        choices=[*REASONING_PARSERS, "none"],
        help="return thinking as reasoning_content (default: %(default)s: a reply that opens with "
        "<think> thinks until </think>, as the built-in model thinks through a multiplication; "
        "deepseek-r1 for R1, whose template opens the thinking in the prompt; none: no split)",
    )
    group.add_argument(
        "--tool-call-parser",
        default=_default("tool_call_parser"),
        choices=list(TOOL_PARSERS),
        help="the model's tool-call format: parses tool_calls and constrains tool_choice required/named "
        "(default: %(default)s, the built-in template's; deepseek-v3.1 for V3.1 and V3.2-Exp)",
    )
    group.add_argument(
        "--responses-store-size",
        type=int,
        default=_default("responses_store_size"),
        help=f"{_help('responses_store_size')} (default: %(default)s)",
    )
    group.add_argument(
        "--max-queued-requests",
        type=int,
        default=_default("max_queued_requests"),
        help="while this many requests are queued (choices waiting for their first token; each of n "
        "counts), new requests get 429 (default: %(default)s)",
    )
    group.add_argument(
        "--request-timeout",
        type=float,
        default=_default("request_timeout"),
        help=f"{_help('request_timeout')} (default: %(default)s)",
    )
    group.add_argument(
        "--max-migrations",
        type=int,
        default=_default("max_migrations"),
        help="times one choice may move to another rank when its rank dies or stops answering (a "
        "streaming choice continues there with the same tokens); past it, it ends with an error "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--max-n", type=int, default=_default("max_n"), help=f"{_help('max_n')} (default: %(default)s)"
    )
    group.add_argument(
        "--balancer",
        default=_default("balancer"),
        choices=BALANCERS,
        help="worker choice (default: %(default)s)",
    )
    group.add_argument(
        "--http-keep-alive",
        type=float,
        default=_default("http_keep_alive"),
        help="seconds an idle HTTP connection stays open; keep it above the idle timeout of a load "
        "balancer in front, so that the balancer closes idle connections (default: %(default)s)",
    )
    group.add_argument(
        "--max-request-body",
        type=_size,
        default=_default("max_request_body"),
        metavar="SIZE",
        help="largest request body (e.g. 8MiB); a larger one gets 413 while it is read "
        f"(default: {size_text(_default('max_request_body'))})",
    )
    group.add_argument(
        "--tokenizer-threads",
        type=int,
        default=_default("tokenizer_threads"),
        help="threads that template and tokenize prompts off the event loop, at least 2: prompts over "
        "256 KiB never take the last one (default: min(8, cores))",
    )


def _default(name: str) -> Any:
    return field_default(GatewayArgs, name)


def _help(name: str) -> str:
    return field_help(GatewayArgs, name)


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
