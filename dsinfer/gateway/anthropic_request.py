"""Anthropic's Messages API (``POST /v1/messages``): the request body, its translation into a chat
completion request (the same prompt rendering, tool grammars and sampling as
/v1/chat/completions), and errors in Anthropic's format.

Translation: ``system`` becomes a system message; a user message's ``tool_result`` blocks become
``tool`` messages (before its text); an assistant message's ``tool_use`` blocks become its
``tool_calls`` and its ``thinking`` its ``reasoning_content``. ``tools[].input_schema`` is the
function's parameters; ``tool_choice`` auto/any/tool/none maps to auto/required/a named
function/none, ``disable_parallel_tool_use`` to ``parallel_tool_calls: false``; ``thinking``
enabled sets the chat template's thinking mode (DeepSeek-V3.1/V3.2). Images, documents and server
tools are refused with a 400 that names them.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from dsinfer.gateway.errors import APIError, bad_request
from dsinfer.gateway.openai_api import ChatCompletionRequest
from dsinfer.gateway.prepare import validation_error

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ContentBlock(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: str | None = None
    thinking: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[dict[str, Any]] | None = None  # tool_result
    is_error: bool | None = None  # tool_result


class AnthropicMessage(_Request):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(_Request):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" (or absent) for a client tool; server tools are refused


class AnthropicToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(_Request):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class MessagesRequest(_Request):
    model: str
    messages: list[AnthropicMessage]
    max_tokens: int
    system: str | list[ContentBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    metadata: dict[str, Any] | None = None


def anthropic_error(e: APIError) -> JSONResponse:
    kind = _ERROR_TYPES.get(e.status, "api_error")
    body = {"type": "error", "error": {"type": kind, "message": e.message}}
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def _text_of(blocks: list[ContentBlock], where: str) -> str:
    parts = []
    for j, block in enumerate(blocks):
        if block.type != "text" or block.text is None:
            raise bad_request(f"{where}.{j}: content blocks of type {block.type!r} are not supported here")
        parts.append(block.text)
    return "".join(parts)


def _tool_result(block: ContentBlock, where: str) -> dict[str, Any]:
    if block.tool_use_id is None:
        raise bad_request(f"{where}: a tool_result block needs tool_use_id", param="messages")
    content = block.content
    if isinstance(content, list):
        content = _text_of([ContentBlock.model_validate(c) for c in content], f"{where}.content")
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": content or ""}


def _chat_messages(index: int, message: AnthropicMessage) -> list[dict[str, Any]]:
    where = f"messages.{index}.content"
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    results: list[dict[str, Any]] = []
    text: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        at = f"{where}.{j}"
        if block.type == "text" and block.text is not None:
            text.append(block.text)
        elif block.type == "tool_result" and message.role == "user":
            results.append(_tool_result(block, at))
        elif block.type == "tool_use" and message.role == "assistant":
            if block.id is None or block.name is None:
                raise bad_request(f"{at}: a tool_use block needs id and name", param="messages")
            arguments = json.dumps(block.input or {}, ensure_ascii=False)
            calls.append(
                {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}
            )
        elif block.type in ("thinking", "redacted_thinking") and message.role == "assistant":
            thinking.append(block.thinking or "")
        else:
            raise bad_request(
                f"{at}: content blocks of type {block.type!r} are not supported in {message.role} messages",
                param="messages",
            )
    out = results
    if text or calls or not results:
        chat: dict[str, Any] = {"role": message.role, "content": "".join(text)}
        if calls:
            chat["tool_calls"] = calls
        if thinking:
            chat["reasoning_content"] = "".join(thinking)
        out = [*out, chat]
    return out


def _tools(req: MessagesRequest) -> tuple[list[dict[str, Any]] | None, Any, bool]:
    """-> (OpenAI tools, tool_choice, parallel_tool_calls)."""
    tools = None
    if req.tools:
        tools = []
        for i, tool in enumerate(req.tools):
            if tool.type not in (None, "custom"):
                raise bad_request(f"tools.{i}: server tools ({tool.type!r}) are not supported", param="tools")
            function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
            if tool.description is not None:
                function["description"] = tool.description
            tools.append({"type": "function", "function": function})
    choice = req.tool_choice
    if choice is None:
        return tools, None, True
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice of type tool needs name", param="tool_choice")
        named = {"type": "function", "function": {"name": choice.name}}
        return tools, named, not choice.disable_parallel_tool_use
    mapped = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return tools, mapped, not choice.disable_parallel_tool_use


def to_chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat completion request that serves ``req`` (a 400 for what cannot be translated)."""
    if not req.messages:
        raise bad_request("messages must not be empty", param="messages")
    messages: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _text_of(req.system, "system")
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        messages.extend(_chat_messages(i, message))
    tools, tool_choice, parallel = _tools(req)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_tokens,
        "stop": req.stop_sequences,
        "stream": req.stream,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "tools": tools,
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
    }
    if req.thinking is not None and req.thinking.type != "disabled":
        body["chat_template_kwargs"] = {"thinking": True}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        raise validation_error(e) from None
