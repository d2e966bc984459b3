"""The soak drill, three minutes of it: steady streams on the all-in-one server (PD, 2 prefill
pools, 2 decode pools of EP2) while a rank, a whole pool and the gateway are killed and a pool is
drained, in turn. No request may end with other text than its undisturbed run's, none may hang,
every fault is recovered from, and no KV page is held once the load is over; the only errors
allowed are the gateway's own death as a client sees it (its connection drops, or no gateway
listens until it is back)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.server import serve
from harness.soak import FAULTS, TOPOLOGY, SoakPlan, run_soak

pytestmark = pytest.mark.system

# the gateway's death as a client sees it: its connection went down with the gateway, or a new
# one found no gateway listening through all of the client's retries (its restart took longer)
DROPPED = ("RemoteProtocolError", "ReadError", "ConnectError")


def test_three_minute_soak_loses_nothing(tmp_path: Path) -> None:
    plan = SoakPlan(duration=180.0, rate=1.0, fault_every=15.0, max_tokens=16, prompts=16, hang_after=120.0)
    said: list[str] = []
    with serve(TOPOLOGY, tmp_path, startup_timeout=300) as server:
        result = run_soak(server, plan, said.append)
    verdicts = result.verdicts()
    assert verdicts["different"] == 0, [o.why for o in result.outcomes if o.verdict == "different"]
    assert verdicts["hung"] == 0
    assert verdicts["identical"] >= 0.9 * len(result.outcomes), verdicts
    unexplained = [o for o in result.outcomes if o.verdict == "error" and not o.why.startswith(DROPPED)]
    assert not unexplained, (
        [f"sent at {o.sent:.1f} s, {o.attempts} attempts: {o.why}" for o in unexplained],
        [f"{f.kind} -> {f.target} at {f.at:.1f} s, ready after {f.recovered_after}" for f in result.faults],
    )
    assert {f.kind for f in result.faults} == set(FAULTS), [vars(f) for f in result.faults]
    assert all(f.recovered_after is not None for f in result.faults)
    assert result.kv_after == {}, result.kv_after
