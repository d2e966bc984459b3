"""The gateway process: tokenizer and model facts from the checkpoint, the router on the control
port, the OpenAI app on the HTTP port (``dsinfer serve --role gateway``)."""

from __future__ import annotations

import logging

import uvicorn

from dsinfer.base.config import ModelConfig
from dsinfer.base.presets import resolve_model
from dsinfer.base.tokenizer import Tokenizer
from dsinfer.gateway.app import build_app
from dsinfer.gateway.args import GatewayArgs
from dsinfer.gateway.router import Router

log = logging.getLogger("dsinfer.gateway")


def control_port_of(args: GatewayArgs) -> int:
    return args.control_port if args.control_port is not None else args.port + 1


def build_gateway(args: GatewayArgs) -> tuple[Router, object]:
    path, _ = resolve_model(args.model)
    config = ModelConfig.from_file(path / "config.json")
    tokenizer = Tokenizer.from_dir(path)
    router = Router(
        f"{args.host}:{control_port_of(args)}", balancer=args.balancer, max_migrations=args.max_migrations
    )
    app = build_app(router, tokenizer, args, config.vocab_size)
    return router, app


def run_gateway(args: GatewayArgs) -> int:
    _, app = build_gateway(args)
    log.info(
        "OpenAI API on http://%s:%d/v1, pools register at %s:%d",
        args.host,
        args.port,
        args.host,
        control_port_of(args),
    )
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=args.http_keep_alive,
    )
    return 0
