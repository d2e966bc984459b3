"""/v1/completions: the response body, or its SSE chunks, from a RequestRun's choice updates.

``echo`` with ``logprobs`` (how lm-eval scores a continuation): the choice's logprobs start with
the prompt's tokens (the first one's logprob is null, as it has no context), each with its top
alternatives, then the generated tokens'; with ``max_tokens`` 0 nothing generated is returned.
"""

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
from dsinfer.gateway.request_run import GatewayContext, RequestRun
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

    def prompt(self, token_ids: list[int], logprobs: list[dict[int, float] | None]) -> CompletionLogprobs:
        """The prompt's tokens: the first has no logprob; each other one its own and the top ones."""
        out = CompletionLogprobs()
        for token, alternatives in zip(token_ids, logprobs, strict=False):
            text = self.ctx.token_text(token, self.as_id)
            out.tokens.append(text)
            out.token_logprobs.append(None if alternatives is None else alternatives.get(token))
            ranked = sorted((alternatives or {}).items(), key=lambda kv: -kv[1])
            out.top_logprobs.append(
                None if alternatives is None else {self.ctx.token_text(t, self.as_id): lp for t, lp in ranked}
            )
            out.text_offset.append(self.offset)
            self.offset += len(text)
        return out


def _joined(first: CompletionLogprobs, then: CompletionLogprobs | None) -> CompletionLogprobs:
    if then is None:
        return first
    return CompletionLogprobs(
        tokens=first.tokens + then.tokens,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        top_logprobs=first.top_logprobs + then.top_logprobs,
        text_offset=first.text_offset + then.text_offset,
    )


class CompletionFormatter:
    def __init__(self, ctx: GatewayContext, run: RequestRun, model: str) -> None:
        self.ctx, self.run, self.model = ctx, run, model
        prepared = run.prepared
        self.wants_logprobs = prepared.params.logprobs is not None
        self.prefixes = [
            prepared.prompt_texts[i // run.n] if prepared.echo else "" for i in range(len(run.choices))
        ]
        # with echo + logprobs, the offsets count from the prompt's first token
        offsets = [0 if prepared.echo_logprobs else len(p) for p in self.prefixes]
        self.logprobs = [_Logprobs(ctx, prepared.return_token_ids, offset) for offset in offsets]
        self.echo_only = prepared.echo_only

    def _echoed(self, index: int) -> CompletionLogprobs:
        prompt = self.run.prepared.prompts[index // self.run.n]
        raw = self.run.choices[index].prompt_logprobs or [None] * len(prompt)
        return self.logprobs[index].prompt(prompt, raw)

    async def response(self) -> CompletionResponse:
        await self.run.complete()
        choices = []
        for i, state in enumerate(self.run.choices):
            logprobs = None
            if self.wants_logprobs and not self.echo_only:
                logprobs = self.logprobs[i].convert(state.token_ids, state.logprobs)
            if self.run.prepared.echo_logprobs:
                logprobs = _joined(self._echoed(i), logprobs)
            choices.append(
                CompletionChoice(
                    index=i,
                    text=self.prefixes[i] + ("" if self.echo_only else state.text),
                    logprobs=logprobs,
                    finish_reason="length" if self.echo_only else state.finish_reason,
                    prompt_logprobs=self._prompt_logprobs(state.prompt_logprobs),
                )
            )
        return CompletionResponse(
            id=self.run.request_id, model=self.model, choices=choices, usage=self.run.usage()
        )

    def _prompt_logprobs(self, raw: list[dict[int, float] | None] | None) -> PromptLogprobs | None:
        if not self.run.prepared.show_prompt_logprobs:
            return None
        return self.ctx.prompt_logprobs(raw, self.run.prepared.return_token_ids)

    def chunks(self) -> AsyncIterator[str]:
        return run_events(self.run, self._chunk, lambda usage: self._envelope([], usage=usage))

    def _envelope(self, choices: list[CompletionChoice], **fields: object) -> CompletionChunk:
        return CompletionChunk(id=self.run.request_id, model=self.model, choices=choices, **fields)

    def _chunk(self, index: int, update: ChoiceUpdate) -> CompletionChunk | None:
        text = "" if self.echo_only else update.text
        prompt_logprobs = None
        echoed = None
        if update.first:
            text = self.prefixes[index] + text
            prompt_logprobs = self._prompt_logprobs(self.run.choices[index].prompt_logprobs)
            if self.run.prepared.echo_logprobs:
                echoed = self._echoed(index)
        logprobs = None
        if self.wants_logprobs and update.token_ids and not self.echo_only:
            logprobs = self.logprobs[index].convert(update.token_ids, update.logprobs or [])
        if echoed is not None:
            logprobs = _joined(echoed, logprobs)
        if not text and logprobs is None and update.finish_reason is None and prompt_logprobs is None:
            return None
        choice = CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason="length" if self.echo_only and update.finish_reason else update.finish_reason,
            prompt_logprobs=prompt_logprobs,
        )
        return self._envelope([choice])
