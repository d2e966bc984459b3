"""MTP drafting: the checkpoint's MTP layer proposes the token after the next one.

The MTP layer keeps its own latent cache (the pool's layer after the decoder layers, on the same
pages). Every valid position of the step writes its latent KV there; attention (the absorbed
decode path) and the FFN run for each sequence's last position only, the one a draft reads.
Position t of that cache holds the layer's KV for (target hidden at t, token t+1), so the
layer runs over exactly the positions whose target KV a step made valid: every prefill chunk,
and after a verification the last token plus the draft when it was accepted. A draft is sampled
with the key the target will use at its position, so a draft distribution close to the target's
draws the same token.

DeepSeek-V4's layer reads the target's last residual streams instead of its final hidden state
(``mtp_input``) and keeps its window in the sequence's state.

With ``num_steps`` > 1, after a decode the layer runs again, once per further draft, at the
position after the last one: its input is the last draft and the layer's own final-normed output
(in place of the target's hidden state, which that position does not have yet). Those runs write
the layer's latent at positions the next step rewrites from the target's hidden states (it runs
over every position it makes valid), so only the drafts survive them. The chunk that ends a prompt
drafts as many (its first decode step verifies them all), except on a PD prefill rank, whose
requests end after one token: it hands on one draft and no run writes past the pages it sends.
``steps_by_batch`` lowers ``num_steps`` from a batch size on, counted over the sequences of the
step that drafts (a verification's cost grows with its rows where a step is compute-bound).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsinfer.cache.kv_pool import PagedKVPool
from dsinfer.cache.v4_pool import V4StatePool
from dsinfer.engine.args import steps_at
from dsinfer.engine.draft_graph import DraftGraphs, DraftRows
from dsinfer.engine.forward import build_forward_batch
from dsinfer.engine.scheduler import ScheduledBatch, StepResult
from dsinfer.model.batch import ForwardBatch
from dsinfer.model.deepseek_v3 import DeepseekV3ForCausalLM
from dsinfer.model.v4_served import ServedV4
from dsinfer.ops import Ops
from dsinfer.ops.sampling import sample_rows


class MTPProposer:
    def __init__(
        self,
        model: DeepseekV3ForCausalLM | ServedV4,
        pool: PagedKVPool | V4StatePool,
        ops: Ops,
        num_steps: int = 1,
        steps_by_batch: tuple[tuple[int, int], ...] = (),
    ) -> None:
        """``num_steps``: drafts a step; ``steps_by_batch``: fewer from a batch size on
        (EngineArgs.speculative_steps_by_batch)."""
        self.model, self.pool, self.ops = model, pool, ops
        self.device = pool.device
        self.num_steps, self.steps_by_batch = num_steps, steps_by_batch

    @property
    def step_counts(self) -> tuple[int, ...]:
        """Every number of drafts a step may propose, increasing."""
        return tuple(sorted({self.num_steps, *(n for _, n in self.steps_by_batch)}))

    def propose(
        self,
        batch: ScheduledBatch,
        hidden: torch.Tensor,
        ends: list[int],
        results: list[StepResult],
        after_layer: Callable[[int], None] | None = None,
        graphs: DraftGraphs | None = None,
        step: ForwardBatch | None = None,
        chain: DraftGraphs | None = None,
    ) -> None:
        """Run the MTP layer over this step's valid positions; set ``next_drafts`` of samplers.
        ``graphs``: the step was a verification replayed from the decode graphs, and the layer
        replays from the draft graphs that follow them. ``step``: the target's forward batch when
        the step ran as one; the layer reuses it (positions, slots, RoPE) when every new token of
        the step is valid (no draft rejected). ``chain``: graphs whose chain graphs replay the
        further drafts (``num_steps`` > 1) that fit them."""
        valid = [
            item.num_new - item.num_draft + result.num_accepted
            for item, result in zip(batch.seqs, results, strict=True)
        ]
        next_tokens = []
        for item, result, n in zip(batch.seqs, results, valid, strict=True):
            # the token after each position: known ones, then the ones this step sampled
            tokens = item.seq.token_ids
            following = tokens[item.start + 1 : item.start + n + 1]
            sampled = item.start + n + 1 - len(tokens)
            following += [token for token, _ in result.tokens[: max(sampled, 0)]]
            next_tokens.extend(following + [0] * (item.num_new - n) if graphs is not None else following)
        if graphs is not None:
            draft_rows = DraftRows(
                next_tokens,
                [s.start for s in batch.seqs],
                valid,
                [s.seq.pages for s in batch.seqs],
                batch.decode_q_len,
            )
            last_hidden = graphs.run(draft_rows)
        else:
            # every valid position writes its latent KV; attention and FFN run at each sequence's last
            whole = step is not None and valid == step.q_lens
            forward = (
                step
                if whole
                else build_forward_batch(
                    batch.seqs, [s.start for s in batch.seqs], valid, 0, self.pool.page_size, self.device
                )
            )
            forward.after_layer = after_layer
            inputs = self.model.mtp_input(hidden)
            if not whole:
                rows = [
                    r
                    for item, end, n in zip(batch.seqs, ends, valid, strict=True)
                    for r in range(end - item.num_new + 1, end - item.num_new + 1 + n)
                ]
                inputs = inputs[torch.tensor(rows, device=self.device)]
            last_hidden = self.model.forward_mtp(
                inputs,
                torch.tensor(next_tokens, device=self.device),
                forward,
                self.pool.caches,
                last_only=True,
            )
        drafting = [i for i, result in enumerate(results) if result.tokens]
        if not drafting:
            return
        if len(drafting) < len(results):
            last_hidden = last_hidden[torch.tensor(drafting, device=self.device)]
        num_steps = steps_at(self.num_steps, self.steps_by_batch, len(batch.seqs))
        if num_steps == 1:
            self._draw(batch, results, drafting, self.model.compute_mtp_logits(last_hidden), 1)
            return
        assert isinstance(self.model, DeepseekV3ForCausalLM)
        normed, logits = self.model.mtp_head(last_hidden)
        self._draw(batch, results, drafting, logits, 1)
        for depth in range(2, num_steps + 1):
            keep = [j for j, i in enumerate(drafting) if batch.seqs[i].chains(depth, len(results[i].tokens))]
            if not keep:
                return
            if len(keep) < len(drafting):
                normed = normed[torch.tensor(keep, device=self.device)]
                drafting = [drafting[j] for j in keep]
            items = [batch.seqs[i] for i in drafting]
            # the position of the last draft: after the step's valid tokens and the drafts before it
            starts = [batch.seqs[i].start + valid[i] + depth - 2 for i in drafting]
            drafts = [results[i].next_drafts[-1] for i in drafting]
            pages = [item.seq.pages for item in items]
            if chain is not None and chain.fits_chain(pages):
                normed, logits = chain.run_chain(drafts, starts, pages, normed)
            else:
                forward = build_forward_batch(
                    items, starts, [1] * len(items), len(items), self.pool.page_size, self.device
                )
                tokens = torch.tensor(drafts, device=self.device)
                out = self.model.forward_mtp(normed, tokens, forward, self.pool.caches, last_only=True)
                normed, logits = self.model.mtp_head(out)
            self._draw(batch, results, drafting, logits, depth)

    def _draw(
        self,
        batch: ScheduledBatch,
        results: list[StepResult],
        drafting: list[int],
        logits: torch.Tensor,
        depth: int,
    ) -> None:
        """Sample draft ``depth`` (1: the first) of each drafting sequence from its draft logits."""
        seqs = [batch.seqs[i].seq for i in drafting]
        tokens = sample_rows(
            self.ops.sample,
            logits,
            [seq.params for seq in seqs],
            seed=[seq.seed for seq in seqs],
            choice=[seq.choice for seq in seqs],
            # the output index the draft would take: after this step's tokens, the next target
            # token and the drafts before it
            position=[
                seq.num_output_tokens + len(results[i].tokens) + depth
                for seq, i in zip(seqs, drafting, strict=True)
            ],
        ).tolist()
        for i, token in zip(drafting, tokens, strict=True):
            results[i].next_drafts.append(token)
