"""Gateway arguments: HTTP server, OpenAI API behaviour, admission control, routing policy."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dsinfer.base.presets import resolve_model
from dsinfer.gateway.reasoning import PARSERS as REASONING_PARSERS
from dsinfer.gateway.tool_parsers import PARSERS as TOOL_PARSERS

BALANCERS = ("load", "round_robin")
AUTO = "auto"  # a parser chosen by the checkpoint's chat encoding (``GatewayArgs.for_chat_encoder``)
DEFAULT_PARSERS = {None: ("think-optional", "deepseek-v3"), "deepseek-v4": ("deepseek-v4", "deepseek-v4")}
MAX_REQUEST_BODY = 8 * 2**20  # bytes: a context's worth of prompt (token ids included) with room


class GatewayArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = 8000
    control_port: int | None = None  # ZMQ ROUTER the pools register with; None = the router's default
    served_model_name: str | None = None  # None = the model directory's name
    chat_template: Path | None = None  # a Jinja file replacing the checkpoint's chat template
    api_key: str | None = None  # when set, /v1/* requires "Authorization: Bearer <key>"
    reasoning_parser: str | None = AUTO  # auto, think-optional, deepseek-r1/v3.1/v3.2/v4; None: no split
    tool_call_parser: str = AUTO  # the format tool calls are read and constrained in
    responses_store_size: int = Field(
        1024, description="/v1/responses kept in memory for previous_response_id (the oldest dropped)"
    )
    max_queued_requests: int = 1024  # while this many choices wait for a first token, new requests get 429
    request_timeout: float = Field(
        600.0, description="seconds from arrival until a request is ended with an error"
    )
    max_migrations: int = 3  # times one choice may move to another rank (its rank died) before it fails
    max_n: int = Field(16, description="largest n (choices per prompt) accepted")
    balancer: str = "load"
    model: str | None = None  # checkpoint directory or preset; None = the built-in model (tiny-chat)
    # Idle HTTP connections close after this many seconds. A client (or a load balancer) that sends
    # on a connection just as the server closes it gets "disconnected without a response", so the
    # server should be the side that waits longer; uvicorn's own default is 5 s.
    http_keep_alive: float = 75.0
    max_request_body: int = MAX_REQUEST_BODY  # bytes; a larger body gets 413 while it is read
    tokenizer_threads: int | None = None  # None = min(8, cores): templating and tokenizing off the loop
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP collector for traces; None = tracing off
    drain_timeout: float = 30.0  # SIGTERM: seconds running streams get before they end in an error

    @model_validator(mode="after")
    def _check(self) -> GatewayArgs:
        for name in ("port", "control_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {value}")
        if self.reasoning_parser not in (None, AUTO, *REASONING_PARSERS):
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}"
            )
        if self.tool_call_parser not in (AUTO, *TOOL_PARSERS):
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, got {self.tool_call_parser!r}"
            )
        if self.responses_store_size < 0:
            raise ValueError(f"responses_store_size must be >= 0, got {self.responses_store_size}")
        if self.balancer not in BALANCERS:
            raise ValueError(f"balancer must be one of {', '.join(BALANCERS)}, got {self.balancer!r}")
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be at least 1, got {self.max_queued_requests}")
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be positive, got {self.request_timeout}")
        if not self.http_keep_alive > 0:
            raise ValueError(f"http_keep_alive must be positive, got {self.http_keep_alive}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if self.max_request_body < 1:
            raise ValueError(f"max_request_body must be at least 1 byte, got {self.max_request_body}")
        if self.tokenizer_threads is not None and self.tokenizer_threads < 1:
            raise ValueError(f"tokenizer_threads must be at least 1, got {self.tokenizer_threads}")
        if not self.drain_timeout > 0:
            raise ValueError(f"drain_timeout must be positive, got {self.drain_timeout}")
        if self.max_n < 1:
            raise ValueError(f"max_n must be at least 1, got {self.max_n}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be empty")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it out to serve without a key)")
        if self.chat_template is not None and not self.chat_template.is_file():
            raise ValueError(f"chat_template {str(self.chat_template)!r} is not a file")
        return self

    def for_chat_encoder(self, encoder: str | None) -> GatewayArgs:
        """These arguments with each "auto" parser made the one the chat encoding needs: DeepSeek-V4's
        encoder (``Tokenizer.chat_encoder``) writes thinking and DSML tool calls that only the
        deepseek-v4 parsers read; a template checkpoint gets think-optional and deepseek-v3 (the
        built-in model's)."""
        reasoning, tools = DEFAULT_PARSERS[encoder]
        update: dict[str, str] = {}
        if self.reasoning_parser == AUTO:
            update["reasoning_parser"] = reasoning
        if self.tool_call_parser == AUTO:
            update["tool_call_parser"] = tools
        return self.model_copy(update=update)

    def tokenizer_pool_size(self) -> int:
        return self.tokenizer_threads or min(8, os.cpu_count() or 1)

    def model_name(self) -> str:
        """The name clients pass as ``model``: --served-model-name, else the model directory's name."""
        if self.served_model_name is not None:
            return self.served_model_name
        path, _ = resolve_model(self.model)
        return path.resolve().name
