"""/v1/messages (Anthropic's Messages API): the response body, or its stream of typed events
(``message_start``, ``content_block_start``/``_delta``/``_stop``, ``message_delta``,
``message_stop``), from a RequestRun's one choice."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from dsinfer.gateway.anthropic_request import MessagesRequest, to_chat_request
from dsinfer.gateway.blocks import Block, BlockEvent, BlockStream, RunFailure, final_blocks, stream_blocks
from dsinfer.gateway.choice import ChoiceState
from dsinfer.gateway.prepare import Limits, Prepared, parse_body, prepare_chat
from dsinfer.gateway.request_run import GatewayContext, RequestRun
from dsinfer.gateway.sse import named_event

log = logging.getLogger("dsinfer.gateway")

_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def prepare_messages(body: bytes, ctx: GatewayContext, limits: Limits) -> Prepared:
    chat = to_chat_request(parse_body(MessagesRequest, body))
    return prepare_chat(chat, ctx.tokenizer, limits, ctx.args.tool_call_parser)


def stop_reason(state: ChoiceState) -> tuple[str | None, str | None]:
    """-> (stop_reason, stop_sequence) of a finished choice."""
    if state.finish_reason is None:
        return None, None
    if state.stop_string is not None:
        return "stop_sequence", state.stop_string
    return _STOP_REASONS.get(state.finish_reason, "end_turn"), None


def _tool_input(block: Block) -> dict[str, Any]:
    try:
        value = json.loads(block.text or "{}")
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        log.warning(
            "tool call %s: arguments are not a JSON object; returned under 'arguments'", block.call_id
        )
        return {"arguments": block.text}
    return value


def _content(block: Block, *, empty: bool = False) -> dict[str, Any]:
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": "" if empty else block.text, "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": "" if empty else block.text}
    return {
        "type": "tool_use",
        "id": block.call_id,
        "name": block.name,
        "input": {} if empty else _tool_input(block),
    }


_DELTAS = {"reasoning": ("thinking_delta", "thinking"), "text": ("text_delta", "text")}


class MessagesFormatter:
    def __init__(self, ctx: GatewayContext, run: RequestRun, model: str) -> None:
        self.run, self.model = run, model
        self.id = "msg_" + run.request_id.split("-", 1)[1]

    def _usage(self) -> dict[str, int]:
        usage = self.run.usage()
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        return {
            "input_tokens": usage.prompt_tokens,
            "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": cached,
        }

    def _message(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        reason, sequence = stop_reason(self.run.choices[0])
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": self._usage(),
        }

    async def response(self) -> dict[str, Any]:
        await self.run.complete()
        return self._message([_content(b) for b in final_blocks(self.run.choices[0])])

    async def chunks(self) -> AsyncIterator[str]:
        yield named_event("message_start", {"type": "message_start", "message": self._message([])})
        async for item in stream_blocks(self.run, BlockStream()):
            if isinstance(item, RunFailure):
                yield self._error("api_error" if item.kind == "error" else "timeout_error", item.message)
                return
            yield self._event(item)
        reason, sequence = stop_reason(self.run.choices[0])
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        usage = {"output_tokens": self._usage()["output_tokens"]}
        yield named_event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
        yield named_event("message_stop", {"type": "message_stop"})

    def _event(self, event: BlockEvent) -> str:
        block = event.block
        if event.action == "open":
            data = {
                "type": "content_block_start",
                "index": block.index,
                "content_block": _content(block, empty=True),
            }
            return named_event("content_block_start", data)
        if event.action == "close":
            return named_event("content_block_stop", {"type": "content_block_stop", "index": block.index})
        kind, field = _DELTAS.get(block.kind, ("input_json_delta", "partial_json"))
        data = {
            "type": "content_block_delta",
            "index": block.index,
            "delta": {"type": kind, field: event.delta},
        }
        return named_event("content_block_delta", data)

    @staticmethod
    def _error(kind: str, message: str) -> str:
        return named_event("error", {"type": "error", "error": {"type": kind, "message": message}})
