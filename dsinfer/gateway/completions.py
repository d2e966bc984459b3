"""/v1/completions: the response body, or its SSE chunks, from a RequestRun's choice updates."""

from __future__ import annotations

from collections.abc import AsyncIterator

from dsinfer.gateway.choice import ChoiceUpdate
from dsinfer.gateway.openai_api import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    PromptLogprobs,
)
from dsinfer.gateway.serving import GatewayContext, RequestRun
from dsinfer.gateway.sse import run_events


class _Logprobs:
    """One choice's logprobs in the completions format; ``text_offset`` counts token texts."""

    def __init__(self, ctx: GatewayContext, as_id: bool, offset: int) -> None:
        self.ctx, self.as_id, self.offset = ctx, as_id, offset

    def convert(self, token_ids: list[int], logprobs: list[dict[int, float]]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for token, alternatives in zip(token_ids, logprobs, strict=False):
            text = self.ctx.token_text(token, self.as_id)
            out.tokens.append(text)
            out.token_logprobs.append(alternatives.get(token))
            ranked = sorted(alternatives.items(), key=lambda kv: -kv[1])
            out.top_logprobs.append({self.ctx.token_text(t, self.as_id): lp for t, lp in ranked})
            out.text_offset.append(self.offset)
            self.offset += len(text)
        return out


class CompletionFormatter:
    def __init__(self, ctx: GatewayContext, run: RequestRun, model: str) -> None:
        self.ctx, self.run, self.model = ctx, run, model
        prepared = run.prepared
        self.wants_logprobs = prepared.params.logprobs is not None
        self.prefixes = [
            prepared.prompt_texts[i // run.n] if prepared.echo else "" for i in range(len(run.choices))
        ]
        self.logprobs = [_Logprobs(ctx, prepared.return_token_ids, len(p)) for p in self.prefixes]

    async def response(self) -> CompletionResponse:
        await self.run.complete()
        choices = []
        for i, state in enumerate(self.run.choices):
            logprobs = (
                self.logprobs[i].convert(state.token_ids, state.logprobs) if self.wants_logprobs else None
            )
            choices.append(
                CompletionChoice(
                    index=i,
                    text=self.prefixes[i] + state.text,
                    logprobs=logprobs,
                    finish_reason=state.finish_reason,
                    prompt_logprobs=self._prompt_logprobs(state.prompt_logprobs),
                )
            )
        return CompletionResponse(
            id=self.run.request_id, model=self.model, choices=choices, usage=self.run.usage()
        )

    def _prompt_logprobs(self, raw: list[dict[int, float] | None] | None) -> PromptLogprobs | None:
        return self.ctx.prompt_logprobs(raw, self.run.prepared.return_token_ids)

    def chunks(self) -> AsyncIterator[str]:
        return run_events(self.run, self._chunk, lambda usage: self._envelope([], usage=usage))

    def _envelope(self, choices: list[CompletionChoice], **fields: object) -> CompletionChunk:
        return CompletionChunk(id=self.run.request_id, model=self.model, choices=choices, **fields)

    def _chunk(self, index: int, update: ChoiceUpdate) -> CompletionChunk | None:
        text = update.text
        prompt_logprobs = None
        if update.first:
            text = self.prefixes[index] + text
            prompt_logprobs = self._prompt_logprobs(self.run.choices[index].prompt_logprobs)
        logprobs = None
        if self.wants_logprobs and update.token_ids:
            logprobs = self.logprobs[index].convert(update.token_ids, update.logprobs or [])
        if not text and logprobs is None and update.finish_reason is None and prompt_logprobs is None:
            return None
        choice = CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=update.finish_reason,
            prompt_logprobs=prompt_logprobs,
        )
        return self._envelope([choice])
