"""The host-memory KV tier: pages the pool evicts are kept there by prefix key and served back.

A pool of 6 pages (64 tokens each) and prompts of 5 pages: the second prompt's pages evict three
of the first's four cached ones (its tail first), which the tier keeps; the first prompt again
hits one page in the pool and three in the tier (the last token is never covered) and answers as
it did and as an engine without the tier does (which recomputes those three), the host hits
counted in the engine's load report.
"""

from __future__ import annotations

import pytest
import torch

from dsinfer import LLM
from dsinfer.base.sampling_params import SamplingParams
from dsinfer.cache.host_tier import HostKVTier
from dsinfer.workers.role import load_report
from harness.checkpoints import BuiltCheckpoint

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_tier_keeps_the_most_recent_records_within_its_capacity() -> None:
    tier = HostKVTier(capacity_bytes=3 * 16 + 5, record_bytes=16)
    for i in range(4):
        tier.put(bytes([i]), torch.full((16,), i, dtype=torch.uint8))
    assert bytes([0]) not in tier and len(tier) == 3
    record = tier.get(bytes([1]))
    assert record is not None and int(record[0]) == 1
    tier.put(bytes([4]), torch.zeros(16, dtype=torch.uint8))  # 2 is now the least recent
    assert bytes([2]) not in tier and bytes([1]) in tier
    stats = tier.stats()
    assert (stats.pages, stats.bytes, stats.pages_written, stats.pages_read, stats.evictions) == (
        3,
        48,
        5,
        1,
        2,
    )
    with pytest.raises(ValueError, match="a record of 8 bytes, expected 16"):
        tier.put(b"x", torch.zeros(8, dtype=torch.uint8))
    off = HostKVTier(capacity_bytes=0, record_bytes=16)
    off.put(b"x", torch.zeros(16, dtype=torch.uint8))
    assert len(off) == 0


def _page_bytes(ckpt: BuiltCheckpoint) -> int:
    c = ckpt.config  # every layer's latent, float32, 64 tokens
    return c["num_hidden_layers"] * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 4 * 64


def _engine(ckpt: BuiltCheckpoint, host: str | int) -> LLM:
    page_bytes = _page_bytes(ckpt)
    return LLM(
        str(ckpt.path),
        dtype="float32",
        kv_cache_memory=6 * page_bytes,
        kv_host_cache_size=host,
        max_num_seqs=2,
    )


def _prompt(seed: int, vocab: int) -> list[int]:
    return torch.randint(2, vocab, (300,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_evicted_pages_come_back_from_the_host_tier(tiny_ckpt: BuiltCheckpoint) -> None:
    vocab = tiny_ckpt.config["vocab_size"]
    first, second = _prompt(1, vocab), _prompt(2, vocab)
    llm = _engine(tiny_ckpt, "64MiB")
    assert llm.engine.kv.num_pages == 6
    answer = llm.generate([first], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.generate([second], GREEDY, use_tqdm=False)
    stats = llm.engine.kv.stats
    assert stats.host_pages_written == 3 and stats.host_bytes == stats.host_pages_written * _page_bytes(
        tiny_ckpt
    )
    again = llm.generate([first], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == answer
    stats = llm.engine.kv.stats
    assert (stats.memory_hit_tokens, stats.host_hit_tokens) == (64, 192)
    load = llm.engine.load()
    assert load.host_hit_tokens == 192
    report = load_report("w", "i", load)  # what /metrics shows as tier="host"
    assert report.host_hit_tokens == 192
    host = report.kv_tiers["host"]
    # written: the first prompt's three pages, then three of the second's evicted for the loads
    loaded = (host["pages_loaded"], host["bytes_loaded"], host["pages_written"])
    assert loaded == (3, 3 * _page_bytes(tiny_ckpt), 6)
    assert host["load_seconds"] > 0 and host["bytes"] == stats.host_bytes

    cold = _engine(tiny_ckpt, 0)
    assert cold.engine.kv.host is None
    outs = cold.generate([first, second, first], GREEDY, use_tqdm=False)
    assert outs[2].outputs[0].token_ids == answer
    assert (cold.engine.kv.stats.memory_hit_tokens, cold.engine.kv.stats.host_hit_tokens) == (64, 0)


def test_no_prefix_cache_no_host_tier(tiny_ckpt: BuiltCheckpoint) -> None:
    llm = LLM(str(tiny_ckpt.path), dtype="float32", enable_prefix_caching=False, kv_host_cache_size="64MiB")
    assert llm.engine.kv.host is None
