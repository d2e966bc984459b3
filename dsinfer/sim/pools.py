"""State of one simulated pool: per-rank queues, what a step takes, what a rank reports.

Prefill: each rank keeps a FIFO of prompts; a step takes up to ``max_num_batched_tokens`` new
tokens (and ``max_num_seqs`` sequences) per rank from the head of its queue, splitting the last
prompt it reaches (chunked prefill), as dsinfer.engine.scheduler does. With
``attention_token_weight`` set (the scheduler's attention-aware chunking) the budget counts a
chunk's cost in new-token equivalents instead (:func:`prefill_chunk_cost`: its tokens, its core
attention, the decompression of its cached context), so a long-context continuation is cut into
short chunks and no rank's step is stretched by it. The two functions below are the scheduler's
rule (the simulator may not import the engine; tests/test_sim_chunking.py holds them equal).

Decode: each rank admits requests whose KV has arrived while it has a sequence slot and its KV
pages stay below ``1 - kv_growth_headroom`` of the total;
running requests grow by one page every 64 tokens; a rank out of pages preempts its newest
request back to the head of its waiting queue (DeepSeek-style recompute; the recompute's own cost
is not modelled, the count is reported).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from dsinfer.base.chunking import fit_prefill_chunk, prefill_chunk_cost
from dsinfer.base.protocol import LoadReport
from dsinfer.sim.cost import PoolModel, StepCost, decode_step, prefill_step
from dsinfer.sim.deployment import PoolSpec

INCARNATION = "sim"


@dataclass
class _Prompt:
    req: int
    prompt: int
    remaining: int  # new tokens still to compute
    done: int  # tokens already in the KV cache (cached prefix + computed chunks)


@dataclass(frozen=True)
class PrefillBatch:
    tokens: np.ndarray
    ctx_tokens: np.ndarray
    pairs: np.ndarray
    key_len: np.ndarray
    finishing: list[list[int]]  # per rank, requests whose last chunk is in this step


class PrefillPool:
    def __init__(self, index: int, spec: PoolSpec, model: PoolModel) -> None:
        self.index, self.spec, self.model = index, spec, model
        self.names = [f"prefill/{index}/{r}" for r in range(spec.pool_size)]
        self.queues: list[deque[_Prompt]] = [deque() for _ in range(spec.pool_size)]
        self.busy = False
        self.current: PrefillBatch | None = None  # the step in flight

    def add(self, rank: int, req: int, prompt: int, cached: int) -> None:
        self.queues[rank].append(_Prompt(req, prompt, prompt - cached, cached))

    def has_work(self) -> bool:
        return any(self.queues)

    def take(self) -> PrefillBatch:
        ranks = self.spec.pool_size
        tokens, ctx, pairs, weighted = (np.zeros(ranks) for _ in range(4))
        finishing: list[list[int]] = [[] for _ in range(ranks)]
        for r, queue in enumerate(self.queues):
            budget: float = self.spec.max_num_batched_tokens
            seqs = self.spec.max_num_seqs
            while queue and budget > 0 and seqs > 0:
                head = queue[0]
                chunk = self._chunk(head.done, head.remaining, budget, first=seqs == self.spec.max_num_seqs)
                if chunk == 0:
                    break
                budget -= self._cost(head.done, chunk)
                p = chunk * head.done + chunk * (chunk + 1) / 2
                tokens[r] += chunk
                ctx[r] += head.done + chunk
                pairs[r] += p
                weighted[r] += p * (head.done + chunk)
                seqs -= 1
                if chunk == head.remaining:
                    finishing[r].append(head.req)
                    queue.popleft()
                else:
                    head.remaining -= chunk
                    head.done += chunk
        key_len = np.where(pairs > 0, weighted / np.maximum(pairs, 1), 1.0)
        return PrefillBatch(tokens, ctx, pairs, key_len, finishing)

    def _chunk(self, start: int, remaining: int, budget: float, first: bool) -> int:
        w = self.spec.attention_token_weight
        if w is None or remaining <= 1:
            return int(min(remaining, budget))
        return fit_prefill_chunk(start, remaining, budget, w, self.spec.context_token_weight, first)

    def _cost(self, start: int, chunk: int) -> float:
        w = self.spec.attention_token_weight
        if w is None or chunk <= 1:
            return chunk
        return prefill_chunk_cost(start, chunk, w, self.spec.context_token_weight)

    def cost(self, batch: PrefillBatch, rng: np.random.Generator) -> StepCost:
        finishing = np.array([len(f) for f in batch.finishing], dtype=np.float64)
        return prefill_step(
            self.model, batch.tokens, batch.ctx_tokens, batch.pairs, batch.key_len, finishing, rng
        )

    def reports(self) -> list[LoadReport]:
        out = []
        for name, queue in zip(self.names, self.queues, strict=True):
            out.append(
                LoadReport(
                    worker=name,
                    incarnation=INCARNATION,
                    num_waiting=len(queue),
                    pending_prefill_tokens=sum(p.remaining for p in queue),
                    pending_attention_load=sum(p.remaining * p.prompt for p in queue),
                )
            )
        return out


class DecodePool:
    def __init__(self, index: int, spec: PoolSpec, model: PoolModel, kv_tokens: int, headroom: float) -> None:
        self.index, self.spec, self.model = index, spec, model
        ranks = spec.pool_size
        self.names = [f"decode/{index}/{r}" for r in range(ranks)]
        self.page = model.shape.page_tokens
        self.total_pages = max(1, kv_tokens // self.page)
        self.admit_pages = int(self.total_pages * (1.0 - headroom))
        self.waiting: list[deque[int]] = [deque() for _ in range(ranks)]
        size = 1024
        self.req = np.zeros(size, dtype=np.int64)
        self.rank = np.zeros(size, dtype=np.int64)
        self.ctx = np.zeros(size, dtype=np.int64)
        self.remaining = np.zeros(size, dtype=np.int64)
        self.admitted = np.zeros(size, dtype=np.float64)
        self.active = np.zeros(size, dtype=bool)
        self.slot_of: dict[int, int] = {}
        self.free: list[int] = list(range(size - 1, -1, -1))
        self.busy = False
        self.step_started = 0.0
        self.step_present = 0  # requests in decode (running or waiting) when the step started
        self.preemptions = 0
        self.step_slots = np.zeros(0, dtype=np.int64)
        # per-request state the pool needs at admission
        self.pending: dict[int, tuple[int, int]] = {}  # req -> (context, remaining tokens)

    # bookkeeping ------------------------------------------------------------------------------
    def _grow(self) -> None:
        old = len(self.req)
        for name in ("req", "rank", "ctx", "remaining", "admitted", "active"):
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.zeros_like(a)]))
        self.free.extend(range(2 * old - 1, old - 1, -1))

    def enqueue(self, rank: int, req: int, context: int, remaining: int, front: bool = False) -> None:
        self.pending[req] = (context, remaining)
        (self.waiting[rank].appendleft if front else self.waiting[rank].append)(req)

    def num_waiting(self) -> int:
        return sum(len(w) for w in self.waiting)

    def num_active(self) -> int:
        return int(self.active.sum())

    def has_work(self) -> bool:
        return bool(self.active.any()) or any(self.waiting)

    def _per_rank(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        idx = np.flatnonzero(self.active)
        ranks = self.spec.pool_size
        count = np.bincount(self.rank[idx], minlength=ranks)
        kv = np.bincount(self.rank[idx], weights=self.ctx[idx], minlength=ranks)
        pages = np.bincount(self.rank[idx], weights=-(-self.ctx[idx] // self.page), minlength=ranks)
        return idx, count, kv, pages

    # steps ------------------------------------------------------------------------------------
    def admit(self, now: float) -> None:
        _, count, _, pages = self._per_rank()
        for r, queue in enumerate(self.waiting):
            while queue and count[r] < self.spec.max_num_seqs:
                req = queue[0]
                context, remaining = self.pending[req]
                need = -(-(context + 1) // self.page)
                if pages[r] + need > self.admit_pages and count[r] > 0:
                    break
                queue.popleft()
                del self.pending[req]
                if not self.free:
                    self._grow()
                slot = self.free.pop()
                self.req[slot], self.rank[slot], self.ctx[slot] = req, r, context
                self.remaining[slot], self.admitted[slot], self.active[slot] = remaining, now, True
                self.slot_of[req] = slot
                count[r] += 1
                pages[r] += need

    def start_step(self, rng: np.random.Generator) -> StepCost:
        idx, count, kv, _ = self._per_rank()
        self.step_slots = idx
        return decode_step(self.model, count, kv, rng)

    def finish_step(self, accept: float, rng: np.random.Generator) -> tuple[int, list[int]]:
        """Apply the step's tokens; -> (tokens produced, requests finished)."""
        idx = self.step_slots
        if idx.size == 0:
            return 0, []
        tokens = np.ones(idx.size, dtype=np.int64)
        if self.model.mtp:
            tokens += rng.random(idx.size) < accept
        tokens = np.minimum(tokens, self.remaining[idx])
        self.ctx[idx] += tokens
        self.remaining[idx] -= tokens
        done = idx[self.remaining[idx] <= 0]
        finished = [int(x) for x in self.req[done]]
        for slot, req in zip(done.tolist(), finished, strict=True):
            self.active[slot] = False
            del self.slot_of[req]
            self.free.append(slot)
        self._preempt_overflow()
        return int(tokens.sum()), finished

    def _preempt_overflow(self) -> None:
        idx, _, _, pages = self._per_rank()
        for r in np.flatnonzero(pages > self.total_pages):
            mine = idx[self.rank[idx] == r]
            order = mine[np.argsort(-self.admitted[mine], kind="stable")]
            over = pages[r] - self.total_pages
            for slot in order:
                if over <= 0:
                    break
                self.active[slot] = False
                req = int(self.req[slot])
                del self.slot_of[req]
                self.free.append(int(slot))
                over -= -(-int(self.ctx[slot]) // self.page)
                self.enqueue(int(r), req, int(self.ctx[slot]), int(self.remaining[slot]), front=True)
                self.preemptions += 1

    def reports(self) -> list[LoadReport]:
        _, count, _, pages = self._per_rank()
        out = []
        for r, name in enumerate(self.names):
            out.append(
                LoadReport(
                    worker=name,
                    incarnation=INCARNATION,
                    num_running=int(count[r]),
                    num_waiting=len(self.waiting[r]),
                    kv_pages_used=int(pages[r]),
                    kv_pages_total=self.total_pages,
                )
            )
        return out
