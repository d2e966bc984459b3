"""Scheduled sequences -> tensors -> model -> logits -> sampled tokens (and logprobs).

The runner owns the tensors of a step; it never decides who runs (the scheduler does) and never
changes a sequence (the scheduler records the StepResults).

A sequence carrying an MTP draft computes two positions: its last token and the draft. The target
samples both positions with its own counter-based keys; the draft is accepted when it equals the
target's sample at its position, so output is exactly that of decoding without MTP, greedy or
seeded.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsinfer.base.sampling_params import SamplingParams
from dsinfer.cache.latent_pool import LatentKVPool
from dsinfer.engine.forward import build_forward_batch
from dsinfer.engine.mtp import MTPProposer
from dsinfer.engine.scheduler import ScheduledBatch, ScheduledSeq, StepResult
from dsinfer.model.deepseek_v3 import DeepseekV3ForCausalLM
from dsinfer.ops import Ops, SamplingTensors
from dsinfer.ops.logprobs import prompt_logprobs, top_logprobs
from dsinfer.ops.penalties import apply_penalties, penalty_state

Sample = tuple[int, dict[int, float] | None]


class ModelRunner:
    def __init__(
        self, model: DeepseekV3ForCausalLM, pool: LatentKVPool, ops: Ops, *, mtp: bool = False
    ) -> None:
        self.model, self.pool, self.ops = model, pool, ops
        self.device = pool.caches[0].device
        self.page_size = pool.page_size
        self.mtp = MTPProposer(model, pool, ops) if mtp else None

    def run(
        self, batch: ScheduledBatch, after_layer: Callable[[int], None] | None = None
    ) -> list[StepResult]:
        """One forward over the batch (plus the MTP layer's when speculating). ``after_layer`` is
        called with each cache layer's index as soon as that layer's latent KV is written."""
        if not batch.seqs:
            self.model.idle_forward()  # under expert parallelism the pool's collectives go on
            return []
        forward = build_forward_batch(
            batch.seqs,
            [s.start for s in batch.seqs],
            [s.num_new for s in batch.seqs],
            batch.num_decodes,
            self.page_size,
            self.device,
        )
        forward.after_layer = after_layer
        ids = [t for s in batch.seqs for t in _step_tokens(s)]
        hidden = self.model(torch.tensor(ids, device=self.device), forward, self.pool.caches)
        ends = forward.last_token_indices().tolist()
        results = [StepResult() for _ in batch.seqs]
        samplers = [i for i, s in enumerate(batch.seqs) if s.samples]
        if samplers:
            rows = [r for i in samplers for r in range(ends[i] - batch.seqs[i].num_draft, ends[i] + 1)]
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
            samples = iter(self._sample([batch.seqs[i] for i in samplers], logits))
            for i in samplers:
                item, result = batch.seqs[i], results[i]
                result.tokens.append(next(samples))
                if item.num_draft:
                    bonus = next(samples)
                    result.draft_accepted = result.tokens[0][0] == item.seq.draft
                    if result.draft_accepted:
                        result.tokens.append(bonus)
        self._prompt_logprobs(batch, hidden, ends, results)
        if self.mtp is not None:
            self.mtp.propose(batch, hidden, ends, results, after_layer)
        return results

    def _sample(self, items: list[ScheduledSeq], logits: torch.Tensor) -> list[Sample]:
        """Rows: for each sequence its position(s) to sample, in order (the draft's last)."""
        seqs = [item.seq for item in items for _ in range(1 + item.num_draft)]
        offsets = [j for item in items for j in range(1 + item.num_draft)]
        params = [seq.params for seq in seqs]
        raw = logits
        if any(p.uses_penalties for p in params):
            counts, prompt_mask = penalty_state(
                [seq.token_ids[: seq.prompt_len] for seq in seqs],
                [seq.output_token_ids + [seq.draft] * j for seq, j in zip(seqs, offsets, strict=True)],
                logits.shape[-1],
                self.device,
            )
            logits = apply_penalties(
                logits,
                counts,
                prompt_mask,
                torch.tensor([p.presence_penalty for p in params], device=self.device),
                torch.tensor([p.frequency_penalty for p in params], device=self.device),
                torch.tensor([p.repetition_penalty for p in params], device=self.device),
            )
        if any(p.logit_bias for p in params):
            logits = _apply_logit_bias(logits, params)
        sampling = SamplingTensors.from_params(
            params,
            seed=[seq.seed for seq in seqs],
            choice=[seq.choice for seq in seqs],
            position=[seq.num_output_tokens + j for seq, j in zip(seqs, offsets, strict=True)],
            device=self.device,
        )
        tokens = self.ops.sample(logits, sampling)
        token_list = tokens.tolist()
        logprob_dicts: list[dict[int, float] | None] = [None] * len(seqs)
        want = [p.logprobs for p in params]
        if any(k is not None for k in want):
            lp = top_logprobs(raw, tokens, max(k or 0 for k in want))
            for row, row_k in enumerate(want):
                if row_k is not None:
                    entry = _as_dict(lp.top_ids[row, :row_k], lp.top_logprobs[row, :row_k])
                    entry[token_list[row]] = float(lp.token_logprob[row])
                    logprob_dicts[row] = entry
        return list(zip(token_list, logprob_dicts, strict=True))

    def _prompt_logprobs(
        self, batch: ScheduledBatch, hidden: torch.Tensor, ends: list[int], results: list[StepResult]
    ) -> None:
        for item, end, result in zip(batch.seqs, ends, results, strict=True):
            seq = item.seq
            if seq.prompt_logprobs is None or item.start >= seq.prompt_len - 1:
                continue
            last = min(item.end, seq.prompt_len - 1)  # positions start..last-1 predict prompt tokens
            first_row = end - item.num_new + 1
            rows = torch.arange(first_row, first_row + last - item.start)
            logits = self.model.compute_logits(hidden[rows.to(self.device)])
            next_ids = torch.tensor(seq.token_ids[item.start + 1 : last + 1], device=self.device)
            lp = prompt_logprobs(logits, next_ids, seq.params.prompt_logprobs or 0)
            for j, token in enumerate(next_ids.tolist()):
                entry = _as_dict(lp.top_ids[j], lp.top_logprobs[j])
                entry[token] = float(lp.token_logprob[j])
                result.prompt_logprobs.append(entry)


def _apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """OpenAI's logit_bias, added after the penalties; ids outside the vocabulary are ignored."""
    vocab = logits.shape[-1]
    rows, cols, values = [], [], []
    for row, p in enumerate(params):
        for token, value in (p.logit_bias or {}).items():
            if token < vocab:
                rows.append(row)
                cols.append(token)
                values.append(value)
    logits = logits.clone()
    logits[rows, cols] += torch.tensor(values, dtype=logits.dtype, device=logits.device)
    return logits


def _step_tokens(item: ScheduledSeq) -> list[int]:
    known = item.seq.token_ids[item.start : item.end - item.num_draft]
    return [*known, item.seq.draft] if item.num_draft else known


def _as_dict(ids: torch.Tensor, logprobs: torch.Tensor) -> dict[int, float]:
    return dict(zip(ids.tolist(), logprobs.tolist(), strict=True))
