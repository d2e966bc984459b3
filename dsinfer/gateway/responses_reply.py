"""/v1/responses (OpenAI's Responses API): the response object, or its stream of typed events,
from a RequestRun's one choice; with ``store`` (the default) the response and its conversation
are kept for ``previous_response_id`` and ``GET /v1/responses/{id}``.

Output items: a ``reasoning`` item (the reasoning parser's thinking), a ``message`` with one
``output_text`` part, and a ``function_call`` per tool call. Streaming: ``response.created``,
``response.in_progress``, per item ``response.output_item.added`` ... ``.done`` with the item's
deltas between (``response.output_text.delta``, ``response.reasoning_text.delta``,
``response.function_call_arguments.delta``), then ``response.completed`` (``response.incomplete``
when cut at ``max_output_tokens``, ``response.failed`` on an error).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from dsinfer.gateway.blocks import Block, BlockEvent, BlockStream, RunFailure, final_blocks, stream_blocks
from dsinfer.gateway.prepare import Limits, Prepared, parse_body, prepare_chat
from dsinfer.gateway.request_run import GatewayContext, RequestRun
from dsinfer.gateway.responses_request import ResponsesRequest, ResponseStore, StoredResponse, to_chat_request
from dsinfer.gateway.sse import named_event

_ITEM_PREFIX = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}


def prepare_responses(
    body: bytes, ctx: GatewayContext, limits: Limits, store: ResponseStore
) -> tuple[Prepared, Callable[[RequestRun], ResponsesFormatter]]:
    req = parse_body(ResponsesRequest, body)
    history = store.get(req.previous_response_id).conversation if req.previous_response_id else []
    chat = to_chat_request(req, history)
    prepared = prepare_chat(chat, ctx.tokenizer, limits, ctx.args.tool_call_parser)
    inputs = chat.model_dump(exclude_none=True)["messages"]
    if req.instructions:
        inputs = inputs[1:]  # a later response does not inherit these instructions
    return prepared, lambda run: ResponsesFormatter(run, ctx.model_name, req, inputs, store)


def _item(block: Block, status: str, base: str, *, empty: bool = False) -> dict[str, Any]:
    """``base``: the response's own id hex, so item ids are unique across responses."""
    item_id = f"{_ITEM_PREFIX[block.kind]}_{base}_{block.index}"
    text = "" if empty else block.text
    if block.kind == "reasoning":
        content = [] if empty else [{"type": "reasoning_text", "text": text}]
        return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}
    if block.kind == "text":
        content = [] if empty else [_text_part(text)]
        return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": block.call_id,
        "name": block.name,
        "arguments": text,
        "status": status,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponsesFormatter:
    def __init__(
        self,
        run: RequestRun,
        model: str,
        req: ResponsesRequest,
        inputs: list[dict[str, Any]],
        store: ResponseStore,
    ) -> None:
        self.run, self.model, self.req, self.inputs, self.store = run, model, req, inputs, store
        self.base = uuid.uuid4().hex
        self.id = "resp_" + self.base
        self.created_at = int(time.time())
        self._sequence = 0

    def _body(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        req, state = self.req, self.run.choices[0]
        usage = self.run.usage()
        cut = state.finish_reason == "length"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut and status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tool_choice": req.tool_choice
            if isinstance(req.tool_choice, str) or req.tool_choice is None
            else req.tool_choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "text": req.text.model_dump(by_alias=True, exclude_none=True)
            if req.text
            else {"format": {"type": "text"}},
            "store": req.store,
            "metadata": req.metadata or {},
            "usage": {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {
                    "cached_tokens": usage.prompt_tokens_details.cached_tokens
                    if usage.prompt_tokens_details
                    else 0
                },
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.total_tokens,
            },
        }

    def _final_status(self) -> str:
        return "incomplete" if self.run.choices[0].finish_reason == "length" else "completed"

    def _finish(self, blocks: list[Block]) -> dict[str, Any]:
        """The finished response's object; stored (with its conversation) unless store is false."""
        body = self._body(self._final_status(), [_item(b, "completed", self.base) for b in blocks])
        if self.req.store:
            state = self.run.choices[0]
            answer: dict[str, Any] = {"role": "assistant", "content": state.text}
            if state.reasoning:
                answer["reasoning_content"] = state.reasoning
            if state.tool_calls:
                answer["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in state.tool_calls
                ]
            self.store.put(self.id, StoredResponse([*self.inputs, answer], body))
        return body

    async def response(self) -> dict[str, Any]:
        await self.run.complete()
        return self._finish(final_blocks(self.run.choices[0]))

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return named_event(kind, data)

    async def chunks(self) -> AsyncIterator[str]:
        yield self._event("response.created", response=self._body("in_progress", []))
        yield self._event("response.in_progress", response=self._body("in_progress", []))
        blocks = BlockStream()
        async for item in stream_blocks(self.run, blocks):
            if isinstance(item, RunFailure):
                yield self._failed("server_error" if item.kind == "error" else "timeout", item.message)
                return
            for line in self._block_events(item):
                yield line
        body = self._finish(blocks.blocks)
        yield self._event(f"response.{body['status']}", response=body)

    def _failed(self, code: str, message: str) -> str:
        body = {**self._body("failed", []), "error": {"code": code, "message": message}}
        return self._event("response.failed", response=body)

    def _block_events(self, event: BlockEvent) -> list[str]:
        block = event.block
        where = {"item_id": _item(block, "in_progress", self.base)["id"], "output_index": block.index}
        if event.action == "open":
            out = [
                self._event(
                    "response.output_item.added",
                    output_index=block.index,
                    item=_item(block, "in_progress", self.base, empty=True),
                )
            ]
            if block.kind == "text":
                out.append(
                    self._event("response.content_part.added", **where, content_index=0, part=_text_part(""))
                )
            return out
        if event.action == "delta":
            if block.kind == "tool_call":
                return [self._event("response.function_call_arguments.delta", **where, delta=event.delta)]
            kind = "response.output_text.delta" if block.kind == "text" else "response.reasoning_text.delta"
            extra = {"logprobs": []} if block.kind == "text" else {}
            return [self._event(kind, **where, content_index=0, delta=event.delta, **extra)]
        out = []
        if block.kind == "tool_call":
            out.append(
                self._event(
                    "response.function_call_arguments.done", **where, name=block.name, arguments=block.text
                )
            )
        elif block.kind == "text":
            out.append(
                self._event(
                    "response.output_text.done", **where, content_index=0, text=block.text, logprobs=[]
                )
            )
            out.append(
                self._event(
                    "response.content_part.done", **where, content_index=0, part=_text_part(block.text)
                )
            )
        else:
            out.append(self._event("response.reasoning_text.done", **where, content_index=0, text=block.text))
        out.append(
            self._event(
                "response.output_item.done",
                output_index=block.index,
                item=_item(block, "completed", self.base),
            )
        )
        return out
