"""MTP drafting: the checkpoint's MTP layer proposes the token after the next one.

The MTP layer keeps its own latent cache (the pool's layer after the decoder layers, on the same
pages). Its attention takes the absorbed decode path for the rows that decode in the target's step
(one valid position, or two after an accepted draft), the decompressed path for prefill chunks.
Position t of that cache holds the layer's KV for (target hidden at t, token t+1), so the
layer runs over exactly the positions whose target KV a step made valid: every prefill chunk,
and after a verification the last token plus the draft when it was accepted. A draft is sampled
with the key the target will use at its position, so a draft distribution close to the target's
draws the same token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsinfer.cache.kv_pool import PagedKVPool
from dsinfer.engine.forward import build_forward_batch
from dsinfer.engine.scheduler import ScheduledBatch, StepResult
from dsinfer.model.deepseek_v3 import DeepseekV3ForCausalLM
from dsinfer.ops import Ops, SamplingTensors


class MTPProposer:
    def __init__(self, model: DeepseekV3ForCausalLM, pool: PagedKVPool, ops: Ops) -> None:
        self.model, self.pool, self.ops = model, pool, ops
        self.device = pool.device

    def propose(
        self,
        batch: ScheduledBatch,
        hidden: torch.Tensor,
        ends: list[int],
        results: list[StepResult],
        after_layer: Callable[[int], None] | None = None,
    ) -> None:
        """Run the MTP layer over this step's valid positions; set ``next_draft`` of samplers."""
        valid = [
            item.num_new - item.num_draft + int(result.draft_accepted)
            for item, result in zip(batch.seqs, results, strict=True)
        ]
        # the rows that decode in the target's step take the absorbed path, and go last
        absorbed = [item.is_decode for item in batch.seqs]
        order = sorted(range(len(batch.seqs)), key=lambda i: absorbed[i])
        num_absorbed = sum(absorbed)
        items = [batch.seqs[i] for i in order]
        forward = build_forward_batch(
            items,
            [s.start for s in items],
            [valid[i] for i in order],
            num_absorbed,
            self.pool.page_size,
            self.device,
        )
        forward.after_layer = after_layer
        rows, next_tokens = [], []
        for i in order:
            item, result = batch.seqs[i], results[i]
            first_row = ends[i] - item.num_new + 1
            rows.extend(range(first_row, first_row + valid[i]))
            extended = item.seq.token_ids + [token for token, _ in result.tokens]
            next_tokens.extend(extended[item.start + 1 : item.start + valid[i] + 1])
        mtp_hidden = self.model.forward_mtp(
            hidden[torch.tensor(rows, device=self.device)],
            torch.tensor(next_tokens, device=self.device),
            forward,
            self.pool.caches,
        )
        last_rows = forward.last_token_indices().tolist()
        drafting = [(k, i) for k, i in enumerate(order) if results[i].tokens]
        if not drafting:
            return
        logits = self.model.compute_mtp_logits(mtp_hidden[torch.tensor([last_rows[k] for k, _ in drafting])])
        seqs = [batch.seqs[i].seq for _, i in drafting]
        sampling = SamplingTensors.from_params(
            [seq.params for seq in seqs],
            seed=[seq.seed for seq in seqs],
            choice=[seq.choice for seq in seqs],
            # the output index the draft would take: after this step's tokens and the next target token
            position=[
                seq.num_output_tokens + len(results[i].tokens) + 1
                for seq, (_, i) in zip(seqs, drafting, strict=True)
            ],
            device=self.device,
        )
        for (_, i), token in zip(drafting, self.ops.sample(logits, sampling).tolist(), strict=True):
            results[i].next_draft = token
