"""Mooncake-format traces (harness/traces.py) on the committed reduced conversation trace: the
share an unbounded prefix cache serves, LRU caches bounded by it and growing with their size, and
replay prompts that share exactly the prefixes the trace's block hashes share."""

from __future__ import annotations

import json
from pathlib import Path

from harness.aiperf import summarise, write_mooncake_trace
from harness.traces import TraceRequest, ideal_hit_share, load_trace, lru_hit_share, replay_prompts, thin

TRACE = Path(__file__).resolve().parents[1] / "benchmarks/data/mooncake/conversation_trace_20min.jsonl"


def test_hit_shares_of_the_committed_trace() -> None:
    requests = load_trace(TRACE)
    assert len(requests) == 3658
    ideal = ideal_hit_share(requests)
    assert round(ideal, 4) == 0.3236  # NOTICE.md quotes it
    shares = [lru_hit_share(requests, capacity) for capacity in (500, 4000, 16000, 10**9)]
    assert shares == sorted(shares) and shares[-1] == ideal


def test_hand_made_trace() -> None:
    requests = [
        TraceRequest(0, 1024, 1, (1, 2)),
        TraceRequest(1, 1500, 1, (1, 2, 3)),  # two blocks cached: 1,024 of 1,500
        TraceRequest(2, 600, 1, (4, 2)),  # block 2 alone is no prefix: nothing
    ]
    assert ideal_hit_share(requests) == 1024 / (1024 + 1500 + 600)
    assert lru_hit_share(requests, capacity=1) == 0.0


def test_replay_prompts_keep_the_sharing() -> None:
    requests = [
        TraceRequest(0, 1024, 1, (7, 8)),
        TraceRequest(1, 1300, 1, (7, 8, 9)),
        TraceRequest(2, 100, 1, (9,)),
    ]
    a, b, c = replay_prompts(requests, block_tokens=8, vocab=range(10, 300))
    assert (len(a), len(b), len(c)) == (16, 21, 2)  # lengths scaled by 8/512, rounded up
    assert b[:16] == a and c == b[16:18]  # same hash id, same tokens
    assert all(10 <= t < 300 for t in a + b + c)
    assert replay_prompts(requests, 8, range(10, 300)) == [a, b, c]  # deterministic


def test_thinning_keeps_whole_prefix_trees() -> None:
    requests = [r for r in load_trace(TRACE) if r.timestamp_ms < 600_000]
    kept = thin(requests, keep=8)
    assert kept == thin(requests, keep=8) and set(kept) < set(requests)
    assert 0.08 < len(kept) / len(requests) < 0.2
    # what the kept requests share stays: the share allowed moves by a few points, not to 0
    assert abs(ideal_hit_share(kept) - ideal_hit_share(requests)) < 0.05


def test_mooncake_trace_for_aiperf(tmp_path: Path) -> None:
    """What aiperf replays: timestamps from zero at the speed-up, lengths scaled to 64-token blocks
    and cut to the context, only the hash ids the cut prompt still covers."""
    requests = [
        TraceRequest(1000, 1300, 99, (1, 2, 3)),  # 1300 tokens at 512 per block -> 163 at 64
        TraceRequest(3000, 40_000, 99, tuple(range(100, 179))),  # cut to 256 tokens: 4 blocks
    ]
    path = tmp_path / "trace.jsonl"
    write_mooncake_trace(requests, path, block_tokens=64, limit=256, max_tokens=4, speedup=2.0)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [
        {"timestamp": 0, "input_length": 163, "output_length": 4, "hash_ids": [1, 2, 3]},
        {"timestamp": 1000, "input_length": 256, "output_length": 4, "hash_ids": [100, 101, 102, 103]},
    ]


def test_aiperf_summary() -> None:
    data = {
        "request_count": {"unit": "requests", "avg": 114},
        "error_request_count": {"unit": "requests", "avg": 2},
        "benchmark_duration": {"unit": "sec", "avg": 300.5},
        "request_throughput": {"unit": "requests/sec", "avg": 0.38},
        "time_to_first_token": {"unit": "ms", "p50": 650.0, "p90": 3100.0},
    }
    assert summarise(data) == {
        "requests": 116,
        "failed": 2,
        "seconds": 300.5,
        "requests_per_s": 0.38,
        "ttft_p50_s": 0.65,
        "ttft_p90_s": 3.1,
    }
