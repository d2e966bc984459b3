"""Online expert rebalancing: EPLB applied while a pool serves, without a stall or a changed token.

Every ``interval`` steps all ranks of the pool sum the expert load of the last window (tokens
routed to each logical expert per MoE layer since the previous check) with one all-reduce, so
every rank computes the same new placement from the same numbers (a pure function). When it
balances the window's load better by more than ``min_gain``, each rank stages the routed experts
of its new slots into shadow modules while serving goes on; at every later step boundary each
rank votes whether it is still staging (``eplb_staging`` of the pool's one agreement per step,
dsinfer/engine/agreement.py), and at the first boundary at which no rank is, every rank swaps
its expert modules and routing tables before its forward. Expert weights are the same, only
where they live changes, so no token changes.

The same staging carries a pool's change of membership (elastic EP, dsinfer/workers/elastic.py):
``begin_regroup`` stages this rank's experts for the placement of the coming membership, paced
like EPLB's (voted as ``regroup_staging``), or all at once when a rank died and the pool cannot
serve without them; ``regroup`` swaps to them together with the new group's EP communicator.
A regroup cancels a pending EPLB placement and restarts the load window (``steps`` from 0 on
every rank, the one that joined included, so the window's all-reduce stays at common steps).
``interval`` 0: no EPLB, only regroups.

Staging contract (what keeps a step from stalling, by construction):

- Staging runs on the serving thread, at step boundaries (``before_step``), in pieces
  (``ExpertStaging``: one expert projection or a block of its rows, at most ``PIECE_BYTES``;
  what the rank already holds is copied from its current module, the rest read from the
  checkpoint or drawn like the loader draws dummy weights: bit-identical to a fresh load).
- Each boundary gets a time budget: ``stage_budget`` x the median of the last ``STEP_WINDOW``
  serving steps (time.perf_counter from one boundary's end to the next's start). Pieces run
  until the next one, at the running estimate of a piece's time, would pass it; at least one
  piece runs per boundary, so staging always progresses (budget 0 = one piece per step). A
  step therefore grows by at most the budget plus about one piece, never by the whole staging;
  no thread competes with serving for cores or the GIL. (An idle pool runs no boundaries, so
  staging waits for the next step.)
- Every rank stages at its own pace; the step agreement's ``eplb_staging`` vote picks the
  common swap step (the boundary after the last rank staged its last piece). The swap itself only reassigns module references and
  routing tables. The replaced modules' weights are freed afterwards, a tensor or a few per
  boundary under the same budget (freeing hundreds of MiB at once costs tens of ms).
- Peak memory: the new modules of the layers that change, besides the old ones, from the
  decision until the old ones are freed.

On a GPU the same contract holds with asynchronous copies: a piece's rows are read from the
checkpoint into pinned host memory (dummy weights drawn on the CPU; a pinned buffer is reused
once its copy's event has completed) and copied host-to-device with ``non_blocking=True`` on a
side stream, experts already on the device device-to-device on
that stream; the budget then bounds the host-side work and the bytes issued per step (copies
share PCIe with the RDMA traffic of dispatch/combine), and a piece overlaps the step's kernels
instead of adding to the step. "Staged" means an event recorded after the last piece has
completed (``event.query()``), not merely issued; at the swap the serving stream waits on that
event (free, it has completed) before the first forward with the new modules. A captured CUDA
graph holds the old weights' addresses, so a swap also has to re-capture, or the pieces have to
be staged into the captured buffers' twins and the graphs captured over both (graphs run only
without expert parallelism today, where nothing rebalances). Here on the CPU a piece is a
synchronous copy on the serving thread, so its time adds to the step it runs at, and freeing
the old weights costs time (munmap) that a GPU's caching allocator does not.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsinfer.model.deepseek_v3 import DeepseekV3ForCausalLM
from dsinfer.model.expert_staging import ExpertSource, ExpertStaging
from dsinfer.model.moe import ExpertParallel, Experts, MoE
from dsinfer.parallel.ep import EPGroup
from dsinfer.parallel.eplb import placement_from_load
from dsinfer.parallel.placement import ExpertPlacement

log = logging.getLogger("dsinfer.eplb")

DEFAULT_STAGE_BUDGET = 0.1  # of the median step: staging slows a step by about 10% at most
STEP_WINDOW = 32  # serving steps the median step time is taken over
PlacementPolicy = Callable[[dict[int, list[float]], ExpertPlacement], ExpertPlacement]


def eplb_policy(num_groups: int) -> PlacementPolicy:
    """DeepSeek's EPLB (global policy: one pool-wide packing) with ``current``'s slot counts."""

    def policy(load: dict[int, list[float]], current: ExpertPlacement) -> ExpertPlacement:
        redundant = current.num_physical - current.num_logical
        return placement_from_load(load, current.num_logical, current.num_ranks, redundant, num_groups, 1)

    return policy


@dataclass
class Rebalance:
    step: int
    balance_before: float  # max/mean per-rank load of the window under the old placement
    balance_after: float  # the same load under the new placement
    stage_pieces: int = 0  # pieces this rank staged
    stage_steps: int = 0  # step boundaries at which this rank staged pieces
    stage_work_seconds: float = 0.0  # this rank's time in pieces
    stage_seconds: float = 0.0  # the decision to the swap, wall clock
    swap_step: int | None = None
    freed_step: int | None = None  # the step boundary at which the replaced weights were all freed
    received_before: list[int] | None = None  # pairs this rank computed per MoE layer until the swap


@dataclass
class _Pacer:
    """Runs pieces of work at one step boundary until the next piece would pass a deadline."""

    estimate: float = 0.0  # running estimate of one piece's seconds

    def run(self, piece: Callable[[], bool], deadline: float) -> tuple[int, float]:
        """``piece()`` does one piece and says whether more are left; at least one runs.
        -> (pieces run, seconds in them)."""
        count, spent, more = 0, 0.0, True
        while more:
            start = time.perf_counter()
            if count and start + self.estimate > deadline:
                break
            more = piece()
            took = time.perf_counter() - start
            self.estimate = took if self.estimate == 0.0 else 0.75 * self.estimate + 0.25 * took
            count, spent = count + 1, spent + took
        return count, spent


@dataclass
class _Pending:
    placement: ExpertPlacement
    staging: ExpertStaging
    started: float  # time.monotonic() of the decision
    rank: int  # this rank's index in the placement


class OnlineExpertBalancer:
    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        source: ExpertSource,
        *,
        interval: int,
        min_gain: float = 0.05,
        stage_budget: float = DEFAULT_STAGE_BUDGET,
        policy: PlacementPolicy | None = None,
    ) -> None:
        if model.ep is None:
            raise ValueError("online expert rebalancing needs an expert-parallel pool")
        if stage_budget < 0:
            raise ValueError(f"stage_budget must be >= 0, got {stage_budget}")
        if interval < 0:
            raise ValueError(f"interval must be >= 0 (0: no EPLB), got {interval}")
        self.model, self.source = model, source
        self.interval, self.min_gain, self.stage_budget = interval, min_gain, stage_budget
        self.policy = policy or eplb_policy(self._expert_groups())
        self.ep: ExpertParallel = model.ep
        self.steps = 0
        self._moes = self._find_moes()
        self._layer_of = {name: m.layer_id for name, m in self._moes.items()}
        self._last = self._cumulative()
        self._pending: _Pending | None = None
        self._regroup: _Pending | None = None  # staged for a coming pool membership
        self._swap_voted = False  # a placement was pending when this rank last voted
        self._retired: list[torch.Tensor] = []  # weights of replaced modules, not freed yet
        self._freeing: Rebalance | None = None  # the rebalance whose replaced weights those are
        self._step_seconds: deque[float] = deque(maxlen=STEP_WINDOW)
        self._resumed: float | None = None  # when the last before_step returned
        self._stage_pacer, self._free_pacer = _Pacer(), _Pacer()
        self.history: list[Rebalance] = []

    # What differs by model family (DeepSeek-V4's: dsinfer/engine/v4_expert_balancer.py) ---------
    def _expert_groups(self) -> int:
        return self.model.config.n_group

    def _find_moes(self) -> dict[str, MoE]:
        return {name: m for name, m in self.model.named_modules() if isinstance(m, MoE)}

    def _received(self) -> list[int]:
        """Rows each MoE layer's slots have received since the last swap."""
        return [int(m.experts.slot_load.sum()) for m in self._moes.values()]

    def vote_staging(self) -> bool:
        """This rank's ``eplb_staging`` vote at the coming step boundary: still staging."""
        self._swap_voted = self._pending is not None
        return self._pending is not None and self._pending.staging.pieces_left > 0

    def before_step(self, staging_anywhere: bool) -> None:
        """Call at every step boundary, on every rank of the pool (it runs collectives), with the
        pool's agreed ``eplb_staging`` (after this rank's ``vote_staging``)."""
        now = time.perf_counter()
        if self._resumed is not None:
            self._step_seconds.append(now - self._resumed)
        self.steps += 1
        deadline = now + self.budget()
        if self._retired:
            self._free_pacer.run(self._free_one, deadline)
        if not self._retired and self._freeing is not None:
            self._freeing.freed_step, self._freeing = self.steps, None
        if self._regroup is not None:
            if self._regroup.staging.pieces_left:
                self._stage_pacer.run(self._regroup.staging.fill_next, deadline)
        elif self._pending is not None:
            if self._swap_voted and not staging_anywhere:
                self._swap(self._pending)
            else:
                self._stage(self._pending, deadline)
        elif self.interval and self.steps % self.interval == 0:
            self._check()
        self._resumed = time.perf_counter()

    # Pool membership changes (elastic EP) --------------------------------------------------------
    @property
    def regroup_staging(self) -> bool:
        """This rank's ``regroup_staging`` vote: pieces of the coming placement are left."""
        return self._regroup is not None and self._regroup.staging.pieces_left > 0

    def idle_boundary(self) -> None:
        """A boundary at which the pool does not step (idle): staging for a coming membership
        goes on, one piece (an idle pool would otherwise never get to its re-form)."""
        if self._regroup is not None and self._regroup.staging.pieces_left:
            self._regroup.staging.fill_next()

    def begin_regroup(self, placement: ExpertPlacement, rank: int) -> None:
        """Stage the experts ``placement`` gives this rank (index ``rank`` in it) at the coming
        boundaries; a pending EPLB placement is dropped."""
        self._pending = None
        self._regroup = _Pending(placement, self._staging_for(placement, rank), time.monotonic(), rank)

    def regroup(self, group: EPGroup, placement: ExpertPlacement, rank: int) -> None:
        """Serve ``placement`` over ``group`` (this rank's index ``rank``) from now on: the
        pieces not staged yet are staged now (all of them when nothing was staged for it)."""
        pending = self._regroup
        if pending is None or pending.placement != placement or pending.rank != rank:
            self.begin_regroup(placement, rank)
            pending = self._regroup
        assert pending is not None
        while pending.staging.pieces_left:
            pending.staging.fill_next()
        self._install(ExpertParallel(placement, group), pending.staging.modules)
        self._regroup = None
        self.steps, self._last = 0, self._cumulative()
        log.info(
            "expert placement of %d ranks (%d slots each) on group rank %d, staged in %.2f s",
            placement.num_ranks,
            placement.slots_per_rank,
            rank,
            time.monotonic() - pending.started,
        )

    def _staging_for(self, placement: ExpertPlacement, rank: int) -> ExpertStaging:
        wanted = {}
        for name, moe in self._moes.items():
            experts = placement.local_experts(moe.layer_id, rank)
            if experts != moe.experts.expert_ids:
                wanted[f"{name}.experts"] = experts
        held = {f"{name}.experts": m.experts for name, m in self._moes.items()}
        return self.source.stage(wanted, held)

    def _install(self, ep: ExpertParallel, staged: dict[str, Experts]) -> None:
        """Every MoE layer routes by ``ep`` with its staged module (where it changed)."""
        for name, moe in self._moes.items():
            moe.experts.slot_load.zero_()
            new = staged.get(f"{name}.experts")
            if new is not None:
                self._retired.extend(moe.experts.parameters())  # freed at later boundaries
                moe.experts = new
            moe.set_placement(ep)
        self.model.ep = self.ep = ep

    def budget(self) -> float:
        """Seconds of staging per step boundary: ``stage_budget`` x the recent median step."""
        if not self._step_seconds:
            return 0.0
        return self.stage_budget * statistics.median(self._step_seconds)

    def _cumulative(self) -> torch.Tensor:
        return torch.stack([m.expert_load.to(torch.float64) for m in self._moes.values()])

    def _check(self) -> None:
        total = self._cumulative()
        window = self.ep.group.all_reduce(total - self._last, "sum")
        self._last = total
        load = {self._layer_of[name]: row.tolist() for name, row in zip(self._moes, window, strict=True)}
        current = self.ep.placement
        candidate = self.policy(load, current)
        before, after = current.stats(load)["balance"], candidate.stats(load)["balance"]
        if candidate.layers == current.layers or before < after * (1 + self.min_gain):
            return
        staging = self._staging_for(candidate, self.ep.rank)
        self.history.append(Rebalance(self.steps, before, after))
        self._pending = _Pending(candidate, staging, time.monotonic(), self.ep.rank)
        log.info(
            "step %d: expert placement %.3f -> %.3f max/mean per-rank load; staging %d layers' new "
            "experts in %d pieces",
            self.steps,
            before,
            after,
            len(staging.modules),
            staging.total,
        )

    def _stage(self, pending: _Pending, deadline: float) -> None:
        staging, event = pending.staging, self.history[-1]
        if staging.pieces_left:
            count, spent = self._stage_pacer.run(staging.fill_next, deadline)
            event.stage_pieces += count
            event.stage_steps += 1
            event.stage_work_seconds += spent

    def _swap(self, pending: _Pending) -> None:
        event = self.history[-1]
        event.received_before = self._received()
        self._install(ExpertParallel(pending.placement, self.ep.group), pending.staging.modules)
        self._pending, self._freeing = None, event
        event.stage_seconds, event.swap_step = time.monotonic() - pending.started, self.steps
        log.info(
            "step %d: swapped to the new expert placement (staged in %.2f s over %d steps, %.3f s of pieces)",
            self.steps,
            event.stage_seconds,
            event.stage_steps,
            event.stage_work_seconds,
        )

    @property
    def swaps(self) -> int:
        """Placements swapped in since start."""
        return sum(1 for event in self.history if event.swap_step is not None)

    def _free_one(self) -> bool:
        self._retired.pop()
        return bool(self._retired)

    def close(self) -> None:
        """Drop a staging still under way and the replaced weights not freed yet."""
        self._pending = self._regroup = self._freeing = None
        self._retired.clear()
