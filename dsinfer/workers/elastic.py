"""Elastic expert parallelism, the rank's side: a pool of several ranks serves on when one of
them dies, and takes it back once its launcher restarted it (docs/serving.md, "Elastic EP").

The membership lives in the launcher's store (dsinfer/workers/membership.py). Each generation
of it has its own process group, initialised afresh on its own store prefix; a rank leaves the
old one with ``destroy_process_group`` (its sockets to the dead peer are closed already).

Shrink: the launcher removes the dead rank from the membership and tells the gateway
(RankDown: the rank's choices move to other ranks). The survivors' next collective fails at once
(gloo sees the closed connection; a peer that hangs instead: the group's ``step_timeout``); the
step is abandoned (nothing of it was recorded: it is planned again). ``recover`` waits for the
new membership, stages the experts of ``keep_ranks(current placement)`` (each survivor keeps
its own; the dead rank's experts without a replica are loaded from the checkpoint), forms the
new generation's group and serves on with its weights and KV.

Rejoin: the restarted rank (``join``) loads its experts for ``placement_for_members`` of the
membership with itself and asks to join. The leader (the first member) sees the request at its
next poll (``vote``) and writes the next generation; the pool learns it from the agreed
``pool_generation`` at one boundary (``on_agreed``), every member stages its experts for the
new placement at the following boundaries (``regroup_staging``), and at the first boundary where
none still stages they all form the new group with the joining rank, which waited for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from dsinfer.engine.agreement import StepVotes
from dsinfer.engine.facade import EngineFacade
from dsinfer.parallel.elastic_placement import keep_ranks, placement_for_members
from dsinfer.parallel.ep import EPGroup
from dsinfer.parallel.placement import ExpertPlacement
from dsinfer.workers.membership import POLL, Membership, PoolStore

log = logging.getLogger("dsinfer.worker")

JOIN_POLL = 0.25  # seconds between the leader's looks for a rank asking to rejoin

MakeEPGroup = Callable[[int], EPGroup]  # slots per rank -> this rank's EP group over the default group


class PoolLost(Exception):
    """This rank cannot go on in its pool: it exits, and its launcher decides (restart)."""


class ElasticPool:
    def __init__(
        self,
        rank: int,
        store: PoolStore,
        backend: str,
        make_ep_group: MakeEPGroup,
        *,
        initial: ExpertPlacement,
        step_timeout: float,
        reform_timeout: float,
    ) -> None:
        self.rank, self.store, self.backend = rank, store, backend
        self.make_ep_group, self.initial = make_ep_group, initial
        self.step_timeout, self.reform_timeout = step_timeout, reform_timeout
        self.members = Membership(-1, ())
        self.control: dist.ProcessGroup | None = None  # the gloo group beside an NCCL one
        self._announced: Membership | None = None
        self._next_poll = 0.0

    # Groups ---------------------------------------------------------------------------------------
    def form(self, members: Membership, slots_per_rank: int, timeout: float) -> EPGroup:
        """Leave the current group (if any) and initialise ``members``' group, waiting up to
        ``timeout`` s for every member; returns this rank's EP group over it."""
        if dist.is_initialized():
            if self.backend == "nccl":  # a communicator with a dead peer can hang its destroy (unverified)
                dist.group.WORLD.abort()
            dist.destroy_process_group()
        wait = timedelta(seconds=timeout)
        dist.init_process_group(
            self.backend,
            store=self.store.group_store(members.generation),
            rank=members.index(self.rank),
            world_size=len(members.ranks),
            timeout=wait,
        )
        self.control = dist.new_group(backend="gloo", timeout=wait) if self.backend != "gloo" else None
        self.members = members
        return self.make_ep_group(slots_per_rank)

    def serve(self) -> None:
        """Every member is in (a first collective passed): collectives wait ``step_timeout`` s
        from now on, so a peer that hangs counts as dead within seconds."""
        dist.barrier()
        short = timedelta(seconds=self.step_timeout)
        for group in (dist.group.WORLD, self.control):
            if group is not None:
                group.set_timeout(short)

    def _regroup(self, engine: EngineFacade, members: Membership, placement: ExpertPlacement) -> None:
        start = time.monotonic()
        group = self.form(members, placement.slots_per_rank, self.reform_timeout)
        engine.membership.regroup(group, self.control, placement, members.index(self.rank))
        self.serve()
        log.info(
            "rank %d: pool re-formed as generation %d (ranks %s) in %.2f s",
            self.rank,
            members.generation,
            ",".join(map(str, members.ranks)),
            time.monotonic() - start,
        )

    # The step loop ----------------------------------------------------------------------------------
    def vote(self, now: float) -> int:
        """This rank's ``pool_generation`` vote. The leader looks (every ``JOIN_POLL`` s) for a
        newer membership and for a restarted rank asking to join, and admits it."""
        if self._announced is not None:
            return self._announced.generation
        if self.members.ranks[0] != self.rank or now < self._next_poll:
            return self.members.generation
        self._next_poll = now + JOIN_POLL
        latest = self.store.members()
        if latest.generation > self.members.generation:
            return latest.generation
        for rank in sorted(set(range(self.initial.num_ranks)) - set(self.members.ranks)):
            wanted = tuple(sorted((*self.members.ranks, rank)))
            if self.store.join_request(rank) == wanted:
                admitted = self.store.change(self.members, wanted)
                if admitted is not None:
                    log.info("rank %d asks to rejoin: admitted as generation %d", rank, admitted.generation)
                    return admitted.generation
        return self.members.generation

    def on_agreed(self, agreed: StepVotes, engine: EngineFacade) -> bool:
        """Act on the agreed ``pool_generation``: a newer one announced at this boundary starts
        staging; at a later boundary where no rank stages, the pool re-forms. True: it did (the
        step planned before is dropped)."""
        generation = agreed.pool_generation
        if generation <= self.members.generation:
            return False
        if self._announced is None or self._announced.generation != generation:
            self._announced = self.store.record(generation, self.reform_timeout)
            if self.rank not in self._announced.ranks:
                raise PoolLost(f"membership generation {generation} leaves rank {self.rank} out")
            placement = placement_for_members(self.initial, self._announced.ranks)
            engine.membership.begin(placement, self._announced.index(self.rank))
            log.info(
                "rank %d: membership generation %d announced (ranks %s): staging its experts",
                self.rank,
                generation,
                ",".join(map(str, self._announced.ranks)),
            )
            return False
        if agreed.regroup_staging:
            return False
        members, self._announced = self._announced, None
        self._regroup(engine, members, placement_for_members(self.initial, members.ranks))
        return True

    def recover(self, engine: EngineFacade, error: Exception) -> None:
        """A collective failed: wait for the membership without the dead rank(s), then serve on
        in the new generation's group (raises PoolLost when that cannot be)."""
        old = self.members
        log.warning(
            "rank %d: a collective of generation %d failed (%s); waiting for the pool's new membership",
            self.rank,
            old.generation,
            str(error).splitlines()[0][:200],
        )
        deadline = time.monotonic() + self.reform_timeout
        latest = self.store.members()
        while latest.generation <= old.generation:
            if time.monotonic() >= deadline:
                raise PoolLost(
                    f"no rank left the pool within {self.reform_timeout:g} s of the failure"
                ) from error
            time.sleep(POLL)
            latest = self.store.members()
        if self.rank not in latest.ranks or not set(latest.ranks) <= set(old.ranks):
            raise PoolLost(
                f"membership went from ranks {old.ranks} to {latest.ranks}: not a shrink this rank survives"
            ) from error
        current = engine.membership.placement
        assert current is not None
        self._announced = None
        placement = keep_ranks(current, [old.index(r) for r in latest.ranks])
        self._regroup(engine, latest, placement)

    # A restarted rank ---------------------------------------------------------------------------------
    def target(self) -> tuple[Membership, ExpertPlacement]:
        """The membership a restarted rank asks for (the latest with it) and its placement."""
        latest = self.store.members()
        ranks = tuple(sorted((*latest.ranks, self.rank)))
        return Membership(latest.generation + 1, ranks), placement_for_members(self.initial, ranks)

    def join(self, engine: EngineFacade, wanted: Membership, placement: ExpertPlacement) -> None:
        """Ask to join as ``wanted`` (``engine`` holds the experts ``placement`` gives this rank),
        wait to be admitted, form the group with the members."""
        self.store.ask_to_join(self.rank, wanted.ranks)
        deadline = time.monotonic() + self.reform_timeout
        latest = self.store.members()
        while latest.ranks != wanted.ranks:
            if time.monotonic() >= deadline or latest.generation >= wanted.generation:
                self.store.withdraw_join(self.rank)
                raise PoolLost(f"not admitted to the pool as ranks {wanted.ranks} (it is {latest.ranks} now)")
            time.sleep(POLL * 5)
            latest = self.store.members()
        self.store.withdraw_join(self.rank)
        self._regroup(engine, latest, placement)
