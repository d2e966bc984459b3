"""Stop strings over an incremental detokenization, fed one token at a time.

One implementation, two users: the offline engine (``dsinfer.engine.sequence``, for the ``LLM``
API) and the gateway, which owns stop strings when serving (docs/architecture.md): workers are
sent no stop strings and never detokenize. A match must end inside the text the newest token
added, so a stop string is found at the token that completes it, and that token is the
choice's last.
"""

from __future__ import annotations

from dsinfer.base.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["StopStringMatcher"]


class StopStringMatcher:
    def __init__(self, tokenizer: Tokenizer, stops: list[str], skip_special_tokens: bool) -> None:
        self.stops = stops
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)

    @property
    def text(self) -> str:
        return self.detokenizer.text

    def feed(self, token: int) -> int | None:
        """Add one token; return where the earliest stop string it completed starts in the text
        (the text is cut there), or None."""
        new_text = self.detokenizer.feed([token])
        text = self.detokenizer.text
        found = [
            at
            for stop in self.stops
            if (at := text.find(stop, max(0, len(text) - len(new_text) - len(stop) + 1))) >= 0
        ]
        return min(found) if found else None
