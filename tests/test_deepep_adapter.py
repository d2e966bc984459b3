"""The DeepEP adapter's testable parts: backend selection on CPU (torch all-to-all without DeepEP) and
the pure index bookkeeping between pair-level rows and DeepEP's token-level and masked layouts.

The DeepEP calls themselves are UNVERIFIED (DeepEP cannot be installed here) and not mocked.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist

from dsinfer.engine.args import EngineArgs
from dsinfer.parallel.deepep import (
    DeepEPGroup,
    compute_received_tokens,
    dequantize_fp8_rows,
    expand_received,
    is_token_in_rank,
    missing_buffer_api,
    pack_masked,
    pair_expert_ids,
    reduce_to_tokens,
    routed_pairs,
    split_expert_ids,
    token_send_plan,
    unpack_masked,
)
from dsinfer.parallel.deepep_layout import low_latency_qp_depth, qp_depth_to_set, round_slices
from dsinfer.parallel.ep import TorchEPGroup
from dsinfer.parallel.ep_select import deepep_unavailable, make_ep_group


def _expert(rows: torch.Tensor, slots: torch.Tensor, rank: int = 0, slots_per_rank: int = 0) -> torch.Tensor:
    """A stand-in expert whose output depends on the row and on which physical expert computed it."""
    physical = rank * slots_per_rank + slots
    return rows * (physical + 1).to(rows.dtype)[:, None] + physical.to(rows.dtype)[:, None]


def _reference(x: torch.Tensor, topk: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_j w[t, j] * expert_{topk[t, j]}(x[t]), pair by pair."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(topk.shape[1]):
            if topk[t, j] >= 0:
                out[t] += weights[t, j] * _expert(x[t : t + 1], topk[t, j : j + 1])[0]
    return out


def _routing(tokens: int, k: int, num_experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    topk = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(tokens)]).reshape(
        tokens, k
    )
    return topk.to(torch.int64), torch.rand(tokens, k, generator=g)


# --- selection ----------------------------------------------------------------------------------


@pytest.fixture
def gloo_world1(tmp_path: Path) -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_make_ep_group_is_torch_on_cpu(gloo_world1: None, caplog: pytest.LogCaptureFixture) -> None:
    for prefer in ("auto", "deepep", "torch"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="dsinfer.parallel"):
            group = make_ep_group(prefer=prefer, hidden=7168, num_local_experts=4)
        assert type(group) is TorchEPGroup
        assert (group.rank, group.size) == (0, 1)
        lines = [r.getMessage() for r in caplog.records if r.name == "dsinfer.parallel"]
        assert len(lines) == 1 and lines[0].startswith("ep backend: torch all-to-all (gloo, 1 ranks)")
        if prefer == "deepep":
            assert "no deepep (needs an NCCL group, not gloo)" in lines[0]
    with pytest.raises(ValueError, match="unknown EP backend"):
        make_ep_group(prefer="nccl")


def test_routed_pairs_over_torch_group(gloo_world1: None) -> None:
    group = make_ep_group(low_latency=True)
    x = torch.randn(7, 16)
    topk, weights = _routing(7, 3, 6, seed=1)
    out = routed_pairs(group, x, topk, weights, _expert, num_local_experts=6)
    torch.testing.assert_close(out, _reference(x, topk, weights))


def test_deepep_unavailable_reasons() -> None:
    ok = {"low_latency": False, "hidden": 7168, "num_local_experts": 9}
    assert deepep_unavailable("nccl", True, 32, **ok) is None
    assert deepep_unavailable("nccl", True, 4, **ok) is None
    assert deepep_unavailable("gloo", False, 32, **ok) == "needs an NCCL group, not gloo"
    assert deepep_unavailable("nccl", False, 32, **ok) == "needs CUDA"
    assert deepep_unavailable("nccl", True, 1, **ok) == "needs 2 or more ranks"
    assert "multiple of 8" in str(deepep_unavailable("nccl", True, 12, **ok))
    assert "needs hidden" in str(
        deepep_unavailable("nccl", True, 8, low_latency=False, hidden=None, num_local_experts=2)
    )
    assert deepep_unavailable("nccl", True, 144, low_latency=True, hidden=7168, num_local_experts=2) is None
    assert "hidden 64" in str(
        deepep_unavailable("nccl", True, 8, low_latency=True, hidden=64, num_local_experts=2)
    )


def test_missing_buffer_api() -> None:
    assert "Buffer is absent" in str(missing_buffer_api(ModuleType("deep_ep")))


# --- pure bookkeeping ---------------------------------------------------------------------------


def test_pair_expert_ids_round_trip() -> None:
    dest = torch.tensor([0, 2, 1, 2])
    slot = torch.tensor([3, 0, 1, 2])
    ids = pair_expert_ids(dest, slot, num_local_experts=4)
    assert ids.shape == (4, 1) and ids.dtype == torch.int64
    assert ids.flatten().tolist() == [3, 8, 5, 10]
    rank, local = split_expert_ids(torch.tensor([[3, -1], [8, 5]]), 4)
    assert rank.tolist() == [[0, -1], [2, 1]]
    assert local.tolist() == [[3, -1], [0, 1]]


def test_token_send_plan_by_hand() -> None:
    # 3 ranks x 2 slots; token 0 -> experts 0, 1 (both rank 0) and 5 (rank 2); token 1 -> 2, -1, 3 (rank 1)
    topk = torch.tensor([[0, 1, 5], [2, -1, 3]])
    weights = torch.tensor([[0.5, 0.25, 0.25], [0.625, 0.0, 0.375]])
    assert is_token_in_rank(topk, 2, 3).tolist() == [[True, False, True], [False, True, False]]
    token, rank, local_ids, w = token_send_plan(topk, weights, num_local_experts=2, num_ranks=3)
    assert rank.tolist() == [0, 1, 2] and token.tolist() == [0, 1, 0]  # once per destination rank
    assert local_ids.tolist() == [[0, 1, -1], [0, -1, 1], [-1, -1, 1]]
    assert w.tolist() == [[0.5, 0.25, 0.0], [0.625, 0.0, 0.375], [0.0, 0.0, 0.25]]


def test_expand_and_reduce_match_pair_weighted_sum() -> None:
    # one rank hosting every expert: the token-level receive side gives the pair-level answer
    x = torch.randn(5, 8)
    topk, weights = _routing(5, 3, 4, seed=2)
    topk[1, 2] = -1
    token, slot, weight = expand_received(topk, weights)
    assert token.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]
    torch.testing.assert_close(
        reduce_to_tokens(_expert(x[token], slot), token, weight, 5), _reference(x, topk, weights)
    )
    torch.testing.assert_close(
        compute_received_tokens(x, topk, weights, _expert), _reference(x, topk, weights)
    )


def test_token_level_layout_over_ranks_equals_pair_level() -> None:
    """Normal mode's data model, rank by rank in one process: send plans, receive grouped by source
    rank, expand + weighted reduce per rank, unweighted sum back at the source = the pair result."""
    ranks, slots, k, hidden = 4, 3, 4, 8
    xs, routes = [], []
    for src in range(ranks):
        xs.append(torch.randn(6 + src, hidden))
        routes.append(_routing(6 + src, k, ranks * slots, seed=10 + src))
    plans = [token_send_plan(topk, w, slots, ranks) for topk, w in routes]
    combined = [torch.zeros_like(x) for x in xs]
    for dst in range(ranks):
        parts = [(src, plan, plan[1] == dst) for src, plan in enumerate(plans)]
        recv_x = torch.cat([xs[src][plan[0][m]] for src, plan, m in parts])
        recv_ids = torch.cat([plan[2][m] for _, plan, m in parts])
        recv_w = torch.cat([plan[3][m] for _, plan, m in parts])
        assert (recv_ids >= 0).any(dim=1).all()  # a token goes only where it has an expert

        def local_expert(rows: torch.Tensor, local: torch.Tensor, dst: int = dst) -> torch.Tensor:
            return _expert(rows, local, dst, slots)

        y = compute_received_tokens(recv_x, recv_ids, recv_w, local_expert)
        start = 0
        for src, plan, m in parts:
            count = int(m.sum())
            combined[src].index_add_(0, plan[0][m], y[start : start + count])
            start += count
    for x, (topk, w), out in zip(xs, routes, combined, strict=True):
        torch.testing.assert_close(out, _reference(x, topk, w))


def test_masked_layout_round_trip() -> None:
    capacity, hidden = 5, 3
    recv_count = torch.tensor([2, 0, 5, 1], dtype=torch.int32)
    flat, slot = unpack_masked(recv_count, capacity)
    assert flat.tolist() == [0, 1, 10, 11, 12, 13, 14, 15]
    assert slot.tolist() == [0, 0, 2, 2, 2, 2, 2, 3]
    layout = torch.randn(4, capacity, hidden)
    rows = layout.reshape(-1, hidden)[flat]
    packed = pack_masked(rows, flat, 4, capacity)
    valid = torch.arange(capacity)[None, :] < recv_count[:, None]
    torch.testing.assert_close(packed[valid], layout[valid])
    assert (packed[~valid] == 0).all()
    empty_flat, empty_slot = unpack_masked(torch.zeros(3, dtype=torch.int32), capacity)
    assert empty_flat.numel() == 0 and empty_slot.numel() == 0


def test_dequantize_fp8_rows_any_scale_layout() -> None:
    x = torch.randn(6, 320) * 3
    pad = torch.nn.functional.pad(x, (0, 64)).view(6, 3, 128)  # 320 = 2.5 x 128: a partial last group
    scales = (pad.abs().amax(-1).clamp(min=1e-4) / 448.0).float()
    q = (pad / scales[..., None]).view(6, -1)[:, :320].to(torch.float8_e4m3fn)
    out = dequantize_fp8_rows(q, scales)
    torch.testing.assert_close(out, x, rtol=0.07, atol=1e-3)
    column_major = scales.t().contiguous().t()  # same values, DeepEP's TMA layout
    torch.testing.assert_close(dequantize_fp8_rows(q, column_major), out)


# --- sizes: per-token low-latency buffers, queue-pair depth, rounds, teardown -------------------


def test_qp_depth_for_tokens_per_rank() -> None:
    assert low_latency_qp_depth(128) == 258
    assert qp_depth_to_set(128, {}) is None  # DeepEP's default 1024 suffices
    assert qp_depth_to_set(511, {}) is None
    assert qp_depth_to_set(512, {}) == 1026  # max_num_seqs 256 with MTP
    assert qp_depth_to_set(512, {"NVSHMEM_QP_DEPTH": "4096"}) is None
    with pytest.raises(ValueError, match="NVSHMEM_QP_DEPTH=1024 is below the 1026"):
        qp_depth_to_set(512, {"NVSHMEM_QP_DEPTH": "1024"})


def test_round_slices_same_count_on_every_rank() -> None:
    assert round_slices(10, 4, 3) == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert round_slices(0, 4, 2) == [slice(0, 0), slice(0, 0)]
    with pytest.raises(ValueError, match="do not fit"):
        round_slices(13, 4, 3)


class _RecordingBuffer:
    """DeepEP's legacy Buffer as far as construction goes: records the sizes it is asked for."""

    made: ClassVar[list[dict]] = []
    hints: ClassVar[list[tuple]] = []
    destroyed = 0

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 num_qps_per_rank=24, explicitly_destroy=False):  # fmt: skip
        type(self).made.append(
            {
                "rdma": num_rdma_bytes,
                "ll": low_latency_mode,
                "qps": num_qps_per_rank,
                "explicit": explicitly_destroy,
            }
        )

    @staticmethod
    def get_low_latency_rdma_size_hint(tokens, hidden, ranks, experts):
        _RecordingBuffer.hints.append((tokens, hidden, ranks, experts))
        return tokens * hidden * 3 + 5

    def destroy(self):
        type(self).destroyed += 1

    get_dispatch_layout = dispatch = combine = low_latency_dispatch = low_latency_combine = destroy


