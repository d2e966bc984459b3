"""One sequence's position in its grammar (dsinfer/engine/constraints.py builds and uses them)."""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq

import llguidance

log = logging.getLogger("dsinfer.engine")


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.consumed = 0  # output tokens fed so far
        self.failed = False

    def sync(self, output_token_ids: Seq[int], request_id: str) -> None:
        """Feed the output tokens after the ones already consumed."""
        new = output_token_ids[self.consumed :]
        self.consumed = len(output_token_ids)
        if new and not self.failed and not self.matcher.consume_tokens(list(new)):
            self.failed = True
            log.error("%s: grammar refused its own output: %s", request_id, self.matcher.get_error())
