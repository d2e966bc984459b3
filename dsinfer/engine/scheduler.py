"""Continuous batching with chunked prefill under a token budget, admission by free KV and
preemption by recompute.

Every step, running sequences are served first (in arrival order): a decode needs one token, an
unfinished prefill its next chunk. When pages run out, the most recently admitted running sequence
is preempted: its pages are released and it waits again at the head of the queue, to be
recomputed (prompt and the tokens it already generated) when it is readmitted. Waiting sequences
are then admitted first-come first-served while the budget, ``max_num_seqs`` and free pages last;
a prefix-cache hit lets a sequence skip computing its cached pages. A request that could never fit
the pool is refused before it is queued (``check_fits``), so nobody waits forever.

Prefix pages in a tier below the pool (host memory, disk) are loaded ahead: every step starts the
loads of waiting sequences not yet asked for (``KVCacheManager.prefetch``), and a sequence whose
loads are still running is passed over (the ones behind it may go first) until they are done.

Attention-aware chunking (optional, ``attention_token_weight``): the budget is then counted in
new-token equivalents of the attention stage, a prefill chunk costing ``prefill_chunk_cost``:
its tokens (their projections), plus its causal query-key pairs over ``attention_token_weight``
(pairs that cost as much as one token's projections), plus decompressing the tokens already in
the cache (``context_token_weight`` each). A continuation over a long cached context then gets a
short chunk, so that on a lockstep data-parallel pool (where the attention stage is each rank's
own and the experts' work is pooled) no rank's step is stretched by one long context. Decodes
still cost their tokens. dsinfer/sim models the same rule.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from dsinfer.base.chunking import fit_prefill_chunk, prefill_chunk_cost
from dsinfer.cache.cache_stats import Prefetch
from dsinfer.cache.kv_manager import KVCacheManager
from dsinfer.engine.sequence import SeqStatus, Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first token computed this step (= num_computed_tokens before the step)
    num_new: int  # tokens computed this step, the MTP drafts included
    num_draft: int = 0  # how many of the last computed tokens are the sequence's MTP drafts

    @property
    def end(self) -> int:
        return self.start + self.num_new

    @property
    def samples(self) -> bool:
        """The step computes the sequence's last known token, so it samples the next one(s)."""
        return self.end - self.num_draft == self.seq.num_tokens

    @property
    def is_decode(self) -> bool:
        return self.start > 0 and self.num_new - self.num_draft == 1

    def chains(self, depth: int, sampled: int) -> bool:
        """Whether the MTP layer proposes draft ``depth`` (2 on: a chained draft) after this step
        sampled ``sampled`` tokens (a decode, or the chunk that ends a prompt) when its max_tokens
        leaves room to verify it; one draft only under a grammar (its mask covers one)."""
        seq = self.seq
        return (
            self.samples
            and seq.params.grammar is None
            and seq.num_output_tokens + sampled + depth < seq.max_tokens
        )


@dataclass
class StepResult:
    """What a step produced for one scheduled sequence."""

    tokens: list[tuple[int, dict[int, float] | None]] = field(default_factory=list)  # accepted, in order
    num_accepted: int = 0  # of the step's drafts, the leading ones the target sampled too
    next_drafts: list[int] = field(default_factory=list)  # the MTP proposals for the next step
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)  # for prompt positions computed


