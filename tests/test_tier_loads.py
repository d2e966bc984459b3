"""Loads from the tiers below the pool run ahead of the step (dsinfer/cache/tier_loader.py).

The manager: ``prefetch`` takes pages and reads them on the loader's thread; ``finish_loads``
caches them tagged with their tier, which the next match counts; a rejected file frees its page.
The engine: while a disk answers only when the test lets it, the steps go on (another request
decodes, the step never waits), and once the loads land the waiting request answers as a cold
engine does with every one of its cached pages counted as a disk hit. Over a long run of
distinct prompts every tier stays within its bound, and so does the process's memory.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from dsinfer import LLM
from dsinfer.base.sampling_params import SamplingParams
from dsinfer.cache.host_tier import HostKVTier
from harness.checkpoints import BuiltCheckpoint
from harness.metrics import RssSampler, rss_mib
from tests.test_kv_manager import PAGE_BYTES, PS, _disk, _manager, _run

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _settle(mgr, deadline: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + deadline
    while mgr.loads_pending:
        assert time.monotonic() < end, "tier loads did not finish"
        mgr.wait_for_loads(0.05)
        mgr.finish_loads()


def test_prefetch_loads_disk_and_host_pages_then_counts_their_tiers(tmp_path: Path) -> None:
    tokens = list(range(4 * PS + 1))
    writer = _manager(8, disk=_disk(tmp_path))
    pages = _run(writer, tokens, seed=4)
    writer.flush()
    expected = [writer.pool.read_page(p) for p in pages[:4]]
    writer.close()

    host = HostKVTier(capacity_bytes=8 * PAGE_BYTES, record_bytes=PAGE_BYTES)
    host.put(b"unrelated", torch.zeros(PAGE_BYTES, dtype=torch.uint8))
    mgr = _manager(8, disk=_disk(tmp_path), host=host)
    keys = mgr.prefetch(tokens)
    assert keys is not None and len(keys.keys) == 4
    assert mgr.loads_pending and mgr.num_available_pages() == 4  # four pages held by the loads
    _settle(mgr)
    assert not mgr.loading(keys) and mgr.num_available_pages() == 8  # cached, evictable
    assert mgr.prefetch(tokens) is None  # everything is in the pool now
    match = mgr.match_prefix(tokens, load=False)
    assert match.origins == ["disk"] * 4 and match.num_tokens == 4 * PS
    assert [torch.equal(mgr.pool.read_page(p), e) for p, e in zip(match.pages, expected, strict=True)] == [
        True
    ] * 4
    mgr.abandon(match)  # not used: counted again as disk hits when matched next
    again = mgr.match_prefix(tokens, load=False)
    assert again.origins == ["disk"] * 4 and mgr.match_prefix(tokens, load=False).origins == ["memory"] * 4
    stats = mgr.stats
    assert (stats.disk_loads.pages, stats.disk_loads.bytes) == (4, 4 * PAGE_BYTES)
    assert stats.disk_loads.seconds > 0 and stats.disk_hit_tokens == 4 * PS


def test_a_rejected_file_frees_its_page_and_ends_the_prefix(tmp_path: Path) -> None:
    tokens = list(range(3 * PS + 1))
    writer = _manager(8, disk=_disk(tmp_path))
    _run(writer, tokens, seed=5)
    writer.close()
    for path in tmp_path.glob("[0-9a-f]*"):
        path.write_bytes(path.read_bytes()[:-3] + b"bad")
    mgr = _manager(8, disk=_disk(tmp_path))
    assert mgr.prefetch(tokens) is not None
    _settle(mgr)
    assert mgr.num_available_pages() == 8 and mgr.num_cached_pages() == 0
    assert mgr.match_prefix(tokens, load=False).pages == []
    assert mgr.stats.disk_files_rejected == 3 and mgr.stats.disk_loads.pages == 0


def test_loads_in_flight_are_capped(tmp_path: Path) -> None:
    tokens = list(range(6 * PS + 1))
    writer = _manager(8, disk=_disk(tmp_path))
    _run(writer, tokens)
    writer.close()
    mgr = _manager(8, disk=_disk(tmp_path))
    first = mgr.prefetch(tokens)
    assert first is not None and len(first.keys) == mgr.max_loading_pages == 4
    _settle(mgr)
    rest = mgr.prefetch(tokens)  # asked again once done: the rest of the prefix
    assert rest is not None and len(rest.keys) == 2
    _settle(mgr)
    assert mgr.match_prefix(tokens, load=False).origins == ["disk"] * 6


def test_a_slow_disk_never_holds_up_the_step(
    tiny_ckpt: BuiltCheckpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vocab = tiny_ckpt.config["vocab_size"]
    gen = torch.Generator().manual_seed(3)
    prompt, other = (torch.randint(2, vocab, (300,), generator=gen).tolist() for _ in range(2))
    answer = LLM(str(tiny_ckpt.path), dtype="float32").generate([prompt], GREEDY, use_tqdm=False)
    directory = str(tmp_path / "kv")
    writer = LLM(str(tiny_ckpt.path), dtype="float32", kv_disk_cache_dir=directory)
    writer.generate([prompt], GREEDY, use_tqdm=False)
    writer.engine.kv.flush()

    engine = LLM(
        str(tiny_ckpt.path), dtype="float32", kv_disk_cache_dir=directory, kv_host_cache_size=0
    ).engine
    disk = engine.kv.disk
    assert disk is not None
    gate, read = threading.Event(), disk.read

    def read_when_let(key: bytes) -> torch.Tensor | None:  # a disk that answers when the test says
        assert gate.wait(60), "the test never opened the gate"
        return read(key)

    monkeypatch.setattr(disk, "read", read_when_let)
    engine.add_request("other", other, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    engine.step()
    engine.add_request("hit", prompt, GREEDY)
    for _ in range(6):
        engine.step()
    assert engine.kv.loads_pending and [s.request_id for s in engine.scheduler.running] == ["other"]
    assert engine.scheduler.running[0].num_output_tokens >= 6
    gate.set()
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
    assert outputs["hit"].outputs[0].token_ids == answer[0].outputs[0].token_ids
    stats = engine.kv.stats
    assert (stats.disk_hit_tokens, stats.disk_loads.pages) == (4 * 64, 4)


def test_tiers_stay_within_their_bounds_over_a_long_replay(
    tiny_ckpt: BuiltCheckpoint, tmp_path: Path
) -> None:
    """300 distinct prompts of four pages through a pool of 16 pages, a 2 MiB host tier and a
    4 MiB disk tier: about 43 MiB of pages pass through both. Each tier holds at most its bound,
    having evicted, and the process's resident memory (sampled every 50 ms) grows by less than
    half of what passed through."""
    c = tiny_ckpt.config
    page_bytes = c["num_hidden_layers"] * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 4 * 64
    directory = tmp_path / "kv"
    llm = LLM(
        str(tiny_ckpt.path),
        dtype="float32",
        kv_cache_memory=16 * page_bytes,
        kv_host_cache_size="2MiB",
        kv_disk_cache_dir=str(directory),
        kv_disk_cache_size="4MiB",
        max_num_seqs=4,
    )
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, c["vocab_size"], (4 * 64 + 1,), generator=gen).tolist() for _ in range(300)]
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(prompts[:20], one, use_tqdm=False)
    baseline = sum(rss_mib([os.getpid()]).values())
    with RssSampler(lambda: [os.getpid()], interval=0.05) as sampler:
        for start in range(20, 300, 40):
            llm.generate(prompts[start : start + 40], one, use_tqdm=False)
    llm.engine.kv.flush()
    stats = llm.engine.kv.stats
    passed_through = 300 * 4 * page_bytes / 2**20
    assert stats.host_bytes <= 2 * 2**20 and stats.host_evictions > 0
    on_disk = sum(p.stat().st_size for p in directory.glob("[0-9a-f]*"))
    assert on_disk <= 4 * 2**20 and stats.disk_evictions > 0
    assert sampler.peak_mib - baseline < passed_through / 2, (sampler.peak_mib, baseline, passed_through)
