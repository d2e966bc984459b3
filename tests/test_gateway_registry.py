"""The gateway's worker registry: a rank that left is forgotten once silent long enough."""

from __future__ import annotations

from dsinfer.base.protocol import Register
from dsinfer.gateway.pools import Pools
from dsinfer.gateway.registry import FORGET_AFTER_TIMEOUTS


def _register(worker: str, incarnation: str = "a") -> Register:
    role = worker.split("/")[0]
    return Register(
        worker=worker, role=role, pool=0, incarnation=incarnation, inbox="tcp://127.0.0.1:1",
        kv_pages_total=8, page_size=16, max_model_len=256, model="ab" * 16,
    )  # fmt: skip


def _listed(pools: Pools) -> dict[str, bool]:
    return {w.worker: w.healthy for w in pools.metrics(0, 0).workers}


def test_a_silent_rank_stays_listed_unhealthy_then_is_forgotten() -> None:
    pools = Pools(heartbeat_timeout=1.0)
    pools.register(_register("colocated/0/0"), now=0.0)
    pools.register(_register("colocated/1/0"), now=0.0)
    registry = pools.registry
    registry.heartbeat("colocated/1/0", "a", now=FORGET_AFTER_TIMEOUTS + 5.0)
    assert [w.name for w in registry.expired(now=2.0)] == ["colocated/0/0"]
    assert _listed(pools) == {"colocated/0/0": False, "colocated/1/0": True}
    assert registry.forget_silent(now=FORGET_AFTER_TIMEOUTS - 0.5) == []  # it may still come back
    forgotten = registry.forget_silent(now=FORGET_AFTER_TIMEOUTS + 0.5)
    assert [w.name for w in forgotten] == ["colocated/0/0"]
    assert _listed(pools) == {"colocated/1/0": True}  # a healthy rank is never forgotten


def test_a_dead_incarnation_is_forgotten_and_a_new_one_registers_afresh() -> None:
    pools = Pools(heartbeat_timeout=1.0)
    pools.register(_register("decode/0/0"), now=0.0)
    assert [w.name for w in pools.registry.pool_down("decode", 0, "a")] == ["decode/0/0"]
    assert pools.registry.forget_silent(now=FORGET_AFTER_TIMEOUTS + 1.0)
    assert _listed(pools) == {}
    assert pools.register(_register("decode/0/0", incarnation="b"), now=20.0) is None
    assert _listed(pools) == {"decode/0/0": True}