@dataclass
class ScheduledBatch:
    """Prefill chunks first (decompressed MLA path), then single-token decodes (absorbed path)."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    num_decodes: int = 0
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def decode_q_len(self) -> int:
        """New tokens of the longest decode (one, plus its MTP drafts); 0 with none."""
        return max((s.num_new for s in self.seqs[len(self.seqs) - self.num_decodes :]), default=0)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.seqs)

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass
class SchedulerStats:
    prompt_tokens_submitted: int = 0
    prompt_tokens_computed: int = 0  # includes recomputation after preemption
    prompt_tokens_cached: int = 0
    preemptions: int = 0
    steps: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    draft_verifications: int = 0  # sequence-steps that verified drafts (one or more)
    decode_forwards: int = 0  # sequence-steps that sampled after the prompt
    decode_tokens: int = 0  # tokens those sequence-steps produced

    @property
    def acceptance_rate(self) -> float:
        return self.drafts_accepted / self.drafts_proposed if self.drafts_proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification yields per sequence: 1 + accepted drafts per verification."""
        return 1 + self.drafts_accepted / self.draft_verifications if self.draft_verifications else 0.0

    @property
    def forwards_per_output_token(self) -> float:
        return self.decode_forwards / self.decode_tokens if self.decode_tokens else 0.0


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        attention_token_weight: float | None = None,
        context_token_weight: float = 0.0,
        max_drafts: int = 1,
    ) -> None:
        """``max_drafts``: the MTP drafts a sequence may carry into a step (when it has them). From
        the second on, each draft is proposed by the MTP layer over the one before it, which writes
        the layer's latent one position further: those positions get pages with the step's."""
        if attention_token_weight is not None and attention_token_weight <= 0:
            raise ValueError(f"attention_token_weight must be positive, got {attention_token_weight}")
        if context_token_weight < 0:
            raise ValueError(f"context_token_weight must be >= 0, got {context_token_weight}")
        self.kv = kv
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.attention_token_weight, self.context_token_weight = attention_token_weight, context_token_weight
        self.max_drafts = max_drafts
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_reserved = 0
        self.stats = SchedulerStats()
        self._prefetches: dict[str, Prefetch | None] = {}  # waiting sequence -> its tier loads

    def pages_for(self, num_tokens: int) -> int:
        return self.kv.pool.pages_for(num_tokens)

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        needed = self.pages_for(prompt_len + max_tokens)
        if needed > self.kv.num_pages:
            raise ValueError(
                f"request needs {needed} KV pages ({prompt_len} prompt + {max_tokens} max_tokens tokens) but the "
                f"whole KV cache has {self.kv.num_pages} pages of {self.kv.page_size} tokens"
            )

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.stats.prompt_tokens_submitted += seq.prompt_len

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # PD decode side: a sequence whose prompt KV another rank computes ------------------------
    def reserve(self, seq: Sequence) -> int | None:
        """Hold pages for ``seq``'s known tokens (its prompt, a continuation's output too), its
        cached prefix first; returns how many tokens that prefix covers (whole pages), or None,
        holding nothing, while seats or pages are short. The caller later ``join``s or gives the
        pages back through ``cancel_reserved`` (their KV may still be being written)."""
        if len(self.running) + self.num_reserved >= self.max_num_seqs:
            return None
        match = self.kv.match_prefix(seq.token_ids) if seq.uses_prefix_cache else None
        cached_pages = match.pages if match else []
        needed = self.pages_for(seq.num_tokens) - len(cached_pages)
        if needed > self.kv.num_available_pages():
            if match:
                self.kv.abandon(match)
            return None
        seq.pages = cached_pages + self.kv.allocate(needed)
        cached = match.num_tokens if match else 0
        seq.num_cached_prompt_tokens = min(cached, seq.prompt_len)
        seq.status = SeqStatus.RESERVED
        self.num_reserved += 1
        self.stats.prompt_tokens_submitted += seq.prompt_len
        self.stats.prompt_tokens_cached += seq.num_cached_prompt_tokens
        return cached

    def join(
        self, seq: Sequence, first_token: int, logprobs: dict[int, float] | None, computed: int | None = None
    ) -> bool:
        """The KV of the known tokens has arrived (of the first ``computed`` of them: the rest is
        computed here, as a prompt's next chunk): record the next token (sampled by the prefill
        rank) and run the sequence. Returns whether it finished with that token."""
        self.num_reserved -= 1
        seq.num_computed_tokens = seq.num_tokens if computed is None else computed
        seq.status = SeqStatus.RUNNING
        if seq.uses_prefix_cache:
            self.kv.commit(seq.token_ids, seq.pages, seq.num_computed_tokens)
        seq.append(first_token, logprobs)
        if seq.finish_reason is not None:
            self._finish(seq)
            return True
        self.running.append(seq)
        return False

    def cancel_reserved(self, seq: Sequence, reason: str = "abort") -> list[int]:
        """End a reserved sequence; returns its pages, still referenced, for the caller to release
        once no write can land in them."""
        self.num_reserved -= 1
        pages, seq.pages = seq.pages, []
        seq.finish_reason = reason
        seq.status = SeqStatus.FINISHED
        seq.finish_time = time.monotonic()
        return pages

    # Scheduling ---------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        budget: float = self.max_num_batched_tokens
        batch = ScheduledBatch()
        scheduled: list[ScheduledSeq] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = self._chunk(
                seq.num_computed_tokens, seq.num_tokens - seq.num_computed_tokens, budget, not scheduled
            )
            if num_new == 0 and self.attention_token_weight is not None:
                break  # not even one token of its chunk fits what is left of the step
            num_draft = self._num_draft(seq, num_new, budget)
            if not self._grow(
                seq, self._reach(seq, seq.num_computed_tokens, num_new + num_draft, num_draft), batch
            ):
                break  # seq itself was preempted: everything after it already was
            item = ScheduledSeq(seq, seq.num_computed_tokens, num_new + num_draft, num_draft)
            scheduled.append(item)
            budget -= self._cost(item)
            i += 1
        self._start_loads()
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs or batch.preempted:
                break
            prefetch = self._prefetches.get(seq.key)
            if prefetch is not None and self.kv.loading(prefetch):
                continue  # its prefix is still coming from a slower tier: the step goes on without it
            item = self._admit(seq, budget, first=not scheduled)
            if item is None:
                break
            self.waiting.remove(seq)
            self._prefetches.pop(seq.key, None)
            scheduled.append(item)
            budget -= self._cost(item)
        # Decodes (with or without a draft) go last: the absorbed MLA path takes them.
        decodes = [s for s in scheduled if s.is_decode]
        batch.seqs = [s for s in scheduled if not s.is_decode] + decodes
        batch.num_decodes = len(decodes)
        self.stats.steps += 1
        return batch

    def _num_draft(self, seq: Sequence, num_new: int, budget: float) -> int:
        """The drafts a decode verifies: those it has, within its max_tokens and the step's budget;
        a grammar-constrained sequence verifies one (its mask covers one draft)."""
        if num_new != 1:
            return 0
        limit = 1 if seq.params.grammar is not None else self.max_drafts
        return max(
            0, min(len(seq.drafts), limit, seq.max_tokens - seq.num_output_tokens - 1, int(budget) - 1)
        )

    def _reach(self, seq: Sequence, start: int, num_new: int, num_draft: int) -> int:
        """Tokens whose pages a step computing ``num_new`` from ``start`` needs. With chained drafts
        the MTP layer writes its latent for each draft after the first past the step's end: after a
        decode (never past the sequence's last possible token), and after the chunk that ends a
        prompt (it samples one token) as far as its drafts go (ScheduledSeq.chains)."""
        end = start + num_new
        if self.max_drafts == 1:
            return end
        item = ScheduledSeq(seq, start, num_new, num_draft)
        if item.is_decode:
            return min(end + self.max_drafts - 1, seq.prompt_len + seq.max_tokens)
        depth = max((d for d in range(2, self.max_drafts + 1) if item.chains(d, 1)), default=1)
        return end + depth - 1

    def _start_loads(self) -> None:
        self.kv.finish_loads()
        if not self.kv.loads_ahead:
            return
        for seq in self.waiting:
            if not seq.uses_prefix_cache:
                continue
            # asked again once its loads are done: more of its pages may be below the pool (the
            # loads in flight are capped), until a prefetch finds nothing to load
            prefetch = self._prefetches.get(seq.key, Prefetch([]))
            if prefetch is not None and not self.kv.loading(prefetch):
                self._prefetches[seq.key] = self.kv.prefetch(seq.token_ids)

    def _chunk(self, start: int, remaining: int, budget: float, first: bool) -> int:
        """Tokens of a sequence at ``start`` with ``remaining`` to compute that ``budget`` affords."""
        if self.attention_token_weight is None or remaining <= 1:
            return int(min(remaining, budget))  # decodes (and the token-only budget) count tokens
        return fit_prefill_chunk(
            start, remaining, budget, self.attention_token_weight, self.context_token_weight, first
        )

    def _cost(self, item: ScheduledSeq) -> float:
        if self.attention_token_weight is None or item.num_new - item.num_draft <= 1:
            return item.num_new
        return prefill_chunk_cost(
            item.start, item.num_new, self.attention_token_weight, self.context_token_weight
        )

    def _grow(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Give ``seq`` pages for ``num_tokens`` tokens, preempting the latest running sequences."""
        needed = self.pages_for(num_tokens) - len(seq.pages)
        while needed > self.kv.num_available_pages():
            victim = self.running[-1]
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        if needed > 0:
            seq.pages.extend(self.kv.allocate(needed))
        return True

    def _admit(self, seq: Sequence, budget: float, first: bool) -> ScheduledSeq | None:
        load = not self.kv.loads_ahead  # else prefetched: no step waits for a tier
        match = self.kv.match_prefix(seq.token_ids, load=load) if seq.uses_prefix_cache else None
        cached = match.num_tokens if match else 0
        num_new = self._chunk(cached, seq.num_tokens - cached, budget, first)
        needed = self.pages_for(self._reach(seq, cached, num_new, 0)) - (len(match.pages) if match else 0)
        if num_new == 0 or needed > self.kv.num_available_pages():
            if match:
                self.kv.abandon(match)
            return None
        seq.pages = (match.pages if match else []) + self.kv.allocate(needed)
        seq.num_computed_tokens = cached
        seq.num_cached_prompt_tokens = min(cached, seq.prompt_len)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self.stats.prompt_tokens_cached += seq.num_cached_prompt_tokens
        return ScheduledSeq(seq, cached, num_new)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.release(seq.pages)
        seq.pages, seq.num_computed_tokens, seq.status, seq.drafts = [], 0, SeqStatus.WAITING, []
        self.waiting.appendleft(seq)
        self._prefetches.pop(seq.key, None)  # its pages may be in a lower tier by readmission
        self.stats.preemptions += 1

    # After the step -----------------------------------------------------------------------
    def postprocess(self, batch: ScheduledBatch, results: list[StepResult]) -> list[Sequence]:
        """Record computed and accepted tokens; returns the sequences that finished.

        A draft's KV is kept only when it was accepted (and every draft before it); the positions
        of the others are recomputed with the right tokens by the next step."""
        finished = []
        stats = self.stats
        for item, result in zip(batch.seqs, results, strict=True):
            seq = item.seq
            seq.num_computed_tokens = item.end - item.num_draft + result.num_accepted
            stats.prompt_tokens_computed += max(0, min(item.end, seq.prompt_len) - item.start)
            stats.drafts_proposed += item.num_draft
            stats.drafts_accepted += result.num_accepted
            stats.draft_verifications += int(item.num_draft > 0)
            if item.is_decode and result.tokens:
                stats.decode_forwards += 1
                stats.decode_tokens += len(result.tokens)
            if seq.prompt_logprobs is not None:
                seq.prompt_logprobs.extend(result.prompt_logprobs)
            for token, logprobs in result.tokens:
                seq.append(token, logprobs)
                if seq.finish_reason is not None:
                    break
            seq.drafts = result.next_drafts  # kept after a prefill-only finish: PD sends the first on
            if seq.uses_prefix_cache:
                self.kv.commit(seq.token_ids, seq.pages, seq.num_computed_tokens)
            if seq.finish_reason is not None:
                self._finish(seq)
                finished.append(seq)
        return finished

    def _finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self._prefetches.pop(seq.key, None)
        self.kv.release(seq.pages)
        seq.pages = []
        seq.status = SeqStatus.FINISHED
        seq.finish_time = time.monotonic()

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of the request with reason "abort"; their pages are freed."""
        seqs = [s for s in [*self.running, *self.waiting] if s.request_id == request_id]
        for seq in seqs:
            seq.finish_reason = "abort"
            self._finish(seq)
        return seqs
