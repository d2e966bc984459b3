"""Scheduled sequences -> tensors -> model -> logits -> sampled tokens (and logprobs).

The runner owns the tensors of a step; it never decides who runs (the scheduler does).
"""

from __future__ import annotations

import torch

from dsinfer.cache.latent_pool import LatentKVPool
from dsinfer.engine.scheduler import ScheduledBatch, ScheduledSeq
from dsinfer.model.batch import ForwardBatch
from dsinfer.model.deepseek_v3 import DeepseekV3ForCausalLM
from dsinfer.ops import Ops, SamplingTensors
from dsinfer.ops.logprobs import prompt_logprobs, top_logprobs
from dsinfer.ops.penalties import apply_penalties, penalty_state

Sample = tuple[int, dict[int, float] | None]


class ModelRunner:
    def __init__(self, model: DeepseekV3ForCausalLM, pool: LatentKVPool, ops: Ops) -> None:
        self.model, self.pool, self.ops = model, pool, ops
        self.device = pool.caches[0].device
        self.page_size = pool.page_size

    def run(self, batch: ScheduledBatch) -> list[Sample | None]:
        """One forward over the batch; a token (with logprobs if asked) per sampling sequence."""
        if not batch.seqs:
            return []
        forward = self._forward_batch(batch)
        ids = [t for s in batch.seqs for t in s.seq.token_ids[s.start : s.end]]
        hidden = self.model(torch.tensor(ids, device=self.device), forward, self.pool.caches)
        ends = forward.last_token_indices()
        samplers = [i for i, s in enumerate(batch.seqs) if s.samples]
        results: list[Sample | None] = [None] * len(batch.seqs)
        if samplers:
            logits = self.model.compute_logits(hidden[ends[samplers]])
            for i, sample in zip(
                samplers, self._sample([batch.seqs[i] for i in samplers], logits), strict=True
            ):
                results[i] = sample
        self._prompt_logprobs(batch, hidden, ends)
        return results

    def _forward_batch(self, batch: ScheduledBatch) -> ForwardBatch:
        positions, slots = [], []
        ps = self.page_size
        for s in batch.seqs:
            pages = s.seq.pages
            positions.extend(range(s.start, s.end))
            slots.extend(pages[p // ps] * ps + p % ps for p in range(s.start, s.end))
        width = max(len(s.seq.pages) for s in batch.seqs)
        table = torch.zeros(len(batch.seqs), width, dtype=torch.int32)
        for row, s in enumerate(batch.seqs):
            table[row, : len(s.seq.pages)] = torch.tensor(s.seq.pages, dtype=torch.int32)
        return ForwardBatch(
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            block_tables=table.to(self.device),
            q_lens=[s.num_new for s in batch.seqs],
            kv_lens=[s.end for s in batch.seqs],
            num_absorbed=batch.num_decodes,
        )

    def _sample(self, items: list[ScheduledSeq], logits: torch.Tensor) -> list[Sample]:
        seqs = [s.seq for s in items]
        params = [seq.params for seq in seqs]
        want = [p.logprobs for p in params]
        raw = logits
        if any(p.uses_penalties for p in params):
            counts, prompt_mask = penalty_state(
                [seq.token_ids[: seq.prompt_len] for seq in seqs],
                [seq.output_token_ids for seq in seqs],
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
        sampling = SamplingTensors.from_params(
            params,
            seed=[seq.seed for seq in seqs],
            choice=[seq.choice for seq in seqs],
            position=[seq.num_output_tokens for seq in seqs],
            device=self.device,
        )
        tokens = self.ops.sample(logits, sampling)
        token_list = tokens.tolist()
        logprob_dicts: list[dict[int, float] | None] = [None] * len(seqs)
        if any(k is not None for k in want):
            k = max(k or 0 for k in want)
            lp = top_logprobs(raw, tokens, k)
            for row, row_k in enumerate(want):
                if row_k is not None:
                    logprob_dicts[row] = _as_dict(lp.top_ids[row, :row_k], lp.top_logprobs[row, :row_k])
                    logprob_dicts[row][token_list[row]] = float(lp.token_logprob[row])
        return list(zip(token_list, logprob_dicts, strict=True))

    def _prompt_logprobs(self, batch: ScheduledBatch, hidden: torch.Tensor, ends: torch.Tensor) -> None:
        for item, end in zip(batch.seqs, ends.tolist(), strict=True):
            seq = item.seq
            if seq.prompt_logprobs is None or item.start >= seq.prompt_len - 1:
                continue
            last = min(item.end, seq.prompt_len - 1)  # positions start..last-1 predict prompt tokens
            first_row = end - item.num_new + 1
            rows = torch.arange(first_row, first_row + last - item.start)
            logits = self.model.compute_logits(hidden[rows.to(self.device)])
            next_ids = torch.tensor(seq.token_ids[item.start + 1 : last + 1], device=self.device)
            k = seq.params.prompt_logprobs or 0
            lp = prompt_logprobs(logits, next_ids, k)
            for j, token in enumerate(next_ids.tolist()):
                entry = _as_dict(lp.top_ids[j], lp.top_logprobs[j])
                entry[token] = float(lp.token_logprob[j])
                seq.prompt_logprobs.append(entry)


def _as_dict(ids: torch.Tensor, logprobs: torch.Tensor) -> dict[int, float]:
    return dict(zip(ids.tolist(), logprobs.tolist(), strict=True))
