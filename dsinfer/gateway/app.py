"""The gateway's HTTP app over a Backend: OpenAI-compatible /v1 endpoints (completions, chat
completions, responses), Anthropic's /v1/messages, /health, /ready and /metrics. Every generation
endpoint is one ``_Endpoint``: its body is prepared into a ``Prepared`` request and its run
formatted by the API's own formatter.

``build_app`` keeps all state on ``app.state.gateway`` (its own Prometheus registry included)
and starts/stops the backend in the app's lifespan. Every error a client can cause is answered
in the API's format (OpenAI's; Anthropic's on /v1/messages) before anything reaches the backend. Bodies are bounded while they
are read and prompts are prepared off the event loop (dsinfer/gateway/intake.py). ``/health`` is
liveness (the process answers), ``/ready`` readiness (pools registered, not draining); every
503 and 429 carries Retry-After; a client that leaves is counted as status 499.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from dsinfer.base import heap
from dsinfer.base.expert_load import document as expert_load_document
from dsinfer.base.tokenizer import TOKENIZER_CONFIG_FILE, Tokenizer, TokenizerError
from dsinfer.base.tracing import OpenSpan, Tracer
from dsinfer.gateway.anthropic_reply import MessagesFormatter, prepare_messages
from dsinfer.gateway.anthropic_request import MessagesRequest, anthropic_error
from dsinfer.gateway.args import GatewayArgs
from dsinfer.gateway.backend import Backend
from dsinfer.gateway.chat import ChatFormatter
from dsinfer.gateway.completions import CompletionFormatter
from dsinfer.gateway.errors import (
    UNAVAILABLE_RETRY_AFTER,
    APIError,
    bad_request,
    error_body,
    retry_after,
    server_error,
    timeout_error,
    unavailable,
)
from dsinfer.gateway.extra_routes import (
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    document_request_bodies,
    install_extra_routes,
)
from dsinfer.gateway.idle import trim_when_idle
from dsinfer.gateway.intake import BodyLimit, BodyTooLarge, Preparer
from dsinfer.gateway.metrics import GatewayMetrics
from dsinfer.gateway.openai_api import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from dsinfer.gateway.prepare import Limits, Prepared, parse_body, prepare_chat, prepare_completion
from dsinfer.gateway.request_run import (
    ClientGone,
    GatewayContext,
    RequestRun,
    RequestTimeout,
    unless_disconnected,
    wait_for_disconnect,
)
from dsinfer.gateway.responses_reply import prepare_responses
from dsinfer.gateway.responses_request import ResponsesRequest, ResponseStore
from dsinfer.gateway.sse import HEADERS, MEDIA_TYPE

log = logging.getLogger("dsinfer.gateway")


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection first"


def with_chat_template(tokenizer: Tokenizer, path: Path) -> Tokenizer:
    """The same tokenizer with the chat template of ``path`` (--chat-template)."""
    config_path = Path(tokenizer.origin) / TOKENIZER_CONFIG_FILE
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    try:
        return Tokenizer(
            tokenizer.backend,
            config,
            path.read_text(encoding="utf-8"),
            extra_eos_token_ids=tokenizer.eos_token_ids,
            origin=tokenizer.origin,
        )
    except TokenizerError as e:
        raise TokenizerError(f"--chat-template {path}: {e}") from None


def build_app(
    backend: Backend, tokenizer: Tokenizer, args: GatewayArgs, vocab_size: int, tracer: Tracer | None = None
) -> FastAPI:
    """The OpenAI app over ``backend``; the context length and KV limits a request is checked
    against are the registered pools' (``Backend.capacity``). ``tracer``: the one the backend
    shares (default: ``args.otlp_traces_endpoint``'s)."""
    tracer = tracer or Tracer("dsinfer-gateway", args.otlp_traces_endpoint)
    if args.chat_template is not None:
        tokenizer = with_chat_template(tokenizer, args.chat_template)
    args = args.for_chat_encoder(tokenizer.chat_encoder)
    metrics = GatewayMetrics(backend.metrics_snapshot)
    preparer = Preparer(args.tokenizer_pool_size(), args.max_queued_requests)
    ctx = GatewayContext(
        backend,
        tokenizer,
        args,
        args.model_name(),
        vocab_size,
        metrics,
        preparer,
        tracer,
        tokenizer.max_token_chars,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        heap.pin_mmap_threshold()
        await backend.start()
        trimmer = asyncio.create_task(trim_when_idle(ctx))
        log.info("serving %r on the OpenAI API", ctx.model_name)
        try:
            yield
        finally:
            trimmer.cancel()
            await backend.stop()
            preparer.close()
            tracer.close()

    app = FastAPI(title="dsinfer gateway", lifespan=lifespan)
    app.state.gateway = ctx
    app.add_middleware(BodyLimit, limit=args.max_request_body)
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        """Liveness: the process answers. Whether it can serve is /ready's."""
        snapshot = backend.metrics_snapshot()
        healthy = sum(w.healthy for w in snapshot.workers)
        body = {"status": "ok", "ready": ctx.is_ready(snapshot), "healthy_workers": healthy}
        return JSONResponse(body)

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness: the pools can serve requests (a prefill and a decode rank, or a colocated
        one) and the gateway is not draining."""
        snapshot = backend.metrics_snapshot()
        if ctx.is_ready(snapshot):
            return JSONResponse(
                {"status": "ready", "healthy_workers": sum(w.healthy for w in snapshot.workers)}
            )
        reason = "draining" if ctx.draining else "no pool can serve requests yet"
        return JSONResponse(
            {"status": "unavailable", "reason": reason},
            status_code=503,
            headers=retry_after(UNAVAILABLE_RETRY_AFTER),
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/expert_load")
    async def expert_load() -> Response:
        """Tokens routed to each logical expert per MoE layer, summed over each role's ranks:
        the statistics file of dsinfer/base/expert_load.py (the expert load balancer's input)."""
        return JSONResponse(expert_load_document(backend.metrics_snapshot().expert_load))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            _check_auth(ctx, request)
        except APIError as e:
            return e.response()
        capacity = backend.capacity()
        card = ModelCard(
            id=ctx.model_name,
            root=ctx.model_name,
            max_model_len=capacity.max_model_len if capacity is not None else None,
        )
        return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")

    completion_endpoint, chat_endpoint = _openai_endpoints(ctx)
    store = ResponseStore()
    responses_endpoint, messages_endpoint = _more_endpoints(ctx, store)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(ctx, request, completion_endpoint)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(ctx, request, chat_endpoint)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await _generate(ctx, request, responses_endpoint)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str, request: Request) -> Response:
        _check_auth(ctx, request)
        return JSONResponse(store.get(response_id).body)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await _generate(ctx, request, messages_endpoint)

    install_extra_routes(app, ctx, lambda request: _check_auth(ctx, request))
    document_request_bodies(
        app,
        {
            ("post", "/v1/completions"): CompletionRequest,
            ("post", "/v1/chat/completions"): ChatCompletionRequest,
            ("post", "/v1/responses"): ResponsesRequest,
            ("post", "/v1/messages"): MessagesRequest,
            ("post", "/tokenize"): TokenizeRequest,
            ("post", "/detokenize"): DetokenizeRequest,
            ("post", "/v1/embeddings"): EmbeddingRequest,
        },
    )
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(BodyTooLarge)
    async def body_too_large(request: Request, exc: BodyTooLarge) -> Response:
        return exc.error.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return JSONResponse(error_body(message), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return bad_request(f"invalid request: {exc.errors()[0].get('msg', exc)}").response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("%s %s failed", request.method, request.url.path)
        return server_error(f"internal error: {type(exc).__name__}").response()


def _check_auth(ctx: GatewayContext, request: Request) -> None:
    """The API key, as OpenAI clients send it (``Authorization: Bearer``) or Anthropic's (``x-api-key``)."""
    key = ctx.args.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise APIError(
            401,
            "invalid or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def _request_id(request: Request, prefix: str) -> str:
    given = request.headers.get("x-request-id")
    return f"{prefix}-{given if given and _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex}"


class _Formatter(Protocol):
    async def response(self) -> BaseModel | dict[str, Any]: ...

    def chunks(self) -> AsyncIterator[str]: ...


# body, limits -> the prepared request and what formats its run (called off the event loop)
_Prepare = Callable[[bytes, Limits], tuple[Prepared, Callable[[RequestRun], _Formatter]]]


@dataclass(frozen=True)
class _Endpoint:
    name: str  # the metrics label
    id_prefix: str
    prepare: _Prepare
    reasoning: bool = True  # the reasoning parser splits the output
    error: Callable[[APIError], Response] = APIError.response  # the API's error format


def _openai_endpoints(ctx: GatewayContext) -> tuple[_Endpoint, _Endpoint]:
    def completion(body: bytes, limits: Limits) -> tuple[Prepared, Callable[[RequestRun], _Formatter]]:
        prepared = prepare_completion(parse_body(CompletionRequest, body), ctx.tokenizer, limits)
        return prepared, lambda run: CompletionFormatter(ctx, run, ctx.model_name)

    def chat(body: bytes, limits: Limits) -> tuple[Prepared, Callable[[RequestRun], _Formatter]]:
        req = parse_body(ChatCompletionRequest, body)
        prepared = prepare_chat(req, ctx.tokenizer, limits, ctx.args.tool_call_parser)
        return prepared, lambda run: ChatFormatter(ctx, run, ctx.model_name)

    return _Endpoint("completions", "cmpl", completion, reasoning=False), _Endpoint("chat", "chatcmpl", chat)


def _more_endpoints(ctx: GatewayContext, store: ResponseStore) -> tuple[_Endpoint, _Endpoint]:
    def responses(body: bytes, limits: Limits) -> tuple[Prepared, Callable[[RequestRun], _Formatter]]:
        return prepare_responses(body, ctx, limits, store)

    def messages(body: bytes, limits: Limits) -> tuple[Prepared, Callable[[RequestRun], _Formatter]]:
        prepared = prepare_messages(body, ctx, limits)
        return prepared, lambda run: MessagesFormatter(ctx, run, ctx.model_name)

    return (
        _Endpoint("responses", "resp", responses),
        _Endpoint("messages", "msg", messages, error=anthropic_error),
    )


async def _generate(ctx: GatewayContext, request: Request, endpoint: _Endpoint) -> Response:
    status: int | None = 500
    # the request's span: its run ends it, or the error below where it failed before one ran
    span = ctx.tracer.open(
        f"{request.method} {request.url.path}",
        request.headers.get("traceparent", ""),
        {"http.request.method": request.method, "url.path": request.url.path},
        server=True,
    )
    try:
        response = await _serve(ctx, request, endpoint, span)
        # a stream's status is known when it ends (499 if the client left): it counts itself
        status = None if isinstance(response, _RunStreamingResponse) else response.status_code
        return response
    except APIError as e:
        status = e.status
        span.end(e.message)
        if e.status < 500:
            log.info("%s request refused: %d %s", endpoint.name, e.status, e.message)
        return endpoint.error(e)
    except ClientGone:
        status = CLIENT_CLOSED
        span.end("client gone")
        return Response(status_code=CLIENT_CLOSED)
    except Exception as e:
        span.end(str(e) or type(e).__name__)
        raise
    finally:
        if status is not None:
            ctx.metrics.requests.labels(endpoint.name, str(status)).inc()


async def _serve(ctx: GatewayContext, request: Request, endpoint: _Endpoint, span: OpenSpan) -> Response:
    arrival = time.monotonic()
    _check_auth(ctx, request)
    if ctx.draining:
        raise unavailable("the gateway is shutting down; send the request again (to another replica)")
    body = await request.body()  # at most --max-request-body bytes (BodyLimit)
    await ctx.backend.until_ready(arrival + ctx.args.request_timeout)  # a new gateway's ranks registering
    limits = ctx.limits()
    # Parsing, templating and tokenizing a long prompt take a while: off the event loop.
    preparing = time.time()
    prepared, make_formatter = await ctx.preparer.run(lambda: endpoint.prepare(body, limits), len(body))
    ctx.tracer.record("prepare", span.traceparent, preparing, attributes={"dsinfer.body_bytes": len(body)})
    request_id = _request_id(request, endpoint.id_prefix)
    span.set({"dsinfer.request_id": request_id})
    if request_id in ctx.active_ids:
        raise bad_request(f"request id {request_id!r} is already in use", code="duplicate_request_id")
    ctx.active_ids.add(request_id)
    run = RequestRun(
        ctx, request_id, prepared, endpoint.name, reasoning=endpoint.reasoning, arrival=arrival, span=span
    )
    formatter = make_formatter(run)
    headers = {"X-Request-Id": request_id}
    try:
        run.start()
    except APIError:
        await run.close()
        raise
    if prepared.stream:
        return _RunStreamingResponse(
            ctx, endpoint.name, run, _stream(request, run, formatter.chunks()), headers={**HEADERS, **headers}
        )
    try:
        result = await unless_disconnected(request, run, formatter.response)
    except RequestTimeout:
        raise timeout_error(ctx.args.request_timeout) from None
    finally:
        await run.close()
    text = (
        result.model_dump_json() if isinstance(result, BaseModel) else json.dumps(result, ensure_ascii=False)
    )
    return Response(text, media_type="application/json", headers=headers)


async def _stream(request: Request, run: RequestRun, chunks: AsyncIterator[str]) -> AsyncGenerator[str, None]:
    async def abort_on_disconnect() -> None:
        await wait_for_disconnect(request)
        run.outcome = "client gone"
        await run.abort()

    watcher = asyncio.create_task(abort_on_disconnect())
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        watcher.cancel()
        with anyio.CancelScope(shield=True):
            await run.close()


class _RunStreamingResponse(StreamingResponse):
    """Closes its run however the response ends (also when the body never started) and counts
    the request: 200, or 499 when the client left first."""

    def __init__(
        self,
        ctx: GatewayContext,
        endpoint: str,
        run: RequestRun,
        content: AsyncIterator[str],
        headers: dict[str, str],
    ) -> None:
        super().__init__(content, media_type=MEDIA_TYPE, headers=headers)
        self.ctx, self.endpoint, self.run = ctx, endpoint, run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                if not self.run.finished and self.run.outcome == "ok":
                    self.run.outcome = "client gone"
                await self.run.close()
            status = CLIENT_CLOSED if self.run.outcome == "client gone" else self.status_code
            self.ctx.metrics.requests.labels(self.endpoint, str(status)).inc()
