"""Scheduled sequences -> tensors -> model -> logits -> sampled tokens (and logprobs).

The runner owns the tensors of a step; it never decides who runs (the scheduler does) and never
changes a sequence (the scheduler records the StepResults).

A sequence carrying MTP drafts computes its last token and the drafts. The target samples every
position with its own counter-based keys; a draft is accepted when it equals the target's sample
at its position and every draft before it was accepted, so output is exactly that of decoding
without MTP, greedy or seeded.

With ``enable_overlap`` in an expert-parallel pool, every rank votes in the step's agreement
(dsinfer/engine/agreement.py; idle ranks included) whether it wants two micro-batches and whether
it has a prefill chunk: the pool runs two micro-batches when any rank asks for them, in the
prefill schedule when any rank has a prefill chunk and in the decode schedule otherwise
(dsinfer/model/overlap.py); a rank asks when it holds two sequences or more and at least
``overlap_min_tokens`` tokens. The step's sequences are split, whole and in order, into two parts
of even attention load; a rank with fewer than two sequences runs empty micro-batches where it
has none, so its transfers pair the others'. The MTP layer's forward stays one micro-batch.

On CUDA, unless ``enforce_eager``, decode-only steps (every sequence one new token, or with MTP
every sequence its last token and a draft; no per-layer callback) replay a CUDA graph of the forward
and its logits, padded to a batch-size bucket (dsinfer/engine/cuda_graph.py); prefill and mixed
steps, verification steps where some sequences carry no draft, two-micro-batch steps and
expert-parallel models run eagerly; after a replayed verification the MTP draft layer replays from
its own graphs (dsinfer/engine/draft_graph.py).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
from collections.abc import Callable

import torch

from dsinfer.base.sampling_params import SamplingParams
from dsinfer.base.trace import COMPUTE, Tracer
from dsinfer.cache.kv_pool import PagedKVPool
from dsinfer.engine.agreement import StepVotes
from dsinfer.engine.args import EngineArgs
from dsinfer.engine.constraints import LogitConstraints, PendingMask
from dsinfer.engine.cuda_graph import CudaGraphRunner, DecodeRows, graph_unsupported_reason
from dsinfer.engine.draft_graph import DraftGraphs
from dsinfer.engine.forward import attention_load, balanced_split, build_forward_batch
from dsinfer.engine.mtp import MTPProposer
from dsinfer.engine.scheduler import ScheduledBatch, ScheduledSeq, StepResult
from dsinfer.engine.sequence import Sequence
from dsinfer.model.batch import ForwardBatch
from dsinfer.model.deepseek_v3 import DeepseekV3ForCausalLM
from dsinfer.model.overlap import DECODE, PREFILL, MicroBatch, forward_two
from dsinfer.model.v4_served import ServedV4
from dsinfer.ops import Ops
from dsinfer.ops.logprobs import prompt_logprobs, top_logprobs
from dsinfer.ops.penalties import apply_penalties, penalty_state
from dsinfer.ops.sampling import sample_rows

Sample = tuple[int, dict[int, float] | None]
log = logging.getLogger("dsinfer.engine")


class ModelRunner:
    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        pool: PagedKVPool,
        ops: Ops,
        *,
        mtp: bool = False,
        mtp_steps: int = 1,
        mtp_steps_by_batch: tuple[tuple[int, int], ...] = (),
        enable_overlap: bool = False,
        overlap_min_tokens: int = 64,
        tracer: Tracer | None = None,
        constraints: LogitConstraints | None = None,
    ) -> None:
        self.model, self.pool, self.ops = model, pool, ops
        self.constraints = constraints  # grammars and min_tokens (None: requests have neither)
        self.device = pool.device
        self.page_size = pool.page_size
        self.mtp = MTPProposer(model, pool, ops, mtp_steps, mtp_steps_by_batch) if mtp else None
        self.overlap = enable_overlap and model.ep is not None
        self.overlap_min_tokens = overlap_min_tokens
        self.tracer = tracer
        self.two_micro_batch_steps = {PREFILL: 0, DECODE: 0}  # steps run in each schedule
        self.decode_graphs: CudaGraphRunner | None = None  # set by enable_decode_graphs
        self.draft_graphs: DraftGraphs | None = None  # with MTP, set by enable_decode_graphs

    @classmethod
    def from_args(
        cls,
        model: DeepseekV3ForCausalLM,
        pool: PagedKVPool,
        ops: Ops,
        args: EngineArgs,
        constraints: LogitConstraints | None = None,
    ) -> ModelRunner:
        tracer = None
        if args.trace_dir is not None:
            rank = model.ep.rank if model.ep is not None else 0
            path = args.trace_dir / f"trace-rank{rank}-pid{os.getpid()}.json"
            tracer = Tracer(path, rank, flush_every=args.trace_flush_steps)
        runner = cls(
            model,
            pool,
            ops,
            mtp=args.speculative_mtp,
            mtp_steps=args.speculative_num_steps,
            mtp_steps_by_batch=args.draft_schedule,
            enable_overlap=args.enable_overlap,
            overlap_min_tokens=args.overlap_min_tokens,
            tracer=tracer,
            constraints=constraints,
        )
        if runner.device.type == "cuda" and not args.enforce_eager:
            reason = graph_unsupported_reason(model)
            if reason is not None:
                log.info("CUDA graphs off: %s", reason)
            else:
                runner.enable_decode_graphs(
                    max_batch_size=min(args.cuda_graph_max_bs or args.max_num_seqs, args.max_num_seqs),
                    max_seq_len=args.max_model_len or model.config.max_position_embeddings,
                )
        return runner

    def enable_decode_graphs(
        self, *, max_batch_size: int, max_seq_len: int, capture: bool = True
    ) -> CudaGraphRunner:
        """Run decode-only steps of up to ``max_batch_size`` sequences through static buffers,
        replayed from CUDA graphs (``capture=False``: the same callable run eagerly, for CPU tests);
        with MTP, verification steps of ``1 + num_steps`` tokens per sequence and the draft layer's
        runs too. Reserves the pool's dummy page: call it before sequences hold pages."""
        self.decode_graphs = CudaGraphRunner(
            self.model,
            self.pool,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            capture=capture,
            tokens_per_seq=(1, *(1 + n for n in self.mtp.step_counts)) if self.mtp is not None else (1,),
        )
        if self.mtp is not None:
            self.draft_graphs = DraftGraphs(
                self.decode_graphs, capture=capture, chained=self.mtp.num_steps > 1
            )
        return self.decode_graphs

    def close(self) -> None:
        if self.tracer is not None:
            self.tracer.close()

    def vote(self, batch: ScheduledBatch, votes: StepVotes) -> StepVotes:
        """This rank's votes on the step's size and micro-batches."""
        votes = dataclasses.replace(votes, step_tokens=batch.num_tokens)
        if not self.overlap:
            return votes
        wants = len(batch.seqs) >= 2 and batch.num_tokens >= self.overlap_min_tokens
        prefill = any(not s.is_decode for s in batch.seqs)
        return dataclasses.replace(votes, two_micro_batches=wants, prefill_order=prefill)

    def run(
        self, batch: ScheduledBatch, agreed: StepVotes, after_layer: Callable[[int], None] | None = None
    ) -> list[StepResult]:
        """One forward over the batch (plus the MTP layer's when speculating), as the pool
        ``agreed`` (dsinfer/engine/agreement.py). ``after_layer`` is called with each cache layer's
        index as soon as that layer's latent KV is written."""
        if self.model.ep is not None:
            self.model.ep.group.begin_step(agreed.step_tokens)
        if isinstance(self.model, ServedV4) and self.model.ep is not None and batch.seqs:
            # a peer may die in one of the step's collectives (elastic EP): the step is planned
            # again, so its sequences' V4 states must be as they were
            restore = self.pool.caches.checkpoint(s.seq.key for s in batch.seqs)
            try:
                return self._run_traced(batch, after_layer, agreed)
            except BaseException:
                restore()
                raise
        return self._run_traced(batch, after_layer, agreed)

    def _run_traced(
        self, batch: ScheduledBatch, after_layer: Callable[[int], None] | None, agreed: StepVotes
    ) -> list[StepResult]:
        order = None
        if self.overlap and agreed.two_micro_batches:
            order = PREFILL if agreed.prefill_order else DECODE
        if self.tracer is None:
            return self._run(batch, after_layer, order)
        try:
            prefill_tokens = sum(s.num_new for s in batch.seqs if not s.is_decode)
            with self.tracer.span(
                "STEP", COMPUTE, cat="step", seqs=len(batch.seqs), prefill_tokens=prefill_tokens
            ) as extra:
                results = self._run(batch, after_layer, order)
                extra["tokens_out"] = sum(len(r.tokens) for r in results)
                return results
        finally:
            self.tracer.end_step()

    def _run(
        self, batch: ScheduledBatch, after_layer: Callable[[int], None] | None, order: str | None
    ) -> list[StepResult]:
        if order is not None:
            self.two_micro_batch_steps[order] += 1
        if not batch.seqs:
            # under expert parallelism the pool's collectives go on
            if order is None:
                self.model.idle_forward()
            else:
                self._forward_two(batch, order, None)
                self.model.idle_forward(decoder_layers=False)
            return []
        samplers = [i for i, s in enumerate(batch.seqs) if s.samples]
        masks = self._start_masks([batch.seqs[i] for i in samplers])
        graph_rows = self._graph_rows(batch, after_layer) if order is None else None
        all_logits: torch.Tensor | None = None  # a graph step computes every row's logits
        step: ForwardBatch | None = None  # the eager single batch, which the MTP layer may reuse
        if graph_rows is not None:
            hidden, all_logits = self._forward_graph(graph_rows)
        elif order is None:
            step = self._forward_batch(batch.seqs, batch.num_decodes)
            hidden = self._forward_one(batch, step, after_layer)
        else:
            hidden = self._forward_two(batch, order, after_layer)
        ends = [n - 1 for n in itertools.accumulate(s.num_new for s in batch.seqs)]
        results = [StepResult() for _ in batch.seqs]
        if samplers:
            rows = [r for i in samplers for r in range(ends[i] - batch.seqs[i].num_draft, ends[i] + 1)]
            index = torch.tensor(rows, device=self.device)
            logits = all_logits[index] if all_logits is not None else self.model.compute_logits(hidden[index])
            samples = iter(self._sample([batch.seqs[i] for i in samplers], logits, masks))
            for i in samplers:
                item, result = batch.seqs[i], results[i]
                sampled = [next(samples) for _ in range(1 + item.num_draft)]
                result.tokens.append(sampled[0])
                drafts = item.seq.drafts[: item.num_draft]
                for draft, (token, _), bonus in zip(drafts, sampled[:-1], sampled[1:], strict=True):
                    if token != draft:
                        break
                    result.num_accepted += 1
                    result.tokens.append(bonus)
        self._prompt_logprobs(batch, hidden, ends, results)
        if self.mtp is not None and isinstance(self.model, ServedV4):
            verified = [
                (item.seq.key, r.num_accepted == 1)
                for item, r in zip(batch.seqs, results, strict=True)
                if item.num_draft
            ]
            if verified:
                keys, accepted = zip(*verified, strict=True)
                self.model.settle_drafts(list(keys), list(accepted), self.pool.caches)
        if self.mtp is not None:
            draft = self.draft_graphs if graph_rows is not None and graph_rows.q_len > 1 else None
            chain = self.draft_graphs if after_layer is None else None
            if self.tracer is None:
                self.mtp.propose(batch, hidden, ends, results, after_layer, draft, step, chain)
            else:
                with self.tracer.span("MTP_DRAFT", COMPUTE, cat="mtp", cuda_graph=draft is not None):
                    self.mtp.propose(batch, hidden, ends, results, after_layer, draft, step, chain)
        return results

    def _forward_one(
        self, batch: ScheduledBatch, forward: ForwardBatch, after_layer: Callable[[int], None] | None
    ) -> torch.Tensor:
        forward.after_layer = after_layer
        ids = torch.tensor([t for s in batch.seqs for t in _step_tokens(s)], device=self.device)
        if self.tracer is None:
            return self.model(ids, forward, self.pool.caches)
        with self.tracer.span("FORWARD", COMPUTE, cat="forward", micro_batches=1, tokens=[len(ids)]):
            return self.model(ids, forward, self.pool.caches)

    def _graph_rows(
        self, batch: ScheduledBatch, after_layer: Callable[[int], None] | None
    ) -> DecodeRows | None:
        """The step as graph rows when it can replay: decode-only, the same number of new tokens in
        every sequence (one; two when each verifies a draft), no callback."""
        graphs = self.decode_graphs
        if graphs is None or after_layer is not None or not batch.seqs:
            return None
        q = batch.decode_q_len
        if batch.num_decodes != len(batch.seqs) or any(s.num_new != q for s in batch.seqs):
            return None  # prefill chunks, or a verification where some sequences have no draft
        rows = DecodeRows(
            input_ids=[t for s in batch.seqs for t in _step_tokens(s)],
            positions=[s.start for s in batch.seqs],
            page_lists=[s.seq.pages for s in batch.seqs],
            q_len=q,
        )
        return rows if graphs.fits(rows) else None

    def _forward_graph(self, rows: DecodeRows) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.decode_graphs is not None
        if self.tracer is None:
            return self.decode_graphs.run(rows)
        bucket = self.decode_graphs.bucket_for(len(rows))
        with self.tracer.span(
            "FORWARD", COMPUTE, cat="forward", micro_batches=1, tokens=[len(rows)], cuda_graph=bucket
        ):
            return self.decode_graphs.run(rows)

    def _forward_two(
        self, batch: ScheduledBatch, order: str, after_layer: Callable[[int], None] | None
    ) -> torch.Tensor:
        """Both micro-batches through the decoder layers -> the final-normed hidden states [T, H]."""
        seqs, n = batch.seqs, len(batch.seqs)
        k = balanced_split([attention_load(s) for s in seqs]) if n >= 2 else n
        absorbed_first = max(0, k - (n - batch.num_decodes))  # decodes come last in a batch
        parts = ((seqs[:k], absorbed_first), (seqs[k:], batch.num_decodes - absorbed_first))
        mbs = (self._micro_batch(*parts[0]), self._micro_batch(*parts[1]))
        run = (
            self.model.forward_two
            if isinstance(self.model, ServedV4)
            else functools.partial(forward_two, self.model)
        )
        if self.tracer is None:
            run(mbs, self.pool.caches, order, after_layer=after_layer)
        else:
            tokens = [len(mb.input_ids) for mb in mbs]
            with self.tracer.span(
                "FORWARD", COMPUTE, cat="forward", micro_batches=2, order=order, tokens=tokens
            ):
                run(mbs, self.pool.caches, order, tracer=self.tracer, after_layer=after_layer)
        return torch.cat([mb.hidden for mb in mbs if mb.hidden is not None])

    def _micro_batch(self, seqs: list[ScheduledSeq], num_absorbed: int) -> MicroBatch:
        ids = torch.tensor([t for s in seqs for t in _step_tokens(s)], dtype=torch.int64, device=self.device)
        return MicroBatch(ids, self._forward_batch(seqs, num_absorbed) if seqs else None)

    def _forward_batch(self, seqs: list[ScheduledSeq], num_absorbed: int) -> ForwardBatch:
        return build_forward_batch(
            seqs,
            [s.start for s in seqs],
            [s.num_new for s in seqs],
            num_absorbed,
            self.page_size,
            self.device,
        )

    def _start_masks(self, items: list[ScheduledSeq]) -> PendingMask | None:
        """The grammar masks of the step's sampling rows, begun before the forward."""
        if self.constraints is None or not any(item.seq.params.grammar is not None for item in items):
            return None
        return self.constraints.start(*_sampling_rows(items))

    def _sample(
        self, items: list[ScheduledSeq], logits: torch.Tensor, masks: PendingMask | None = None
    ) -> list[Sample]:
        """Rows: for each sequence its position(s) to sample, in order (the draft's last)."""
        seqs, offsets = _sampling_rows(items)
        params = [seq.params for seq in seqs]
        raw = logits
        if any(p.uses_penalties for p in params):
            counts, prompt_mask = penalty_state(
                [seq.token_ids[: seq.prompt_len] for seq in seqs],
                [seq.output_token_ids + seq.drafts[:j] for seq, j in zip(seqs, offsets, strict=True)],
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
        if self.constraints is not None:
            logits = self.constraints.apply(seqs, offsets, logits, masks)
        tokens = sample_rows(
            self.ops.sample,
            logits,
            params,
            seed=[seq.seed for seq in seqs],
            choice=[seq.choice for seq in seqs],
            position=[seq.num_output_tokens + j for seq, j in zip(seqs, offsets, strict=True)],
        )
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


def _sampling_rows(items: list[ScheduledSeq]) -> tuple[list[Sequence], list[int]]:
    """Each sampling row's sequence and output offset (j: the row after its j-th MTP draft)."""
    seqs = [item.seq for item in items for _ in range(1 + item.num_draft)]
    offsets = [j for item in items for j in range(1 + item.num_draft)]
    return seqs, offsets


def _step_tokens(item: ScheduledSeq) -> list[int]:
    known = item.seq.token_ids[item.start : item.end - item.num_draft]
    return [*known, *item.seq.drafts[: item.num_draft]]


def _as_dict(ids: torch.Tensor, logprobs: torch.Tensor) -> dict[int, float]:
    return dict(zip(ids.tolist(), logprobs.tolist(), strict=True))
