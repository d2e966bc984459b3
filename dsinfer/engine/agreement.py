"""The per-step agreement of a pool: every decision that changes the sequence of collectives,
taken by all ranks together at the step boundary, in one all-reduce of one small tensor.

The ranks of an expert-parallel pool must issue the same collectives in the same order, or gloo
and NCCL hang. So nothing a rank decides alone may change that sequence: each rank writes its
view into a :class:`StepVotes`, the pool all-reduces them (MAX, element-wise) once per step, and
every rank acts on the same result. This module is the one place the fields are listed.

Every field is an ``int`` (a ``bool`` is 0 or 1) reduced with MAX: for a flag that is "any rank".
A decision that needs "every rank" is kept as its negation ("some rank not"), so one op serves
all. A field may also carry a counter whose largest value wins (e.g. a membership epoch). To add
a decision: add a field with its default (what a rank with nothing to say votes), document it
below, read it where the decision is taken; the tensor grows by one element.

The step protocol (dsinfer/workers/rank.py; engine level: ``LLMEngine.step_updates``):

1. ``LLMEngine.plan_step()`` on every rank: schedule this rank's batch and fill the engine's votes
   (no collective).
2. The caller adds its own votes (work, stopping, busy) and calls ``LLMEngine.agree(votes)``:
   the one all-reduce (none in a pool of one rank).
3. If the pool agreed to step, ``LLMEngine.run_step(plan, agreed)`` on every rank (a rank with
   no work runs an empty batch, so the forward's own collectives line up).

MTP draft or verify does not change the collectives (the MTP layer runs on every rank that steps,
an idle rank's empty forward included), nor does a recompute prefill on decode beyond the
micro-batch order voted here. The EPLB window load (every ``--eplb-interval`` steps, at a step
number every rank shares) is data, not a decision: it is its own all-reduce at those steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["AllReduceMax", "StepVotes", "agree"]

AllReduceMax = Callable[[torch.Tensor], torch.Tensor]  # in place over the pool, returns the tensor


@dataclass(frozen=True)
class StepVotes:
    # The rank loop's votes --------------------------------------------------------------------
    has_work: bool = False  # the pool steps when any rank has work; else every rank sleeps
    busy: bool = False  # waits on transfers or timers: the loop comes back soon
    not_stopping: bool = False  # the pool stops once no rank votes this and no rank is busy
    # The engine's votes ------------------------------------------------------------------------
    two_micro_batches: bool = False  # the step runs two micro-batches (--enable-overlap)
    prefill_order: bool = False  # ... in the prefill schedule (a prefill chunk somewhere), else decode's
    eplb_staging: bool = False  # a rank still stages the pending expert placement: no swap yet
    # the most tokens any rank's step carries: DeepEP's low-latency buffer takes the step only when
    # they fit it on every rank, else every rank's MoE uses the torch all-to-all
    step_tokens: int = 0
    # Elastic EP: the pool's membership (dsinfer/workers/elastic.py) ----------------------------
    pool_generation: int = 0  # newest membership generation a rank knows of; past the pool's: a regroup comes
    regroup_staging: bool = False  # a rank still stages its experts for that membership: no re-form yet

    @property
    def stopping(self) -> bool:
        """Every rank is stopping and none is busy: the pool leaves its loop together."""
        return not self.not_stopping and not self.busy


def agree(votes: StepVotes, all_reduce_max: AllReduceMax | None) -> StepVotes:
    """The pool's decision: ``votes`` reduced over the pool in one all-reduce (MAX);
    ``all_reduce_max`` None (a pool of one rank) returns the votes as they are."""
    if all_reduce_max is None:
        return votes
    fields = dataclasses.fields(votes)
    tensor = torch.tensor([int(getattr(votes, f.name)) for f in fields], dtype=torch.int64)
    reduced = all_reduce_max(tensor).tolist()
    return StepVotes(
        **{f.name: type(getattr(votes, f.name))(v) for f, v in zip(fields, reduced, strict=True)}
    )
