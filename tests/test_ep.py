"""Expert parallelism at engine level: pools of 1, 2 and 4 rank processes (gloo all-to-all), with
and without redundant experts, give the offline single-process engine's greedy tokens; each rank
holds only its experts; redundant slots receive tokens."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsinfer import LLM, SamplingParams
from dsinfer.base.processes import free_port
from harness.checkpoints import BuiltCheckpoint

pytestmark = pytest.mark.system

ENGINE = {"dtype": "float32", "kv_cache_memory": "8MiB", "max_num_batched_tokens": 48}
MAX_TOKENS = 8


def _prompts(count: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [
        torch.randint(2, 4000, (int(n),), generator=g).tolist()
        for n in torch.randint(3, 90, (count,), generator=g)
    ]


def run_pool(
    ckpt: BuiltCheckpoint | Path,
    world: int,
    tmp: Path,
    prompts: list[list[int]] | None = None,
    max_tokens: int = MAX_TOKENS,
    **engine: object,
) -> list[dict]:
    """Start ``world`` rank processes, ``prompts`` (default ``_prompts()``) dealt round-robin as
    p0, p1, ...; their results, rank by rank."""
    prompts = _prompts() if prompts is None else prompts
    init = f"tcp://127.0.0.1:{free_port()}"
    procs, outs = [], []
    try:
        for rank in range(world):
            out = tmp / f"rank{rank}-{world}-{time.time_ns()}.json"
            spec = {
                "rank": rank,
                "world": world,
                "init": init,
                "model": str(ckpt if isinstance(ckpt, Path) else ckpt.path),
                "engine": {**ENGINE, **engine},
                "prompts": {f"p{i}": p for i, p in enumerate(prompts) if i % world == rank},
                "max_tokens": max_tokens,
                "out": str(out),
            }
            procs.append(subprocess.Popen([sys.executable, "-m", "tests.fixtures.ep_rank", json.dumps(spec)]))
            outs.append(out)
        for p in procs:
            assert p.wait(timeout=240) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return [json.loads(o.read_text()) for o in outs]


@pytest.fixture(scope="module")
def expected(tiny_ckpt: BuiltCheckpoint) -> dict[str, list[int]]:
    llm = LLM(str(tiny_ckpt.path), **ENGINE)
    outs = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return {f"p{i}": o.outputs[0].token_ids for i, o in enumerate(outs)}


@pytest.mark.parametrize(("world", "redundant"), [(1, 0), (2, 0), (2, 2), (4, 0), (4, 4)])
def test_ep_pool_tokens_equal_single_process(
    tiny_ckpt: BuiltCheckpoint, expected: dict[str, list[int]], tmp_path: Path, world: int, redundant: int
) -> None:
    results = run_pool(tiny_ckpt, world, tmp_path, num_redundant_experts=redundant)
    tokens = {rid: t for r in results for rid, t in r["tokens"].items()}
    assert tokens == expected
    assert all(r["free_pages_ok"] for r in results)
    config = json.loads((tiny_ckpt.path / "config.json").read_text())
    num_experts = config["n_routed_experts"]
    slots_per_rank = (num_experts + redundant) // world
    expert_bytes = 3 * config["hidden_size"] * config["moe_intermediate_size"] * 4  # gate, up, down; fp32
    for r in results:
        # each rank holds exactly its slots' weights: slots_per_rank experts per MoE layer
        assert all(len(ids) == slots_per_rank for ids in r["local_experts"])
        assert r["expert_bytes"] == len(r["local_experts"]) * slots_per_rank * expert_bytes
    hosted = [
        set().union(*(set(r["local_experts"][layer]) for r in results))
        for layer in range(len(results[0]["local_experts"]))
    ]
    assert all(h == set(range(num_experts)) for h in hosted)
    if redundant:
        # the redundant slots (the replicas) received tokens
        for layer in range(len(results[0]["local_experts"])):
            slots = [
                (r["local_experts"][layer][i], r["slot_load"][layer][i])
                for r in results
                for i in range(slots_per_rank)
            ]
            totals: dict[int, int] = {}
            for e, count in slots:
                totals[e] = totals.get(e, 0) + count
            replicated = {e for e, _ in slots if sum(1 for x, _ in slots if x == e) > 1}
            assert replicated
            # every copy of a replicated expert that saw real traffic computed some of it
            busy = {e for e in replicated if totals[e] >= 10}
            assert all(count > 0 for e, count in slots if e in busy), (layer, slots)


def _hot_checkpoint(ckpt: BuiltCheckpoint, dest: Path) -> BuiltCheckpoint:
    """A copy whose router bias makes experts 0-2 hot in every MoE layer."""
    shutil.copytree(ckpt.path, dest)
    for shard in dest.glob("*.safetensors"):
        tensors = load_file(shard)
        for name, t in tensors.items():
            if name.endswith("e_score_correction_bias"):
                t[:3] += 2.0
        save_file(tensors, shard, metadata={"format": "pt"})
    return dataclasses.replace(ckpt, path=dest)


def test_online_rebalance_keeps_tokens_and_evens_the_load(tiny_ckpt: BuiltCheckpoint, tmp_path: Path) -> None:
    hot = _hot_checkpoint(tiny_ckpt, tmp_path / "hot")
    plain = run_pool(hot, 2, tmp_path, num_redundant_experts=2)
    moving = run_pool(hot, 2, tmp_path, num_redundant_experts=2, eplb_interval=4, eplb_min_gain=0.0)
    tokens = {rid: t for r in plain for rid, t in r["tokens"].items()}
    assert {rid: t for r in moving for rid, t in r["tokens"].items()} == tokens
    events = [r["rebalances"] for r in moving]
    assert all(len(e) >= 1 for e in events) and all(e[0]["swap_step"] is not None for e in events)
    assert events[0][0]["swap_step"] == events[1][0]["swap_step"]  # every rank swapped at the same step
    assert events[0][0]["balance_after"] < events[0][0]["balance_before"]
    # staged in pieces on the serving thread, then the placement changed
    assert all(e[0]["stage_pieces"] >= 1 and e[0]["stage_steps"] >= 1 for e in events)
    assert [r["local_experts"] for r in moving] != [r["local_experts"] for r in plain]

    def imbalance(per_rank: list[list[int]]) -> float:
        layers = list(zip(*per_rank, strict=True))
        return sum(max(layer) / (sum(layer) / len(layer)) for layer in layers if sum(layer)) / len(layers)

    # measured: pairs each rank computed per MoE layer, before the first swap and after the last
    before = imbalance([e[0]["received_before"] for e in events])
    after = imbalance([r["received"] for r in moving])
    assert after < before
    assert all(r["free_pages_ok"] for r in moving)


def test_one_agreement_all_reduce_per_step(tiny_ckpt: BuiltCheckpoint, tmp_path: Path) -> None:
    """Every per-step decision of a 2-rank pool (work or sleep, one or two micro-batches and their
    schedule, EPLB swap) rides one all-reduce per loop iteration (dsinfer/engine/agreement.py);
    the only other one is EPLB's window load, at the steps where the balancer checks (data at a
    step number every rank shares, not a decision)."""
    hot = _hot_checkpoint(tiny_ckpt, tmp_path / "hot")
    interval = 4
    results = run_pool(
        hot, 2, tmp_path, enable_overlap=True, overlap_min_tokens=0,
        num_redundant_experts=2, eplb_interval=interval, eplb_min_gain=0.0,
    )  # fmt: skip
    for r in results:
        assert r["two_micro_batch_steps"]["prefill"] > 0 and r["two_micro_batch_steps"]["decode"] > 0
        assert r["rebalances"] and r["rebalances"][0]["swap_step"] is not None  # a swap was agreed
        staging = [(e["step"], e["swap_step"] or 10**9) for e in r["rebalances"]]  # no checks meanwhile
        step = 0
        for count, stepped in r["iterations"]:
            step += stepped
            window_check = stepped and step % interval == 0 and not any(d < step <= w for d, w in staging)
            assert count == 1 + window_check, (step, count)
        assert r["iterations"][-1] == [1, False]  # the pool agreed to stop stepping: one all-reduce too
