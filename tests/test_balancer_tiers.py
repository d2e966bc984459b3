"""Routing that knows the KV tiers (dsinfer/balancers/prefill.py, decode.py).

Prefill: a rank's cached prefix is placed in its device pages, its host tier or the disk by how
many pages were sent to it since, and a hit from a slower tier saves less (its load costs
``tier_cost``). Each check finds where the pick turns from the rank holding the prefix to an empty
rank as the holder's pending load grows: the turn is at the compute the holder's hit saves, so it
names exactly how many pages' worth the balancer believed were cached. Ranks that report one disk
tier id share it: a prefix computed on one is a disk hit on the others, after a restart too.
Decode: a conversation's next turn goes back to the rank holding its pages while that rank is
within the KV and request-count slack, and not once it is past them.
"""

from __future__ import annotations

from dsinfer.balancers import DecodeBalancer, PrefillBalancer, RouteRequest
from dsinfer.base.hashing import model_root, page_hashes
from dsinfer.base.protocol import LoadReport

PS = 4
ROOT = model_root("test-balancer-tiers", str(PS))
PROMPT = [*range(100, 100 + 8 * PS), 7]  # 8 full pages and one token
LEN = len(PROMPT)
COSTS = {"host": 0.5, "disk": 0.75}
BASE = 10 * LEN * LEN  # every rank's pending load: no rank is idle, none hot (hot_prefix_cap 2)


def _request(rid: str, tokens: list[int], max_tokens: int = 16) -> RouteRequest:
    return RouteRequest(rid, tokens, page_hashes(tokens, PS, ROOT), max_tokens)


def _report(
    worker: str, *, device: int, host: int = 0, disk: int = 0, tier: str = "", attention: int = 0
) -> LoadReport:
    return LoadReport(
        worker=worker,
        incarnation="1",
        kv_pages_total=device,
        pending_attention_load=BASE + attention,
        kv_tiers={"host": {"capacity_pages": float(host)}, "disk": {"capacity_pages": float(disk)}},
        kv_disk_tier_id=tier,
    )


def _send(balancer: PrefillBalancer, worker: str, rid: str, tokens: list[int]) -> None:
    assert balancer.pick(_request(rid, tokens), [worker], now=0.0) == worker
    balancer.finished(rid, worker)


def _saved_pages(setup, holder: str = "holder") -> float:  # type: ignore[no-untyped-def]
    """The pages' worth of compute the holder's hit on PROMPT saves, as the balancer weighs it:
    the holder is picked over an empty rank while its extra pending attention load is below what
    the hit saves (``saved * PS * LEN``, token_weight 0); searched to the attention unit."""
    low, high = 0, LEN * LEN
    while low < high:
        mid = (low + high) // 2
        balancer = setup(mid)
        picked = balancer.pick(_request("probe", PROMPT), [holder, "empty"], now=0.0)
        low, high = (mid + 1, high) if picked == holder else (low, mid)
    # at equality a holder with a hit still wins (fewer new tokens); without one it loses (more sent)
    return max(low - 1, 0) / (PS * LEN)


def test_a_prefix_pushed_past_the_device_pages_counts_as_a_host_hit() -> None:
    def setup(pushed_pages: int):  # type: ignore[no-untyped-def]
        def make(attention: int) -> PrefillBalancer:
            balancer = PrefillBalancer(PS, token_weight=0.0, tier_cost=COSTS)
            balancer.update(_report("holder", device=4, host=8), now=0.0)
            balancer.update(_report("empty", device=4, host=8), now=0.0)
            _send(balancer, "holder", "p", PROMPT)
            if pushed_pages:
                _send(balancer, "holder", "q", [3] * (pushed_pages * PS))
            balancer.update(_report("holder", device=4, host=8, attention=attention), now=0.0)
            return balancer

        return make

    assert _saved_pages(setup(0)) == 4 + 4 * 0.5  # 4 device pages, then 4 in the host tier
    assert _saved_pages(setup(4)) == 8 * 0.5  # every page now in the host tier
    assert _saved_pages(setup(6)) == 6 * 0.5  # its tail is past device + host: gone
    assert _saved_pages(setup(12)) == 0  # all gone


def test_ranks_sharing_a_disk_tier_hit_each_others_pages_after_a_restart() -> None:
    def make(holder: str, restart: bool):  # type: ignore[no-untyped-def]
        def build(attention: int) -> PrefillBalancer:
            balancer = PrefillBalancer(PS, token_weight=0.0, tier_cost=COSTS)
            for worker, tier in (("computer", "T"), ("sharer", "T"), ("empty", "U")):
                balancer.update(_report(worker, device=2, disk=100, tier=tier), now=0.0)
            _send(balancer, "computer", "p", PROMPT)
            if restart:
                balancer.update(
                    LoadReport(worker="computer", incarnation="2", kv_pages_total=2, kv_disk_tier_id="T"), 0
                )
            balancer.update(_report(holder, device=2, disk=100, tier="T", attention=attention), now=0.0)
            return balancer

        return build

    assert _saved_pages(make("computer", False), "computer") == 2 + 6 * 0.25  # device, then disk
    assert _saved_pages(make("sharer", False), "sharer") == 8 * 0.25  # disk, shared
    assert _saved_pages(make("computer", True), "computer") == 8 * 0.25  # its pages survive a restart
    # a rank on another disk (same path on another node, say) holds nothing of it
    balancer = make("sharer", False)(0)
    assert balancer.pick(_request("x", PROMPT), ["empty", "sharer"], now=0.0) == "sharer"


def test_decode_keeps_a_conversation_together_within_the_slack() -> None:
    workers = ["decode/0/0", "decode/0/1"]
    first_turn = PROMPT
    second_turn = PROMPT + list(range(500, 500 + 4 * PS))

    def report(worker: str, used: int, running: int) -> LoadReport:
        return LoadReport(
            worker=worker, incarnation="1", kv_pages_used=used, kv_pages_total=1000, num_running=running
        )

    balancer = DecodeBalancer(PS, kv_slack=0.05, count_slack=2)
    balancer.update(report(workers[0], 100, 1), now=0.0)
    balancer.update(report(workers[1], 100, 0), now=0.0)
    assert balancer.pick(_request("t1", first_turn), workers, now=0.0) == workers[1]
    balancer.finished("t1", workers[1])
    # busier by two requests, still within the slack: the next turn comes back
    balancer.update(report(workers[0], 100, 0), now=1.0)
    balancer.update(report(workers[1], 100, 2), now=1.0)
    assert balancer.pick(_request("t2", second_turn), workers, now=1.0) == workers[1]
    balancer.finished("t2", workers[1])
    # three more than the least: capacity it needs, so the turn goes to the idle rank
    balancer.update(report(workers[1], 100, 3), now=2.0)
    assert balancer.pick(_request("t3", second_turn), workers, now=2.0) == workers[0]
    # and past the KV slack, the same
    fresh = DecodeBalancer(PS, kv_slack=0.05, count_slack=2)
    fresh.update(report(workers[0], 100, 0), now=0.0)
    fresh.update(report(workers[1], 100, 0), now=0.0)
    assert fresh.pick(_request("t1", first_turn), [workers[1]], now=0.0) == workers[1]
    fresh.finished("t1", workers[1])
    fresh.update(report(workers[1], 200, 0), now=1.0)
    assert fresh.pick(_request("t2", second_turn), workers, now=1.0) == workers[0]
