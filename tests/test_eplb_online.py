"""Online EPLB on one process: expert staging in pieces is bit-identical to loading, and the
balancer stages piece by piece across step boundaries under its per-step budget, then swaps.
(Pools of rank processes rebalancing while they serve: tests/test_ep.py.)"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dsinfer.base.presets import presets_dir
from dsinfer.engine import expert_balancer
from dsinfer.engine.expert_balancer import OnlineExpertBalancer
from dsinfer.model.loader import LoadedModel, load_model
from dsinfer.model.moe import Experts, MoE
from dsinfer.ops import select_ops
from dsinfer.parallel.ep import DispatchHandle, EPGroup
from dsinfer.parallel.placement import ExpertPlacement
from harness.checkpoints import FP8_OVERRIDES, BuiltCheckpoint, build_checkpoint

OPS = select_ops(torch.device("cpu"))
FP8_OPS = replace(OPS, supports_fp8_gemm=True)
LAYER = "model.layers.1.mlp.experts"
MTP = "mtp_layers.0.mlp.experts"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _same(a: Experts, b: Experts) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(
        pa[k].dtype == pb[k].dtype and torch.equal(_bits(pa[k]), _bits(pb[k])) for k in pa
    )


def _experts(loaded: LoadedModel, name: str) -> Experts:
    module = loaded.model.get_submodule(name)
    assert isinstance(module, Experts)
    return module


def _fp8_preset(tmp: Path) -> Path:
    """The tiny preset (moe_intermediate_size 128: experts stay FP8) with DeepSeek's FP8 config."""
    shutil.copytree(presets_dir() / "tiny", tmp)
    config = json.loads((tmp / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (tmp / "config.json").write_text(json.dumps(config))
    return tmp


@pytest.mark.parametrize(
    "kind", ["dummy", "dummy-fp8", "checkpoint", "checkpoint-fp8", "checkpoint-fp8-dequantized"]
)
def test_staging_in_pieces_matches_loading(
    kind: str, tiny_ckpt: BuiltCheckpoint, tiny_ckpt_fp8: BuiltCheckpoint, tmp_path: Path
) -> None:
    ops = OPS
    if kind == "dummy":
        path: str | Path = "tiny"
    elif kind == "dummy-fp8":
        path, ops = _fp8_preset(tmp_path / "tiny-fp8"), FP8_OPS
    elif kind == "checkpoint":
        path = tiny_ckpt.path
    elif kind == "checkpoint-fp8":  # moe_intermediate_size 128: experts kept FP8, 2 scale blocks per w13
        path = build_checkpoint(
            tmp_path / "fp8", {**FP8_OVERRIDES, "moe_intermediate_size": 128}, fp8=True
        ).path
        ops = FP8_OPS
    else:  # moe_intermediate_size 160: experts dequantized, a partial 128-row block
        path = tiny_ckpt_fp8.path
    held_ids, new_ids = [0, 1, 2, 3], [5, 0, 7, 3]  # 0 and 3 are copied from the held module
    fmt = "dummy" if kind.startswith("dummy") else "safetensors"
    held = load_model(path, ops, load_format=fmt, expert_ids=held_ids)
    kept_fp8 = kind in ("dummy-fp8", "checkpoint-fp8")
    assert _experts(held, LAYER).w13.dtype == (torch.float8_e4m3fn if kept_fp8 else torch.float32)
    want = load_model(path, ops, load_format=fmt, expert_ids=new_ids)
    wanted = {LAYER: new_ids, MTP: new_ids[::-1]}
    staging = held.experts.stage(wanted, {LAYER: _experts(held, LAYER)}, piece_bytes=1)
    projections = 3 * (len(new_ids) + len(new_ids))
    # 1 byte: one 128-row block per piece, so tensors over 128 rows come in several pieces
    # (the checkpoint's and the copied ones; a drawn dummy tensor is one piece)
    assert staging.total > projections or (kind == "checkpoint" and staging.total == projections)
    count = 1
    while staging.fill_next():
        count += 1
    assert count == staging.total and staging.pieces_left == 0
    assert _same(staging.modules[LAYER], _experts(want, LAYER))
    assert _same(
        staging.modules[MTP], _experts(load_model(path, ops, load_format=fmt, expert_ids=new_ids[::-1]), MTP)
    )
    assert _same(held.experts.build(LAYER, new_ids), _experts(want, LAYER))


class OneRankOfTwo(EPGroup):
    """Rank 0 of a pool of 2 whose collectives see only this rank's numbers: enough for the
    balancer's decisions, which never run a forward here."""

    rank, size = 0, 2

    def dispatch(
        self, x: torch.Tensor, dest_rank: torch.Tensor, local_slot: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        raise NotImplementedError

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        raise NotImplementedError

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return tensor


def _shifted(load: dict[int, list[float]], current: ExpertPlacement) -> ExpertPlacement:
    """A policy: every other slot of rank 0 trades experts with the same slot of rank 1 (where
    neither rank would then host an expert twice), so rank 0 keeps some experts, gets others."""
    per_rank = current.slots_per_rank
    layers = {}
    for layer, slots in current.layers.items():
        new = list(slots)
        for i in range(0, per_rank, 2):
            a, b = new[i], new[per_rank + i]
            if b not in new[:per_rank] and a not in new[per_rank:]:
                new[i], new[per_rank + i] = b, a
        layers[layer] = tuple(new)
    return replace(current, layers=layers)


def _boundary(balancer: OnlineExpertBalancer) -> None:
    """One step boundary of rank 0 in a pool whose agreement sees only this rank's vote."""
    balancer.before_step(balancer.vote_staging())


def _pool_model() -> LoadedModel:
    return load_model("tiny", OPS, num_mtp_layers=0, ep_group=OneRankOfTwo(), num_redundant_experts=2)


def test_balancer_stages_one_piece_per_step_with_no_budget_then_swaps() -> None:
    loaded = _pool_model()
    moes = [m for m in loaded.model.modules() if isinstance(m, MoE)]
    old = loaded.model.ep.placement
    balancer = OnlineExpertBalancer(
        loaded.model, loaded.experts, interval=2, min_gain=0.0, stage_budget=0.0, policy=_shifted
    )
    _boundary(balancer)
    _boundary(balancer)  # step 2: the decision
    assert len(balancer.history) == 1
    event, pending = balancer.history[0], balancer._pending
    assert pending is not None and event.stage_pieces == 0
    total = pending.staging.total
    assert total == 3 * len(moes) * old.slots_per_rank  # every layer changes; dummy: one piece per projection
    for piece in range(1, total + 1):
        _boundary(balancer)
        assert event.stage_pieces == piece and event.swap_step is None  # one piece, then the step goes on
    _boundary(balancer)  # no rank (this one) votes staging any more: the pool swaps at this boundary
    assert event.swap_step == 2 + total + 1 and event.stage_steps == total
    new = _shifted({}, old)
    assert loaded.model.ep.placement == new
    fresh = load_model("tiny", OPS, num_mtp_layers=0, ep_group=OneRankOfTwo(), placement=new)
    fresh_moes = [m for m in fresh.model.modules() if isinstance(m, MoE)]
    for moe, want in zip(moes, fresh_moes, strict=True):
        assert moe.ep is not None and moe.ep.placement == new
        assert moe.experts.expert_ids == new.local_experts(moe.layer_id, 0)
        assert _same(moe.experts, want.experts)
        assert torch.equal(moe.replica_slots, want.replica_slots)
    # the replaced weights (w13 and w2 of every layer) are freed one per later boundary (budget 0)
    for _ in range(2 * len(moes)):
        assert event.freed_step is None
        _boundary(balancer)
    assert event.freed_step == event.swap_step + 2 * len(moes)


def test_balancer_stages_everything_at_once_with_a_huge_budget() -> None:
    loaded = _pool_model()
    balancer = OnlineExpertBalancer(
        loaded.model, loaded.experts, interval=2, min_gain=0.0, stage_budget=1e12, policy=_shifted
    )
    for _ in range(4):
        _boundary(balancer)
    event = balancer.history[0]
    assert event.swap_step == 4 and event.stage_steps == 1 and event.stage_pieces > 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


def test_pacer_starts_no_piece_that_would_pass_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(expert_balancer, "time", clock)
    done: list[int] = []

    def piece() -> bool:  # each piece takes 1 s; 10 pieces in all
        clock.now += 1.0
        done.append(1)
        return len(done) < 10

    pacer = expert_balancer._Pacer()
    assert pacer.run(piece, deadline=3.5) == (3, 3.0)  # a 4th would end at 4.0 > 3.5
    assert pacer.run(piece, deadline=clock.now) == (1, 1.0)  # past the deadline: still one piece
    assert pacer.run(piece, deadline=1e9) == (6, 6.0)  # until none is left


def test_budget_is_a_fraction_of_the_median_step(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(expert_balancer, "time", clock)
    loaded = _pool_model()
    balancer = OnlineExpertBalancer(loaded.model, loaded.experts, interval=1000, stage_budget=0.25)
    assert balancer.budget() == 0.0  # no step measured yet
    for step_seconds in (2.0, 4.0, 100.0, 4.0):  # serving time between boundaries
        _boundary(balancer)
        clock.now += step_seconds
    _boundary(balancer)
    assert balancer.budget() == 0.25 * 4.0


def test_stage_budget_must_not_be_negative() -> None:
    from dsinfer.engine.args import EngineArgs

    with pytest.raises(ValueError, match="eplb_stage_budget"):
        EngineArgs(eplb_stage_budget=-0.1)
    loaded = _pool_model()
    with pytest.raises(ValueError, match="stage_budget"):
        OnlineExpertBalancer(loaded.model, loaded.experts, interval=4, stage_budget=-1.0)
