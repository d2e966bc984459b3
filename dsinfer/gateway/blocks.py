"""A choice's output as typed blocks (reasoning, text, tool calls), as /v1/responses and
Anthropic's /v1/messages return it: whole from a finished choice, or streamed as block events
(open, delta, close) from its updates.

In a stream a block is open until the next kind of output starts: reasoning, then text, then
each tool call (a call's first delta names it and opens its block; the rest are its arguments).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

from dsinfer.gateway.choice import ChoiceState, ChoiceUpdate
from dsinfer.gateway.request_run import RequestRun, RequestTimeout

BlockKind = Literal["reasoning", "text", "tool_call"]


@dataclass
class Block:
    kind: BlockKind
    index: int  # position among the choice's blocks
    text: str = ""  # reasoning or text, or a call's arguments (JSON text)
    call_id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class BlockEvent:
    action: Literal["open", "delta", "close"]
    block: Block
    delta: str = ""


@dataclass(frozen=True)
class RunFailure:
    """The run ended without finishing its choice: a backend error or the request's deadline."""

    kind: Literal["error", "timeout"]
    message: str


def final_blocks(state: ChoiceState) -> list[Block]:
    """A finished choice's blocks in order: its reasoning, its text, its tool calls."""
    blocks: list[Block] = []
    if state.reasoning:
        blocks.append(Block("reasoning", len(blocks), state.reasoning))
    if state.text.strip() or not (state.reasoning or state.tool_calls):
        blocks.append(Block("text", len(blocks), state.text))
    for call in state.tool_calls:
        blocks.append(Block("tool_call", len(blocks), call.arguments, call.id, call.name))
    return blocks


class BlockStream:
    """One choice's updates -> block events."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self._open: Block | None = None
        self._calls: dict[int, Block] = {}  # a tool call's delta index -> its block

    def feed(self, update: ChoiceUpdate) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if update.reasoning:
            events += self._write("reasoning", update.reasoning)
        if update.text and (update.text.strip() or self._is_open("text")):
            events += self._write("text", update.text)
        for d in update.tool_calls:
            if d.index not in self._calls:
                events += self._close()
                self._calls[d.index] = self._start("tool_call", events, call_id=d.id, name=d.name)
            block = self._calls[d.index]
            if d.arguments:
                block.text += d.arguments
                events.append(BlockEvent("delta", block, d.arguments))
        return events

    def finish(self) -> list[BlockEvent]:
        """Close the open block; a choice that wrote nothing gets one empty text block."""
        events = self._close()
        if not self.blocks:
            self._start("text", events)
            events += self._close()
        return events

    def _is_open(self, kind: BlockKind) -> bool:
        return self._open is not None and self._open.kind == kind

    def _write(self, kind: BlockKind, text: str) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if not self._is_open(kind):
            events += self._close()
            self._start(kind, events)
        assert self._open is not None
        self._open.text += text
        events.append(BlockEvent("delta", self._open, text))
        return events

    def _start(
        self, kind: BlockKind, events: list[BlockEvent], call_id: str | None = None, name: str | None = None
    ) -> Block:
        block = Block(kind, len(self.blocks), call_id=call_id, name=name)
        self.blocks.append(block)
        self._open = block
        events.append(BlockEvent("open", block))
        return block

    def _close(self) -> list[BlockEvent]:
        if self._open is None:
            return []
        block, self._open = self._open, None
        return [BlockEvent("close", block)]


async def stream_blocks(run: RequestRun, blocks: BlockStream) -> AsyncIterator[BlockEvent | RunFailure]:
    """The block events of a run's one choice; a failure is the last item (the run is aborted)."""
    try:
        async for _, update in run.updates():
            if update.error is not None:
                await run.abort()
                yield RunFailure("error", update.error)
                return
            for event in blocks.feed(update):
                yield event
    except RequestTimeout as e:
        yield RunFailure("timeout", str(e))
        return
    for event in blocks.finish():
        yield event
