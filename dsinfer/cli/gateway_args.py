"""Command-line flags of the gateway (``--port``, ``--api-key`` ...) -> GatewayArgs.

``--model`` is the engine's flag (dsinfer/cli/engine_args.py); when the namespace has it,
``gateway_args_from`` picks it up too. The context length is the pools' (their Register).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from dsinfer.cli.engine_args import FieldFlags, field_default, size_text
from dsinfer.engine.args import parse_size
from dsinfer.gateway.args import AUTO, BALANCERS, REASONING_PARSERS, TOOL_PARSERS, GatewayArgs

API_KEY_ENV = "DSINFER_API_KEY"


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("gateway")
    flag = FieldFlags(group, GatewayArgs)
    flag("host", help="HTTP bind address (default: %(default)s)")
    flag("port", int, help="HTTP port (default: %(default)s)")
    flag("control_port", int, help="ZMQ port the pools register with")
    flag("served_model_name", help="the model name clients pass (default: the model directory's name)")
    flag("chat_template", help="Jinja file replacing the checkpoint's chat template")
    group.add_argument(
        "--api-key",
        # the environment's key is the default, so that it stays off command lines others can read
        default=os.environ.get(API_KEY_ENV, field_default(GatewayArgs, "api_key")),
        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV} if set)",
    )
    flag(
        "reasoning_parser",
        choices=[AUTO, *REASONING_PARSERS, "none"],
        help="return thinking as reasoning_content (default: %(default)s: deepseek-v4 for a DeepSeek-V4 "
        "checkpoint, else think-optional: a reply that opens with <think> thinks until </think>, as the "
        "built-in model thinks through a multiplication; deepseek-r1 for R1, whose template opens the "
        "thinking in the prompt; none: no split)",
    )
    flag(
        "tool_call_parser",
        choices=[AUTO, *TOOL_PARSERS],
        help="the model's tool-call format: parses tool_calls and constrains tool_choice required/named "
        "(default: %(default)s: deepseek-v4 for a DeepSeek-V4 checkpoint, else deepseek-v3, the built-in "
        "template's; deepseek-v3.1 for V3.1 and V3.2-Exp, deepseek-v3.2 for V3.2)",
    )
    flag("responses_store_size", int)
    flag(
        "max_queued_requests",
        int,
        help="while this many requests are queued (choices waiting for their first token; each of n "
        "counts), new requests get 429 (default: %(default)s)",
    )
    flag("request_timeout", float)
    flag(
        "max_migrations",
        int,
        help="times one choice may move to another rank when its rank dies or stops answering (a "
        "streaming choice continues there with the same tokens); past it, it ends with an error "
        "(default: %(default)s)",
    )
    flag("max_n", int)
    flag("balancer", choices=BALANCERS, help="worker choice (default: %(default)s)")
    flag(
        "http_keep_alive",
        float,
        help="seconds an idle HTTP connection stays open; keep it above the idle timeout of a load "
        "balancer in front, so that the balancer closes idle connections (default: %(default)s)",
    )
    flag(
        "max_request_body",
        _size,
        metavar="SIZE",
        help="largest request body (e.g. 8MiB); a larger one gets 413 while it is read "
        f"(default: {size_text(field_default(GatewayArgs, 'max_request_body'))})",
    )
    flag(
        "tokenizer_threads",
        int,
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
