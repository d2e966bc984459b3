"""The gateway's smaller endpoints: ``GET /v1/models/{id}``, vLLM's ``POST /tokenize`` and
``/detokenize``, ``/v1/embeddings`` (refused: a generative model), and the served OpenAPI
schema's request bodies (the generation routes parse their bodies themselves, strictly, so the
schema is written from the same pydantic models)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from dsinfer.gateway.errors import APIError, bad_request
from dsinfer.gateway.openai_api import ChatCompletionRequest, ChatMessage, ChatTool, ModelCard
from dsinfer.gateway.prepare import _check_ids, check_model, parse_body, render_chat
from dsinfer.gateway.request_run import GatewayContext


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TokenizeRequest(_Body):
    """vLLM's: a text ``prompt``, or chat ``messages`` rendered with the chat template."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(_Body):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] = Field(default="")
    encoding_format: Literal["float", "base64"] | None = None


def install_extra_routes(app: FastAPI, ctx: GatewayContext, check_auth: Callable[[Request], None]) -> None:
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        check_auth(request)
        if model_id != ctx.model_name:
            raise APIError(
                404,
                f"the model {model_id!r} does not exist; this server serves {ctx.model_name!r}",
                param="model",
                code="model_not_found",
            )
        capacity = ctx.backend.capacity()
        card = ModelCard(
            id=ctx.model_name,
            root=ctx.model_name,
            max_model_len=capacity.max_model_len if capacity is not None else None,
        )
        return Response(card.model_dump_json(), media_type="application/json")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        check_auth(request)
        body = await request.body()
        result = await ctx.preparer.run(lambda: _tokenize(ctx, parse_body(TokenizeRequest, body)), len(body))
        return Response(result.model_dump_json(), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        check_auth(request)
        req = parse_body(DetokenizeRequest, await request.body())
        limits = ctx.limits()
        check_model(req.model, limits)
        _check_ids(req.tokens, limits.vocab_size, "tokens")
        return JSONResponse({"prompt": ctx.tokenizer.decode(req.tokens, skip_special_tokens=False)})

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        check_auth(request)
        parse_body(EmbeddingRequest, await request.body())
        raise APIError(
            400,
            f"embeddings are not supported by this model: {ctx.model_name!r} is a generative model "
            "(serve /v1/completions, /v1/chat/completions, /v1/responses and /v1/messages)",
            code="model_not_supported",
        )


def _tokenize(ctx: GatewayContext, req: TokenizeRequest) -> TokenizeResponse:
    limits = ctx.limits()
    check_model(req.model, limits)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of prompt and messages", param="prompt")
    if req.prompt is not None:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = ctx.tokenizer.encode(req.prompt, add_special_tokens=special)
    else:
        chat = ChatCompletionRequest(
            messages=req.messages or [],
            add_generation_prompt=req.add_generation_prompt,
            chat_template_kwargs=req.chat_template_kwargs,
        )
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        ids = render_chat(chat, ctx.tokenizer, limits, tools)
    strs = [ctx.token_text(t) for t in ids] if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=limits.max_model_len, tokens=ids, token_strs=strs)


def document_request_bodies(app: FastAPI, bodies: dict[tuple[str, str], type[BaseModel]]) -> None:
    """The served OpenAPI schema, with each route's request body as its pydantic model."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for (method, path), model in bodies.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}", by_alias=True)
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            operation = schema["paths"][path][method]
            operation["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
                },
            }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
