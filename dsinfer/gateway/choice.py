"""One choice's text: token deltas -> detokenized text, cut at the stop string, split by reasoning.

The gateway owns stop strings (workers are sent none): each token is fed to the choice's
``StopStringMatcher`` (dsinfer/base/stop_strings.py, the offline engine's too) in order, and the
token that completes a stop string is the choice's last: the tokens after it in the same delta
are dropped, the choice finishes with "stop" and the caller aborts the choice at the workers.
While streaming, text that could be the start of a stop string is held back, so the cut never
has to take back text already sent.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from dsinfer.base.protocol import TokenDelta
from dsinfer.base.stop_strings import StopStringMatcher
from dsinfer.base.tokenizer import REPLACEMENT_CHAR, Tokenizer
from dsinfer.gateway.errors import without_paths
from dsinfer.gateway.reasoning import ReasoningParser
from dsinfer.gateway.tool_parsers import ToolCall, ToolCallDelta, ToolParser

log = logging.getLogger("dsinfer.gateway")


@dataclass
class ChoiceUpdate:
    """What one delta adds to a choice, ready to be sent."""

    text: str = ""  # answer text (all of the text without a reasoning parser)
    reasoning: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    error: str | None = None
    first: bool = False  # the choice's first update
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``stops``."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


class ChoiceState:
    """One choice of a request: its text, tokens and end. It is the request's one record of the
    choice: the backend reads its ``number`` and ``token_ids`` (dsinfer/gateway/backend.py
    ChoiceRecord)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        number: int = 0,
        stops: list[str],
        skip_special_tokens: bool,
        include_stop_str: bool,
        reasoning: ReasoningParser | None,
        tools: ToolParser | None = None,
        incremental: bool = True,
    ) -> None:
        """``incremental=False`` (a response sent whole, with no stop strings, reasoning or tool
        parser): the text is decoded once, when the choice ends; until then updates carry tokens
        only. The text is the same: an incremental detokenization concatenates to the decode of
        all the ids."""
        self.number = number
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.incremental = incremental or bool(stops) or reasoning is not None or tools is not None
        self.matcher = StopStringMatcher(tokenizer, stops, skip_special_tokens)
        self.detokenizer = self.matcher.detokenizer
        self.stops = stops
        self.include_stop_str = include_stop_str
        self.reasoning_parser = reasoning
        self.tool_parser = tools  # reads tool calls out of the answer text
        self.emitted = 0  # characters of the detokenized text already passed on
        self.text = ""  # answer text passed on so far
        self.reasoning = ""
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.num_cached_tokens = 0
        self.started = False
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.stopped_by_string = False  # this state ended the choice on a stop string
        self.stop_string: str | None = None  # the stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def update(self, delta: TokenDelta) -> ChoiceUpdate:
        if self.finished:
            return ChoiceUpdate()
        update = ChoiceUpdate(
            token_ids=list(delta.token_ids), logprobs=delta.logprobs, first=not self.started
        )
        if not self.started:
            self.started = True
            self.num_cached_tokens = delta.num_cached_tokens
            self.prompt_logprobs = delta.prompt_logprobs
        stop_at = None
        if delta.token_ids:
            now = time.monotonic()
            self.first_token_time = self.first_token_time or now
            self.last_token_time = now
            for i, token in enumerate(delta.token_ids if self.incremental else ()):
                stop_at = self.matcher.feed(token)
                if stop_at is not None:  # this token completes a stop string: it is the last
                    update.token_ids = update.token_ids[: i + 1]
                    if update.logprobs is not None:
                        update.logprobs = update.logprobs[: i + 1]
                    break
            self.token_ids.extend(update.token_ids)
            if update.logprobs:
                self.logprobs.extend(update.logprobs)
        if stop_at is not None:
            self.stopped_by_string = True
            delta = TokenDelta(request_id=delta.request_id, finish_reason="stop")
        ending = delta.finish_reason is not None or delta.error is not None
        new = self._final_text(stop_at) if ending else self._safe_text()
        if self.reasoning_parser is None:
            update.text = new
        else:
            update.reasoning, update.text = self.reasoning_parser.feed(new)
            if ending:
                reasoning, text = self.reasoning_parser.flush()
                update.reasoning += reasoning
                update.text += text
        if self.tool_parser is not None:
            cut = delta.finish_reason == "length"
            if cut:  # a character cut in half (U+FFFD) must not hide the start of a marker before it
                update.text = update.text.rstrip(REPLACEMENT_CHAR)
            update.text, update.tool_calls = self.tool_parser.feed(update.text)
            if ending:
                rest, calls = self.tool_parser.flush(cut)
                update.text += rest
                update.tool_calls += calls
        self.text += update.text
        self.reasoning += update.reasoning
        if ending:
            reason = delta.finish_reason or "abort"
            self.finish_reason = update.finish_reason = (
                "tool_calls" if reason == "stop" and self.tool_calls else reason
            )
            self.error = update.error = None if delta.error is None else without_paths(delta.error)
        return update

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.tool_parser.calls if self.tool_parser is not None else []

    def _safe_text(self) -> str:
        if not self.incremental:
            return ""
        text = self.detokenizer.text
        end = max(self.emitted, len(text) - held_back(text, self.stops))
        new = text[self.emitted : end]
        self.emitted = end
        return new

    def _final_text(self, stop_at: int | None) -> str:
        """The rest of the text; cut where the stop string starts (``stop_at``) when one matched."""
        if not self.incremental:
            final = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        elif stop_at is None:
            self.detokenizer.flush()
            final = self.detokenizer.text
        else:
            full = self.detokenizer.text
            end = stop_at
            matched = next((s for s in self.stops if full.startswith(s, end)), "")
            self.stop_string = matched or None
            if self.include_stop_str:
                end += len(matched)
            final = full[:end]
        if len(final) < self.emitted:
            log.warning("stop string at %s lies before text already sent (%d chars)", stop_at, self.emitted)
            return ""
        new = final[self.emitted :]
        self.emitted = len(final)
        return new
