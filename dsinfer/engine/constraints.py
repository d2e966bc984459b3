"""What the sampler must not draw: tokens outside a request's grammar, and eos before ``min_tokens``.

Structured output (``SamplingParams.grammar``, an llguidance grammar: dsinfer/base/grammar.py) is a
token bitmask applied to the logits in the sampler, after penalties and logit bias, batched over
every constrained row of the step (llguidance's executor fills the rows' masks in parallel
threads, with the GIL released).

A sequence's matcher state is a function of its output tokens: before each mask it consumes the
output tokens it has not seen (``GrammarMatcher.sync``). So whatever appended them, the matcher
follows: this rank's own sampling, the first token a PD prefill rank sampled (the decode rank's
matcher replays it at its first step), a preempted sequence recomputed, or a continuation that
arrives with tokens already delivered (request migration: a fresh matcher replays them all).
The masks are computed on a background thread while the step's forward runs (``start`` before
the forward, ``apply`` after it), so they take cores the forward leaves idle.
An MTP draft is checked against the mask: its verification row is masked with the state after
the draft (llguidance computes both masks), and a draft outside the grammar is never accepted,
because the target's own row cannot sample it.

Compilation: the gateway validates a grammar without a tokenizer (400 for a bad one); the worker
builds the token-level matcher, the costly part (the lexer over the vocabulary), once per grammar
text: ``GrammarCache`` keeps pristine matchers (LRU) and every sequence starts from a copy.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import torch

from dsinfer.base.tokenizer import Tokenizer
from dsinfer.engine.grammar_matcher import GrammarMatcher
from dsinfer.engine.sequence import Sequence
from dsinfer.ops.bitmask import apply_token_bitmask, bitmask_words

log = logging.getLogger("dsinfer.engine")

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept per rank


class GrammarCache:
    """Compiled grammars of one vocabulary, keyed by grammar text (LRU)."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, eos_ids: Seq[int], size: int = GRAMMAR_CACHE_SIZE
    ):
        self._tokenizer, self._vocab_size, self._eos = tokenizer, vocab_size, sorted(eos_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self.size = size

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:  # about a second for a 128K vocabulary: built on first use
            self._ll_tokenizer = llguidance.LLTokenizer(
                self._tokenizer.backend.to_str(), n_vocab=self._vocab_size, eos_token=self._eos
            )
        return self._ll_tokenizer

    def compiled(self, grammar: str) -> llguidance.LLMatcher:
        """A pristine matcher of ``grammar``; ValueError with the engine's message when it is refused."""
        matcher = self._compiled.get(grammar)
        if matcher is not None:
            self._compiled.move_to_end(grammar)
            return matcher
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"grammar: {matcher.get_error()}")
        self._compiled[grammar] = matcher
        if len(self._compiled) > self.size:
            self._compiled.popitem(last=False)
        return matcher

    def matcher(self, grammar: str) -> GrammarMatcher:
        return GrammarMatcher(self.compiled(grammar).deep_copy())


@dataclass
class PendingMask:
    """A step's token bitmask ``[rows, words]``, being filled by ``done`` (None: already filled)."""

    bitmask: torch.Tensor
    done: Future[None] | None

    def result(self) -> torch.Tensor:
        if self.done is not None:
            self.done.result()
        return self.bitmask


class LogitConstraints:
    """Applies grammars and ``min_tokens`` to a step's sampling rows."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: Seq[int]) -> None:
        self.grammars = GrammarCache(tokenizer, vocab_size, eos_ids)
        self.vocab_size = vocab_size
        self._executor: llguidance.LLExecutor | None = None
        self._background = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")

    def check(self, grammar: str | None) -> None:
        """Compile (and cache) a request's grammar; ValueError naming the problem."""
        if grammar is not None:
            self.grammars.compiled(grammar)

    @property
    def executor(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=min(8, os.cpu_count() or 1))
        return self._executor

    def start(self, seqs: list[Sequence], offsets: list[int]) -> PendingMask | None:
        """Begin the grammar masks of a step's sampling rows (see ``apply``) on a background thread,
        so they are computed while the forward runs; None when no row has a grammar. The masks
        depend only on each sequence's output and MTP draft, which the step does not change
        before it samples."""
        constrained = [r for r, seq in enumerate(seqs) if seq.params.grammar is not None]
        if not constrained:
            return None
        bitmask = torch.full((len(seqs), bitmask_words(self.vocab_size)), -1, dtype=torch.int32)
        plain: list[tuple[llguidance.LLMatcher, int]] = []
        drafted: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
        for r in constrained:
            seq = seqs[r]
            if offsets[r] != 0:
                continue  # the draft's row: filled with its sequence's first row below
            if seq.grammar_matcher is None:
                seq.grammar_matcher = self.grammars.matcher(seq.params.grammar)  # type: ignore[arg-type]
            state = seq.grammar_matcher
            state.sync(seq.output_token_ids, seq.request_id)
            if state.failed:
                bitmask[r] = 0
                for eos in seq.eos_ids:
                    bitmask[r, eos // 32] |= _bit(eos % 32)
                continue
            has_draft_row = r + 1 < len(seqs) and seqs[r + 1] is seq and offsets[r + 1] == 1
            if has_draft_row and seq.drafts:  # a constrained sequence verifies one draft at most
                drafted.append((state.matcher, r, seq.drafts[:1]))
            else:
                plain.append((state.matcher, r))
        size = (bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])

        def compute() -> None:  # llguidance releases the GIL while it fills the rows
            if plain:
                self.executor.unsafe_compute_mask_ptr(plain, *size)
            if drafted:
                self.executor.unsafe_compute_mask_ptr_with_draft_token(drafted, *size)

        if not plain and not drafted:
            return PendingMask(bitmask, None)
        return PendingMask(bitmask, self._background.submit(compute))

    def apply(
        self,
        seqs: list[Sequence],
        offsets: list[int],
        logits: torch.Tensor,
        pending: PendingMask | None = None,
    ) -> torch.Tensor:
        """``logits [rows, V]``: row r samples output position ``len(output) + offsets[r]`` of
        ``seqs[r]`` (offset 1: the row after the sequence's MTP draft). ``pending``: what
        ``start`` returned for these rows before the forward (computed here when not given)."""
        logits = self._min_tokens(seqs, offsets, logits)
        if pending is None:
            pending = self.start(seqs, offsets)
        if pending is None:
            return logits
        return apply_token_bitmask(logits, pending.result())  # unconstrained rows allow every token

    def _min_tokens(self, seqs: list[Sequence], offsets: list[int], logits: torch.Tensor) -> torch.Tensor:
        rows, cols = [], []
        for r, (seq, offset) in enumerate(zip(seqs, offsets, strict=True)):
            if seq.num_output_tokens + offset < seq.params.min_tokens:
                banned = set(seq.params.stop_token_ids or []) | (
                    set() if seq.params.ignore_eos else seq.eos_ids
                )
                for token in banned:
                    if token < logits.shape[-1]:
                        rows.append(r)
                        cols.append(token)
        if not rows:
            return logits
        logits = logits.clone()
        logits[rows, cols] = float("-inf")
        return logits


def _bit(index: int) -> int:
    """Bit ``index`` of an int32 word as a Python int of that word's value."""
    return -(1 << 31) if index == 31 else 1 << index
