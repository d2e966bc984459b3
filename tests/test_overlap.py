"""Two-micro-batch overlap in EP pools: the same greedy tokens as one micro-batch and as the single
process engine, with two micro-batches forced in prefill and decode steps on every rank; the
ranks' Chrome traces follow DeepSeek's published per-layer orders, and each micro-batch's
dispatch/combine is posted before a chunk of the other and awaited after it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsinfer import LLM, SamplingParams
from dsinfer.base.trace import Tracer, load_trace
from dsinfer.engine.args import EngineArgs
from dsinfer.engine.engine import LLMEngine
from dsinfer.engine.forward import balanced_split
from dsinfer.model.batch import ForwardBatch
from dsinfer.model.overlap import DECODE, PREFILL, MicroBatch, forward_two
from harness.checkpoints import BuiltCheckpoint
from tests.test_ep import ENGINE, MAX_TOKENS, _prompts, run_pool

pytestmark = pytest.mark.system

OVERLAP = {"enable_overlap": True, "overlap_min_tokens": 0}

# the published compute orders of one layer slot (shared/reference/kernel-apis.md)
PUBLISHED = {
    "prefill": "ATTN(1) SHARED(0) ATTN(0) MLP(1) MLP(0) SHARED(1)",
    "decode": "SHARED(0) ATTN-0(1) MLP(0) ATTN-1(1) SHARED(1) ATTN-0(0) MLP(1) ATTN-1(0)",
}
# chunks of micro-batch 0 that belong to the previous layer in a slot (0 trails 1 by them)
TRAILING = {"prefill": {"SHARED(0)"}, "decode": {"SHARED(0)", "MLP(0)"}}


def expected_chunks(order: str, num_layers: int) -> list[str]:
    """Chunk names of one forward: the published slot for every layer, pipelined across layers;
    after the last layer decode's ATTN-0 finishes the last combine instead (FINISH)."""
    names = []
    for slot in range(num_layers + 1):
        for chunk in PUBLISHED[order].split():
            layer = slot - 1 if chunk in TRAILING[order] else slot
            if order == "decode" and chunk.startswith("ATTN-0") and layer == num_layers:
                names.append(f"FINISH{chunk[-3:]} L{num_layers - 1}")
            elif 0 <= layer < num_layers:
                names.append(f"{chunk} L{layer}")
    return names


@pytest.fixture(scope="module")
def single(tiny_ckpt: BuiltCheckpoint) -> dict[str, list[int]]:
    llm = LLM(str(tiny_ckpt.path), **ENGINE)
    outs = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return {f"p{i}": o.outputs[0].token_ids for i, o in enumerate(outs)}


