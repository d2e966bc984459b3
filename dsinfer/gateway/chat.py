"""/v1/chat/completions: the response body, or its SSE chunks, from a RequestRun's choice updates."""

from __future__ import annotations

from collections.abc import AsyncIterator

from dsinfer.gateway.choice import ChoiceUpdate
from dsinfer.gateway.openai_api import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprob,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCallOut,
    PromptLogprobs,
    ToolCallOut,
    TopLogprob,
)
from dsinfer.gateway.request_run import GatewayContext, RequestRun
from dsinfer.gateway.sse import run_events
from dsinfer.gateway.tool_parsers import ToolCall, ToolCallDelta


class ChatFormatter:
    def __init__(self, ctx: GatewayContext, run: RequestRun, model: str) -> None:
        self.ctx, self.run, self.model = ctx, run, model
        self.wants_logprobs = run.prepared.params.logprobs is not None
        self.as_id = run.prepared.return_token_ids
        self.reasoning = ctx.args.reasoning_parser is not None

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]]) -> ChatChoiceLogprobs:
        top = self.run.prepared.top_logprobs
        content = []
        for token, alternatives in zip(token_ids, logprobs, strict=False):
            ranked = sorted(alternatives.items(), key=lambda kv: -kv[1])[:top]
            content.append(
                ChatLogprob(
                    **self._entry(token, alternatives.get(token, float("-inf"))).model_dump(),
                    top_logprobs=[self._entry(t, lp) for t, lp in ranked],
                )
            )
        return ChatChoiceLogprobs(content=content)

    def _entry(self, token: int, logprob: float) -> TopLogprob:
        text = self.ctx.token_text(token, self.as_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    def _prompt_logprobs(self) -> PromptLogprobs | None:
        return self.ctx.prompt_logprobs(self.run.choices[0].prompt_logprobs, self.as_id)

    async def response(self) -> ChatCompletionResponse:
        await self.run.complete()
        choices = []
        for i, state in enumerate(self.run.choices):
            calls = tool_calls_out(state.tool_calls)
            if self.reasoning:
                message = ChatResponseMessage(
                    content=state.text or None, reasoning_content=state.reasoning or None, tool_calls=calls
                )
            else:
                message = ChatResponseMessage(content=state.text or (None if calls else ""), tool_calls=calls)
            logprobs = self._logprobs(state.token_ids, state.logprobs) if self.wants_logprobs else None
            choices.append(
                ChatChoice(index=i, message=message, logprobs=logprobs, finish_reason=state.finish_reason)
            )
        return ChatCompletionResponse(
            id=self.run.request_id,
            model=self.model,
            choices=choices,
            usage=self.run.usage(),
            prompt_logprobs=self._prompt_logprobs(),
        )

    def _envelope(self, choices: list[ChatChunkChoice], **fields: object) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.run.request_id, model=self.model, choices=choices, **fields)

    def chunks(self) -> AsyncIterator[str]:
        roles = (
            self._envelope([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
            for i in range(len(self.run.choices))
        )
        return run_events(self.run, self._chunk, lambda usage: self._envelope([], usage=usage), roles)

    def _chunk(self, index: int, update: ChoiceUpdate) -> ChatCompletionChunk | None:
        logprobs = None
        if self.wants_logprobs and update.token_ids:
            logprobs = self._logprobs(update.token_ids, update.logprobs or [])
        prompt_logprobs = self._prompt_logprobs() if update.first and index == 0 else None
        calls = tool_call_deltas(update.tool_calls) or None
        if not (
            update.text or update.reasoning or logprobs or update.finish_reason or prompt_logprobs or calls
        ):
            return None
        delta = ChatDelta(
            content=update.text or None, reasoning_content=update.reasoning or None, tool_calls=calls
        )
        choice = ChatChunkChoice(
            index=index, delta=delta, logprobs=logprobs, finish_reason=update.finish_reason
        )
        return self._envelope([choice], prompt_logprobs=prompt_logprobs)


def tool_calls_out(calls: list[ToolCall]) -> list[ToolCallOut]:
    return [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls]


def tool_call_deltas(deltas: list[ToolCallDelta]) -> list[DeltaToolCall]:
    """OpenAI's streamed calls: the first delta of a call has its id, type and name."""
    return [
        DeltaToolCall(
            index=d.index,
            id=d.id,
            type="function" if d.id is not None else None,
            function=DeltaFunctionCall(name=d.name, arguments=d.arguments),
        )
        for d in deltas
    ]
