"""LLMEngine: requests in, finished completions out, one scheduled forward per step.

What the workers drive is its façade, :class:`dsinfer.engine.facade.EngineFacade` (import-linter
keeps them off the scheduler, the sequences, the cache and the model); the offline ``LLM`` and the
CLI also use ``step`` and ``stats_line``. The engine knows no wire protocol and no KV connector:
it returns its own records (dsinfer/engine/step.py) and the workers map them to messages.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dsinfer.base.kv_groups import V4_PAGE_TOKENS
from dsinfer.base.kv_spec import KVCacheSpec
from dsinfer.base.sampling_params import SamplingParams
from dsinfer.base.tokenizer import Tokenizer
from dsinfer.base.v4_config import V4Config
from dsinfer.cache.disk_tier import DiskKVTier
from dsinfer.cache.host_tier import HostKVTier
from dsinfer.cache.kv_manager import KVCacheManager
from dsinfer.cache.kv_pool import PagedKVPool
from dsinfer.cache.v4_pool import V4StatePool
from dsinfer.engine.agreement import AllReduceMax, StepVotes, agree
from dsinfer.engine.args import EngineArgs
from dsinfer.engine.constraints import LogitConstraints
from dsinfer.engine.device import bind_device, free_memory, model_identity, resolve_device, resolve_dtype
from dsinfer.engine.expert_balancer import OnlineExpertBalancer
from dsinfer.engine.kv_pages import KVPages
from dsinfer.engine.membership import PoolMembership
from dsinfer.engine.model_runner import ModelRunner
from dsinfer.engine.outputs import RequestOutput
from dsinfer.engine.remote import RemotePrefills
from dsinfer.engine.requests import RequestTable
from dsinfer.engine.scheduler import ScheduledBatch, Scheduler, SchedulerStats
from dsinfer.engine.sequence_factory import SequenceFactory
from dsinfer.engine.step import EngineLoad, LayerHookFor, SeqUpdate, StepPlan
from dsinfer.engine.v4_expert_balancer import V4ExpertBalancer
from dsinfer.model.loader import load_model
from dsinfer.model.moe import MoE
from dsinfer.model.v4_experts import V4ExpertSource
from dsinfer.model.v4_moe import V4MoE
from dsinfer.ops import compile_ahead, select_ops
from dsinfer.parallel.ep import EPGroup, all_reduce_in_place
from dsinfer.parallel.placement import ExpertPlacement

log = logging.getLogger("dsinfer.engine")
IDLE_LOAD_WAIT = 0.05  # seconds a rank alone waits for a tier load when it has nothing to run


class LLMEngine:
    def __init__(
        self,
        args: EngineArgs,
        ep_group: EPGroup | None = None,
        agreement_group: dist.ProcessGroup | None = None,
        placement: ExpertPlacement | None = None,
    ) -> None:
        """``ep_group``: this rank's expert-parallel group (a pool of several ranks); every rank
        of it must step together (an idle rank runs an empty forward). ``agreement_group``: the
        group the per-step agreement is all-reduced over (a gloo group beside an NCCL one keeps
        it on the host); None: ``ep_group`` itself. ``placement``: the expert placement over
        ``ep_group`` (else ``args.placement``'s file, else the default layout)."""
        self.args = args
        device = resolve_device(args.device)
        bind_device(device)
        dtype = resolve_dtype(args.dtype, device)
        draft_dtype = (
            dtype
            if args.speculative_draft_dtype == "auto"
            else resolve_dtype(args.speculative_draft_dtype, device)
        )
        if ep_group is not None:
            args.check_expert_parallel(draft_differs=draft_dtype != dtype)
        self.ops = select_ops(device, prefer=args.kernel_backends)
        loaded = load_model(
            args.model,
            self.ops,
            device=device,
            dtype=dtype,
            load_format=args.load_format,
            num_mtp_layers=1 if args.speculative_mtp else 0,
            seed=args.seed,
            ep_group=ep_group,
            placement=placement
            or (ExpertPlacement.load(args.placement) if args.placement is not None else None),
            num_redundant_experts=args.num_redundant_experts,
            draft_dtype=draft_dtype,
        )
        self.config, self.model = loaded.config, loaded.model
        balancer = V4ExpertBalancer if isinstance(loaded.experts, V4ExpertSource) else OnlineExpertBalancer
        self.expert_balancer = (
            balancer(
                self.model,
                loaded.experts,
                interval=args.eplb_interval,
                min_gain=args.eplb_min_gain,
                stage_budget=args.eplb_stage_budget,
            )
            if ep_group is not None and loaded.experts is not None
            else None
        )  # online EPLB (--eplb-interval); V3's also moves experts when a pool's membership changes
        self.tokenizer = Tokenizer.from_dir(loaded.path)
        self.max_model_len = args.max_model_len or self.config.max_position_embeddings
        if self.max_model_len > self.config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"{self.config.max_position_embeddings}"
            )
        v4 = isinstance(self.config, V4Config)
        if v4 and args.speculative_num_steps > 1:
            raise ValueError(
                "speculative_num_steps > 1 is not supported for DeepSeek-V4 (its MTP layer's window "
                "state settles one draft a step): use 1"
            )
        pool = self._make_v4_pool(device, dtype) if v4 else self._make_pool(device, dtype)
        root = model_identity(loaded.path, loaded.load_format, args.seed, dtype, device, draft_dtype)
        self.model_identity = root.hex()  # servers refuse to mix workers of different models
        disk = None
        if args.kv_disk_cache_dir is not None:
            disk = DiskKVTier(
                Path(args.kv_disk_cache_dir),
                capacity_bytes=args.kv_disk_cache_size,
                root=root,
                page_layout=pool.page_record_layout,
                page_bytes=pool.page_record_bytes,
            )
        hooks = (
            {"resumable": pool.caches.resumable, "on_allocate": pool.caches.forget}
            if isinstance(pool, V4StatePool)
            else {}
        )
        self.kv = KVCacheManager(
            pool,
            root=root,
            enable_prefix_cache=args.enable_prefix_caching,
            disk=disk,
            host=self._make_host_tier(pool, device),
            **hooks,
        )
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            attention_token_weight=args.prefill_attention_weight,
            context_token_weight=args.prefill_context_weight,
            max_drafts=args.speculative_num_steps,
        )
        self.eos_ids = frozenset(self.config.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)
        self.constraints = LogitConstraints(self.tokenizer, self.config.vocab_size, sorted(self.eos_ids))
        self.runner = ModelRunner.from_args(self.model, pool, self.ops, args, self.constraints)
        self._sequences = SequenceFactory(
            self.config.vocab_size,
            self.max_model_len,
            self.eos_ids,
            self.tokenizer,
            self.scheduler.check_fits,
            self.constraints.check,
            random.Random(args.seed),
        )
        self._requests = RequestTable(self.tokenizer)
        self._all_reduce_max: AllReduceMax | None = None
        self._set_agreement(ep_group, agreement_group)
        self.kv_pages = KVPages(self.kv)  # what a transfer library registers and a connector holds
        self.remote = RemotePrefills(
            self._sequences, self.scheduler, self._requests, self.kv.page_size, args.speculative_mtp
        )  # requests whose prompt KV another rank writes (a connector's decode side)
        self.membership = PoolMembership(self.model, self.expert_balancer, self._set_agreement)

    def _set_agreement(self, ep_group: EPGroup | None, agreement_group: dist.ProcessGroup | None) -> None:
        if agreement_group is not None:
            self._all_reduce_max = lambda t: all_reduce_in_place(t, "max", agreement_group)
        elif ep_group is not None:
            self._all_reduce_max = lambda t: ep_group.all_reduce(t, "max")

    def _make_pool(self, device: torch.device, dtype: torch.dtype) -> PagedKVPool:
        layers = self.model.num_cache_layers
        indexer = self.args.indexer_format_for(device.type)
        spec = KVCacheSpec.for_model(self.config, str(dtype).removeprefix("torch."), indexer)
        budget, how = self.args.kv_cache_memory, "--kv-cache-memory"
        if budget is None:
            budget, how = self.args.default_kv_budget(
                page_bytes=PagedKVPool.page_bytes_for(spec, layers),
                page_size=spec.page_size,
                max_model_len=self.max_model_len,
                free=free_memory(device),
                device_type=device.type,
            )
        num_pages = PagedKVPool.num_pages_for_budget(spec, layers, budget)
        page_bytes = PagedKVPool.page_bytes_for(spec, layers)
        if num_pages < 1:
            raise ValueError(f"kv_cache_memory {budget} bytes holds no page ({page_bytes} bytes per page)")
        log.info(
            "KV cache: %d pages x %d tokens (%.1f MiB, %d layers x %s per token: %d bytes; %s)",
            num_pages,
            spec.page_size,
            num_pages * page_bytes / 2**20,
            layers,
            spec.describe(),
            spec.bytes_per_token,
            how,
        )
        return PagedKVPool(layers, num_pages, spec, device=device)

    def _make_host_tier(self, pool: PagedKVPool | V4StatePool, device: torch.device) -> HostKVTier | None:
        capacity, how = self.args.host_tier_bytes(free_memory(torch.device("cpu")))
        if capacity < pool.page_record_bytes:
            return None
        log.info(
            "host KV tier: up to %d pages (%.1f MiB; %s)",
            capacity // pool.page_record_bytes,
            capacity / 2**20,
            how,
        )
        return HostKVTier(capacity, pool.page_record_bytes, pin=device.type == "cuda")

    def _make_v4_pool(self, device: torch.device, dtype: torch.dtype) -> V4StatePool:
        """Pages from the budget left once ``max_num_seqs`` sequences' fixed part (window rows,
        compressor state) is set aside (dsinfer/cache/v4_pool.py)."""
        assert isinstance(self.config, V4Config)
        mtp_layers = 1 if self.args.speculative_mtp else 0
        page_bytes = V4StatePool.page_bytes_for(self.config, dtype)
        reserve = V4StatePool.reserve_bytes_for(self.config, dtype, self.args.max_num_seqs, mtp_layers)
        budget, how = self.args.kv_cache_memory, "--kv-cache-memory"
        if budget is None:
            budget, how = self.args.default_kv_budget(
                page_bytes=page_bytes,
                page_size=V4_PAGE_TOKENS,
                max_model_len=self.max_model_len,
                free=free_memory(device),
                device_type=device.type,
            )
        num_pages = (budget - reserve) // page_bytes
        if num_pages < 1:
            raise ValueError(
                f"kv_cache_memory {budget} bytes holds no page ({page_bytes} bytes) once {reserve} bytes "
                f"are set aside for the windows and compressor state of max_num_seqs {self.args.max_num_seqs}"
            )
        resume_points = self.args.max_num_seqs if self.args.enable_prefix_caching else 0
        pool = V4StatePool(
            self.config,
            num_pages,
            dtype,
            device,
            max_resume_points=resume_points,
            handoff_slots=self.args.max_num_seqs,
            mtp_layers=mtp_layers,
        )
        log.info(
            "KV cache: %d pages x %d tokens (%.1f MiB, %d bytes per page) + %.1f MiB for %d sequences' "
            "windows and compressor state and as many resume points (%s; %s)",
            num_pages,
            pool.page_size,
            num_pages * page_bytes / 2**20,
            page_bytes,
            reserve / 2**20,
            self.args.max_num_seqs,
            pool.describe(),
            how,
        )
        return pool

    # Requests ------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        *,
        first_choice: int = 0,
        prefill_only: bool = False,
        output_token_ids: list[int] | None = None,
    ) -> None:
        """Validates and queues; raises ValueError naming the problem (nothing is queued then).

        The request's choices are numbered from ``first_choice``: a server that splits ``n``
        choices into ``n`` requests of one choice each passes the choice index here, so the
        counter-based sampler draws exactly what the offline engine draws for that choice.
        ``prefill_only`` (PD prefill side) ends each choice after its next token.
        ``output_token_ids``: a continuation (a migrated choice): the tokens the choice already
        generated elsewhere. They are prefilled after the prompt and count as output (the
        sampler's position, penalties, ``max_tokens``), so the next token is the one the
        undisturbed choice would have sampled."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seqs = self._sequences(
            request_id, prompt_token_ids, params, first_choice, prefill_only, output_token_ids or []
        )
        self._requests.add(request_id, seqs, prompt)
        for seq in seqs:
            self.scheduler.add(seq)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self._requests.discard(request_id)
        self._keep_running_states()

    def _keep_running_states(self) -> None:
        """V4: the per-sequence caches of sequences that stopped running (finished, aborted,
        preempted) are dropped; their pages went back to the pool already."""
        pool = self.kv.pool
        if isinstance(pool, V4StatePool):
            pool.caches.keep(seq.key for seq in self.scheduler.running)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # Steps ---------------------------------------------------------------------------------
    def plan_step(self) -> StepPlan:
        """This rank's batch and votes for the coming step (no collective)."""
        has_work = self.scheduler.has_work()
        batch = self.scheduler.schedule() if has_work else ScheduledBatch()
        if has_work and not batch.seqs and self._all_reduce_max is None:
            self.kv.wait_for_loads(IDLE_LOAD_WAIT)  # alone, with only tier loads to wait for
        votes = self.runner.vote(batch, StepVotes(has_work=has_work))
        if self.expert_balancer is not None:
            if not has_work:
                self.expert_balancer.idle_boundary()
            votes = dataclasses.replace(
                votes,
                eplb_staging=self.expert_balancer.vote_staging(),
                regroup_staging=self.expert_balancer.regroup_staging,
            )
        return StepPlan(batch, votes)

    def agree(self, votes: StepVotes) -> StepVotes:
        """The pool's decision from every rank's votes: one all-reduce (none without a pool)."""
        return agree(votes, self._all_reduce_max)

    def run_step(
        self, plan: StepPlan, agreed: StepVotes, layer_hook_for: LayerHookFor | None = None
    ) -> list[SeqUpdate]:
        """Run the planned forward as the pool agreed; returns every sequence that got tokens or
        finished in it. ``layer_hook_for(work)``, when given, sees the step's work before the
        forward and may return a callback the model calls with each cache layer's index once that
        layer's KV is written (the PD prefill side starts its KV writes there)."""
        return self._run(plan, agreed, layer_hook_for)[0]

    def step_updates(self, layer_hook_for: LayerHookFor | None = None) -> list[SeqUpdate]:
        """``plan_step``, ``agree`` and ``run_step`` for a caller without votes of its own."""
        plan = self.plan_step()
        return self.run_step(plan, self.agree(plan.votes), layer_hook_for)

    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward; returns the requests that finished in it."""
        plan = self.plan_step()
        return self._run(plan, self.agree(plan.votes), None)[1]

    def _run(
        self, plan: StepPlan, agreed: StepVotes, layer_hook_for: LayerHookFor | None
    ) -> tuple[list[SeqUpdate], list[RequestOutput]]:
        if self.expert_balancer is not None:
            self.expert_balancer.before_step(agreed.eplb_staging)
        batch = plan.batch
        before = [item.seq.num_tokens for item in batch.seqs]
        hook = layer_hook_for(plan.work()) if layer_hook_for is not None and batch.seqs else None
        results = self.runner.run(batch, agreed, hook)
        if isinstance(self.kv.pool, V4StatePool):  # before the commit writes pages behind to disk
            for item in batch.seqs:
                self.kv.pool.caches.stash(item.seq.key, item.seq.pages)
        finished = self.scheduler.postprocess(batch, results)
        self._keep_running_states()
        updates = []
        for item, num_before in zip(batch.seqs, before, strict=True):
            seq = item.seq
            new = seq.num_tokens - num_before
            if new or seq.is_finished:
                logprobs = seq.logprobs[len(seq.logprobs) - new :] if seq.logprobs is not None else None
                updates.append(SeqUpdate.of(seq, seq.token_ids[num_before:], logprobs))
        return updates, self._requests.collect(finished)

    def warmup(self) -> None:
        """One short request through prefill and decode, so kernels compile (numba, Triton)
        before serving; under expert parallelism every rank of the pool runs it in lockstep.
        Counters are reset afterwards."""
        start = time.monotonic()
        compile_ahead(self.ops)  # on a fresh install the ranks of a machine share the compiling
        ids = [t % self.config.vocab_size for t in range(1, 9)]
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
        self.add_request("__warmup__", ids, params)
        while self.has_unfinished_requests():
            self.step_updates()
        self.scheduler.stats = SchedulerStats()
        for module in self.model.modules():
            if isinstance(module, MoE):
                module.expert_load.zero_()
                module.experts.slot_load.zero_()
            elif isinstance(module, V4MoE):
                module.expert_load.zero_()
        log.info("warm-up done in %.1f s", time.monotonic() - start)

    def load(self, with_expert_load: bool = False) -> EngineLoad:
        """Queue lengths, KV usage and prefix-cache counters (the expert load when asked)."""
        sched, kv = self.scheduler, self.kv
        prefills = [s for s in [*sched.waiting, *sched.running] if s.num_computed_tokens < s.prompt_len]
        stats = kv.stats
        return EngineLoad(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            kv_pages_used=kv.num_pages - kv.num_available_pages(),
            kv_pages_total=kv.num_pages,
            pending_prefill_tokens=sum(s.prompt_len - s.num_computed_tokens for s in prefills),
            pending_attention_load=sum(
                (s.prompt_len - s.num_computed_tokens) * s.prompt_len for s in prefills
            ),
            prompt_tokens=sched.stats.prompt_tokens_submitted,
            memory_hit_tokens=stats.memory_hit_tokens,
            disk_hit_tokens=stats.disk_hit_tokens,
            host_hit_tokens=stats.host_hit_tokens,
            kv_tiers=kv.tier_report(stats),
            kv_disk_tier_id=kv.disk_tier_id,
            mtp_drafts_proposed=sched.stats.drafts_proposed,
            mtp_drafts_accepted=sched.stats.drafts_accepted,
            mtp_verifications=sched.stats.draft_verifications,
            eplb_swaps=self.expert_balancer.swaps if self.expert_balancer is not None else 0,
            expert_load=self.model.expert_load() if with_expert_load else None,
        )

    def stats_line(self) -> str:
        """Counters since start: prefix-cache hits per tier, prefill saved, preemptions, MTP."""
        sched, kv = self.scheduler.stats, self.kv.stats
        line = (
            f"prompt tokens {sched.prompt_tokens_submitted} submitted, {sched.prompt_tokens_computed} computed; "
            f"cache hits {kv.memory_hit_tokens} memory + {kv.host_hit_tokens} host + {kv.disk_hit_tokens} disk tokens; "
            f"preemptions {sched.preemptions}; steps {sched.steps}"
        )
        if self.args.speculative_mtp:
            line += (
                f"; MTP acceptance {sched.acceptance_rate:.1%}, "
                f"{sched.forwards_per_output_token:.2f} target forwards per decoded token"
            )
        return line

    def close(self) -> None:
        self.runner.close()
        self.kv.close()
        if self.expert_balancer is not None:
            self.expert_balancer.close()
