"""The gateway process: tokenizer and model facts from the checkpoint, the router on the control
port, the OpenAI app on the HTTP port (``dsinfer serve --role gateway``).

SIGTERM (or SIGINT) drains, bounded by ``--drain-timeout``: the listening socket closes (a load
balancer sends new connections to another replica), requests still arriving on open connections
get 503 with Retry-After and /ready fails, running streams go on; at the bound every choice still
running ends with an error event, so every stream ends with ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn
from fastapi import FastAPI

from dsinfer.base.cluster_secret import ControlKeys
from dsinfer.base.model_config import read_model_config
from dsinfer.base.presets import resolve_model
from dsinfer.base.tokenizer import Tokenizer
from dsinfer.base.tracing import Tracer
from dsinfer.gateway.app import build_app
from dsinfer.gateway.args import GatewayArgs
from dsinfer.gateway.router import Router

log = logging.getLogger("dsinfer.gateway")

END_GRACE = 5.0  # seconds after the drain bound for the error events to reach the clients


def control_port_of(args: GatewayArgs) -> int:
    return args.control_port if args.control_port is not None else args.port + 1


def build_gateway(args: GatewayArgs, keys: ControlKeys) -> tuple[Router, FastAPI]:
    path, _ = resolve_model(args.model)
    config = read_model_config(path / "config.json")
    tokenizer = Tokenizer.from_dir(path)
    tracer = Tracer("dsinfer-gateway", args.otlp_traces_endpoint)
    router = Router(
        f"{args.host}:{control_port_of(args)}",
        keys,
        balancer=args.balancer,
        max_migrations=args.max_migrations,
        tracer=tracer,
    )
    app = build_app(router, tokenizer, args, config.vocab_size, tracer)
    return router, app


class DrainingServer(uvicorn.Server):
    """uvicorn's graceful shutdown with a bound, after which the router ends what still runs."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, router: Router, drain_timeout: float) -> None:
        super().__init__(config)
        self.gateway, self.router, self.drain_timeout = app.state.gateway, router, drain_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.gateway.draining = True
        running = len(self.gateway.active_ids)
        log.info("draining: %d request(s) running get up to %g s to finish", running, self.drain_timeout)
        end = asyncio.get_running_loop().call_later(
            self.drain_timeout, self.router.end_all, "the gateway is shutting down"
        )
        try:
            await super().shutdown(sockets)
        finally:
            end.cancel()


def run_gateway(args: GatewayArgs, keys: ControlKeys) -> int:
    router, app = build_gateway(args, keys)
    log.info(
        "OpenAI API on http://%s:%d/v1, pools register at %s:%d",
        args.host,
        args.port,
        args.host,
        control_port_of(args),
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=args.http_keep_alive,
        timeout_graceful_shutdown=int(args.drain_timeout + END_GRACE),
    )
    DrainingServer(config, app, router, args.drain_timeout).run()
    return 0
