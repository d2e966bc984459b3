"""OpenAI's Responses API (``POST /v1/responses``): the request body, its translation into a chat
completion request, and the bounded in-memory store behind ``previous_response_id``.

Translation: ``instructions`` is the first (system) message; then the conversation of the
previous response, if one is named (its input and its output; its instructions are not carried
over, as OpenAI documents); then ``input``: a string (one user message) or items. Message items
(``role`` with a string or ``input_text``/``output_text`` parts) become messages;
``function_call`` items become the assistant's ``tool_calls``, ``function_call_output`` items
``tool`` messages; a ``reasoning`` item is the next assistant message's ``reasoning_content``
(templates keep or drop past thinking), and ``reasoning.effort`` is chat's ``reasoning_effort``. Function
``tools``, ``tool_choice``, ``parallel_tool_calls``, ``max_output_tokens`` and
``text.format`` (json_object / json_schema) map to their chat completion fields.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dsinfer.gateway.errors import APIError, bad_request
from dsinfer.gateway.openai_api import ChatCompletionRequest
from dsinfer.gateway.prepare import validation_error

MAX_STORED_RESPONSES = 1024  # previous_response_id: the newest responses kept (LRU)


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ResponseTool(_Request):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseNamedTool(_Request):
    type: Literal["function"]
    name: str


class ResponseTextFormat(_Request):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseText(_Request):
    format: ResponseTextFormat | None = None


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[ResponseTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponseNamedTool | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    text: ResponseText | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None


@dataclass
class StoredResponse:
    conversation: list[dict[str, Any]]  # chat messages: the inputs and this response's output
    body: dict[str, Any]  # the response object as returned


class ResponseStore:
    """The newest ``capacity`` stored responses by id (least recently used dropped first). Read
    from the tokenizer threads (a request's history), written on the event loop: locked."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, item: StoredResponse) -> None:
        with self._lock:
            self._items[response_id] = item
            self._items.move_to_end(response_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse:
        with self._lock:
            item = self._items.get(response_id)
            if item is not None:
                self._items.move_to_end(response_id)
        if item is None:
            raise APIError(
                404,
                f"response {response_id!r} is not stored (unknown, stored with store=false, or dropped: "
                f"this server keeps the newest {self.capacity})",
                param="previous_response_id",
                code="response_not_found",
            )
        return item


def _part_text(part: Any, where: str) -> str:
    if isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text"):
        text = part.get("text")
        if isinstance(text, str):
            return text
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise bad_request(f"{where}: content parts of type {kind!r} are not supported", param="input")


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string", param="input")
    return value


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A ``reasoning`` item's text: its ``content`` (reasoning_text parts), else its summary."""
    for key in ("content", "summary"):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise bad_request(f"{where}.{key} must be a list of parts", param="input")
        texts = [p.get("text") for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
        if texts:
            return "".join(texts)
    return ""


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's ``input`` as chat messages; a ``reasoning`` item becomes the
    ``reasoning_content`` of the assistant message that follows it (templates keep or drop it)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None

    def assistant(message: dict[str, Any]) -> dict[str, Any]:
        nonlocal reasoning
        if reasoning is not None:
            message["reasoning_content"], reasoning = reasoning, None
        return message

    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role must be user, assistant, system or developer", param="input")
            content = item.get("content")
            if isinstance(content, list):
                content = "".join(_part_text(p, f"{where}.content.{j}") for j, p in enumerate(content))
            elif not isinstance(content, str):
                raise bad_request(f"{where}.content must be a string or a list of parts", param="input")
            message = {"role": role, "content": content}
            messages.append(assistant(message) if role == "assistant" else message)
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _string(item, "arguments", where),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append(assistant({"role": "assistant", "content": "", "tool_calls": [call]}))
        elif kind == "function_call_output":
            output = _string(item, "output", where)
            messages.append(
                {"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": output}
            )
        elif kind == "reasoning":
            reasoning = (reasoning or "") + _reasoning_text(item, where)
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported", param="input")
    return messages


def _tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    if not req.tools:
        return None
    tools = []
    for i, tool in enumerate(req.tools):
        if tool.type != "function" or tool.name is None:
            raise bad_request(
                f"tools.{i}: only function tools (with a name) are supported, got {tool.type!r}",
                param="tools",
            )
        function = tool.model_dump(exclude_none=True, exclude={"type"})
        tools.append({"type": "function", "function": function})
    return tools


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def to_chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion request that serves ``req`` after the conversation ``history``."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += history + input_messages(req.input)
    choice = req.tool_choice
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_output_tokens,
        "stream": req.stream,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": _tools(req),
        "tool_choice": {"type": "function", "function": {"name": choice.name}}
        if isinstance(choice, ResponseNamedTool)
        else choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req),
        "reasoning_effort": (req.reasoning or {}).get("effort"),
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        raise validation_error(e) from None