@pytest.fixture(scope="module")
def traced(tiny_ckpt: BuiltCheckpoint, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    """A 2-rank pool with overlap forced and traces on."""
    tmp = tmp_path_factory.mktemp("overlap2")
    return run_pool(tiny_ckpt, 2, tmp, **OVERLAP, trace_dir=str(tmp / "trace")), tmp / "trace"


def _tokens(results: list[dict]) -> dict[str, list[int]]:
    return {rid: t for r in results for rid, t in r["tokens"].items()}


def _assert_both_schedules(results: list[dict]) -> None:
    for r in results:
        steps = r["two_micro_batch_steps"]
        assert steps["prefill"] > 0 and steps["decode"] > 0, steps


def test_two_ranks_same_tokens_as_one_micro_batch_and_single_process(
    tiny_ckpt: BuiltCheckpoint, single: dict[str, list[int]], traced: tuple[list[dict], Path], tmp_path: Path
) -> None:
    results, _ = traced
    _assert_both_schedules(results)
    assert _tokens(results) == single
    plain = run_pool(tiny_ckpt, 2, tmp_path)
    assert all(r["two_micro_batch_steps"] == {"prefill": 0, "decode": 0} for r in plain)
    assert _tokens(plain) == single
    assert all(r["free_pages_ok"] for r in results)


def test_four_ranks_same_tokens_with_redundant_experts_and_mtp(
    tiny_ckpt: BuiltCheckpoint, single: dict[str, list[int]], tmp_path: Path
) -> None:
    results = run_pool(tiny_ckpt, 4, tmp_path, **OVERLAP, num_redundant_experts=4, speculative_mtp=True)
    _assert_both_schedules(results)
    assert _tokens(results) == single
    assert all(r["free_pages_ok"] for r in results)


def test_traces_follow_the_published_orders_with_comm_in_flight_across_chunks(
    tiny_ckpt: BuiltCheckpoint, traced: tuple[list[dict], Path]
) -> None:
    _, trace_dir = traced
    config = json.loads((tiny_ckpt.path / "config.json").read_text())
    num_layers = config["num_hidden_layers"]
    num_moe = num_layers - config["first_k_dense_replace"]
    files = sorted(trace_dir.glob("trace-rank*.json"))
    assert len(files) == 2
    for path in files:
        events = load_trace(path)
        assert {e["pid"] for e in events} == {int(path.name.split("-")[1].removeprefix("rank"))}
        seen, spanned, total = set(), {"prefill": 0, "decode": 0}, {"prefill": 0, "decode": 0}
        for step in sorted({e["args"]["step"] for e in events}):
            in_step = [e for e in events if e["args"]["step"] == step]
            chunks = sorted((e for e in in_step if e["cat"] == "chunk"), key=lambda e: e["ts"])
            if not chunks:
                continue
            order = chunks[0]["args"]["order"]
            seen.add(order)
            assert [e["name"] for e in chunks] == expected_chunks(order, num_layers), (path, step)
            assert all(e["tid"] == "compute" for e in chunks)
            comms = [e for e in in_step if e["cat"] == "comm"]
            assert all(e["tid"] == "comm" for e in comms)
            # every MoE layer's dispatch and combine of each micro-batch, traced once
            assert len(comms) == 2 * 2 * num_moe
            waits = {e["name"].removeprefix("wait "): e for e in in_step if e["cat"] == "wait"}
            for comm in comms:
                others = [c for c in chunks if c["args"]["mb"] != comm["args"]["mb"]]
                if comm["ts"] > max(c["ts"] for c in others):
                    continue  # posted after the other micro-batch's last chunk (the epilogue)
                total[order] += 1
                # the schedule runs a whole chunk of the other micro-batch between posting a
                # transfer and waiting for it; how much of the transfer that hides is timing,
                # measured by benchmarks/overlap.py
                waited = waits[comm["name"]]["ts"]
                spanned[order] += any(comm["ts"] <= c["ts"] and c["ts"] + c["dur"] <= waited for c in others)
        assert seen == {"prefill", "decode"}
        assert spanned == total and all(total[order] > 0 for order in seen), (spanned, total)


def _fresh_batch(lens: list[int], first_page: int, page_size: int) -> tuple[torch.Tensor, ForwardBatch]:
    """Prompts of ``lens`` tokens, one page each from ``first_page`` on; deterministic ids."""
    ids = [(7 * i + 11 * (first_page + n)) % 4000 + 2 for n, length in enumerate(lens) for i in range(length)]
    slots = [(first_page + n) * page_size + i for n, length in enumerate(lens) for i in range(length)]
    return torch.tensor(ids), ForwardBatch(
        positions=torch.tensor([i for length in lens for i in range(length)]),
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([[first_page + n] for n in range(len(lens))], dtype=torch.int32),
        q_lens=list(lens),
        kv_lens=list(lens),
    )


def _decode_batch(lens: list[int], first_page: int, page_size: int) -> tuple[torch.Tensor, ForwardBatch]:
    """One more token for each of those prompts (the absorbed path)."""
    return torch.tensor([5 + first_page + n for n in range(len(lens))]), ForwardBatch(
        positions=torch.tensor(lens),
        slot_mapping=torch.tensor([(first_page + n) * page_size + length for n, length in enumerate(lens)]),
        block_tables=torch.tensor([[first_page + n] for n in range(len(lens))], dtype=torch.int32),
        q_lens=[1] * len(lens),
        kv_lens=[length + 1 for length in lens],
        num_absorbed=len(lens),
    )


def test_two_micro_batches_in_process_equal_one(tiny_ckpt: BuiltCheckpoint) -> None:
    """Without EP (completed transfers) the schedules compute what the one-batch forward computes,
    and the layer hook fires once per layer after both micro-batches wrote its latent cache."""
    engine = LLMEngine(EngineArgs(model=str(tiny_ckpt.path), dtype="float32", kv_cache_memory="8MiB"))
    model, caches, page = engine.model, engine.kv.pool.caches, engine.kv.page_size
    lens = [5, 9, 3]
    for order, make in ((PREFILL, _fresh_batch), (DECODE, _decode_batch)):
        ids, whole = make(lens, 1, page)
        reference = model(ids, whole, caches)
        ids0, mb0 = make(lens[:1], 1, page)
        ids1, mb1 = make(lens[1:], 2, page)
        mbs = (MicroBatch(ids0, mb0), MicroBatch(ids1, mb1))
        written: list[int] = []
        forward_two(model, mbs, caches, order, after_layer=written.append)
        assert written == list(range(model.config.num_hidden_layers))
        hidden = torch.cat([mb.hidden for mb in mbs if mb.hidden is not None])
        torch.testing.assert_close(hidden, reference, rtol=1e-5, atol=1e-5)
        # an empty micro-batch (a rank with one sequence) runs its chunks without tokens
        lone = (MicroBatch(ids, whole), MicroBatch(torch.empty(0, dtype=torch.int64), None))
        forward_two(model, lone, caches, order)
        torch.testing.assert_close(lone[0].hidden, reference, rtol=1e-5, atol=1e-5)
        assert lone[1].hidden is not None and lone[1].hidden.shape == (0, model.config.hidden_size)
    engine.close()


def test_balanced_split() -> None:
    assert balanced_split([1, 1]) == 1
    assert balanced_split([100, 1, 1, 1]) == 1
    assert balanced_split([1, 1, 1, 100]) == 3
    assert balanced_split([3, 3, 3, 3, 3, 3]) == 3
    with pytest.raises(ValueError):
        balanced_split([5])


def test_trace_file_is_valid_json_after_every_flush(tmp_path: Path) -> None:
    tracer = Tracer(tmp_path / "t" / "trace-rank3.json", 3, flush_every=2)
    for step in range(5):
        tracer.add(f"ATTN(0) L{step}", "compute", 1000 * step, 1000 * step + 500, cat="chunk", mb=0)
        tracer.end_step()
        # appended every second step, and readable then
        assert len(load_trace(tracer.path)) == 2 * ((step + 1) // 2)
    tracer.close()
    events = load_trace(tracer.path)
    assert [e["args"]["step"] for e in events] == list(range(5))
    assert {(e["pid"], e["tid"], e["ph"]) for e in events} == {(3, "compute", "X")}
    assert events[1]["ts"] == 1.0 and events[1]["dur"] == 0.5  # microseconds
