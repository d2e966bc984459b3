"""Arguments of one worker rank, as its pool launcher passes them (``--args-json``)."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dsinfer.base.config import TRANSFER_BACKENDS
from dsinfer.base.protocol import ROLES
from dsinfer.connector.messages import PROGRESS_INTERVAL
from dsinfer.engine.args import EngineArgs


def shared_cores(ranks: int) -> int:
    """Torch threads of each of ``ranks`` ranks that share this machine's cores."""
    return max(1, (os.cpu_count() or 1) // ranks)


# a decode rank gives a transfer up only after this many of the prefill rank's progress reports
# went missing: one late report (a long forward, a busy socket) never ends a request
MIN_TIMEOUT_PROGRESS_INTERVALS = 3


class PoolArgs(BaseModel):
    """One pool: what ``dsinfer serve --role prefill|decode|colocated`` is given."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: str
    pool_id: int = Field(0, description="this pool's number among its role's pools")
    pool_size: int = Field(1, description="ranks in the pool (= EP size = DP size)")
    nnodes: int = Field(1, description="machines the pool spans")
    node_rank: int = Field(0, description="this machine's index in [0, nnodes)")
    dist_init_addr: str | None = None  # HOST:PORT of rank 0's torch.distributed store; None = pick
    gateway_addr: str  # HOST:PORT of the gateway's control socket
    host: str = "127.0.0.1"  # address this node's ranks bind their inboxes on
    engine: EngineArgs = EngineArgs()
    transfer_backend: str = Field("nixl", description="library that moves KV pages from prefill to decode")
    kv_transfer_timeout: float = Field(
        30.0,
        description="seconds a decode rank waits without any sign of a reserved KV transfer from its "
        f"prefill rank (which reports each transfer it holds every {PROGRESS_INTERVAL:g} s, queued or not)",
    )
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP collector for the ranks' spans; None = off
    kv_quarantine: float = 60.0  # seconds an aborted transfer's pages stay unused without a fence
    threads_per_rank: int | None = None  # torch threads per rank; None = cores / local ranks
    max_restarts: int = Field(100, description="pool restarts before the launcher gives up")
    restart_backoff: float = Field(1.0, description="seconds before a restart (doubles, capped at 30)")
    elastic_ep: bool = True  # a rank of a one-node pool of several dies: the others serve on (else restart)
    ep_timeout: float = Field(
        10.0,
        description="seconds a serving pool's collective waits for a peer before a hung one counts as dead",
    )

    @model_validator(mode="after")
    def _check(self) -> PoolArgs:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(
                f"transfer_backend must be one of {', '.join(TRANSFER_BACKENDS)}, got {self.transfer_backend!r}"
            )
        if self.pool_size < 1 or self.nnodes < 1:
            raise ValueError("pool_size and nnodes must be at least 1")
        if self.pool_size % self.nnodes:
            raise ValueError(f"pool_size {self.pool_size} is not a multiple of nnodes {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes})")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("dist_init_addr is required when nnodes > 1")
        for name in ("kv_transfer_timeout", "kv_quarantine", "ep_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.kv_transfer_timeout < MIN_TIMEOUT_PROGRESS_INTERVALS * PROGRESS_INTERVAL:
            raise ValueError(
                f"kv_transfer_timeout must be at least {MIN_TIMEOUT_PROGRESS_INTERVALS * PROGRESS_INTERVAL:g} s "
                f"({MIN_TIMEOUT_PROGRESS_INTERVALS} of the prefill ranks' {PROGRESS_INTERVAL:g} s progress "
                f"reports), got {self.kv_transfer_timeout:g}"
            )
        return self

    @property
    def ranks_per_node(self) -> int:
        return self.pool_size // self.nnodes

    @property
    def threads(self) -> int:
        """--threads-per-rank, else this machine's cores shared by the pool's local ranks."""
        return self.threads_per_rank or shared_cores(self.ranks_per_node)

    @property
    def elastic(self) -> bool:
        """Whether a dead rank leaves the others serving (elastic EP): a one-node pool of several
        ranks (a multi-node pool restarts whole: its nodes' launchers keep no common membership)."""
        return self.elastic_ep and self.pool_size > 1 and self.nnodes == 1


class RankArgs(BaseModel):
    """One rank of a pool, started by the launcher with a fresh ``incarnation`` per pool start
    (and per restart of the rank alone, in an elastic pool)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pool: PoolArgs
    rank: int  # global rank in the pool
    local_rank: int
    dist_init_addr: str  # resolved by the launcher ("" for a pool on one node: it meets in a FileStore)
    incarnation: str
    pool_incarnation: str = ""  # the pool start's (its keys in the launcher's store); "" = incarnation
    joining: bool = False  # restarted alone: rejoins its running pool (elastic EP)
    dist_store_file: str | None = None  # a pool on one node: torch's FileStore here, no TCPStore
    # (an elastic pool's: the launcher's, with its membership)