def test_low_latency_buffer_sized_per_token(gloo_world1: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NVSHMEM_QP_DEPTH", raising=False)
    module = ModuleType("deep_ep")
    module.Buffer = _RecordingBuffer
    group = DeepEPGroup(
        None, module, hidden=7168, num_local_experts=8, low_latency=True, top_k=8, max_tokens_per_rank=512
    )
    # tokens, not tokens x top_k pairs: 512 rows of 7168, one rank, 8 experts
    assert _RecordingBuffer.hints[-1] == (512, 7168, 1, 8)
    made = _RecordingBuffer.made[-1]
    assert made["ll"] and made["qps"] == 8 and made["explicit"] and made["rdma"] % 128 == 0
    assert os.environ["NVSHMEM_QP_DEPTH"] == "1026"
    assert group._capacity == 512  # masked rows per local expert: R x T
    group.close()
    group.close()  # once only
    assert _RecordingBuffer.destroyed == 1


def test_engine_args_decode_tokens_per_step() -> None:
    assert EngineArgs().decode_tokens_per_step() == 256
    assert EngineArgs(speculative_mtp=True).decode_tokens_per_step() == 512
    assert EngineArgs(max_num_seqs=4096).decode_tokens_per_step() == 2048  # the step's token budget


def test_low_latency_fit_follows_the_step_agreement(
    gloo_world1: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether DeepEP's low-latency buffer takes a step is decided from the pool's agreed largest
    step (StepVotes.step_tokens), the same on every rank, not from each rank's own rows."""
    monkeypatch.delenv("NVSHMEM_QP_DEPTH", raising=False)
    module = ModuleType("deep_ep")
    module.Buffer = _RecordingBuffer
    group = DeepEPGroup(
        None, module, hidden=7168, num_local_experts=8, low_latency=True, max_tokens_per_rank=256
    )
    group.begin_step(256)
    assert group.fits_everywhere(3)
    group.begin_step(257)  # another rank's recompute prefill: every rank takes the torch all-to-all
    assert not group.fits_everywhere(3)
    group.close()


def test_runner_votes_the_step_tokens() -> None:
    from types import SimpleNamespace
    from typing import Any

    from dsinfer.engine.agreement import StepVotes, agree
    from dsinfer.engine.model_runner import ModelRunner

    runner: Any = SimpleNamespace(overlap=False)
    batch: Any = SimpleNamespace(num_tokens=300, seqs=[])
    votes = ModelRunner.vote(runner, batch, StepVotes(has_work=True))
    assert votes.step_tokens == 300 and votes.has_work

    def pool_max(tensor: torch.Tensor) -> torch.Tensor:  # another rank voted 512 tokens
        other = torch.tensor(
            [int(getattr(StepVotes(step_tokens=512), f)) for f in StepVotes.__dataclass_fields__]
        )
        return torch.maximum(tensor, other)

    assert agree(votes, pool_max).step_tokens == 512
