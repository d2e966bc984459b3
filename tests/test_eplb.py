"""EPLB: DeepSeek's hierarchical/global policies, placement_from_load, and ``dsinfer eplb``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from dsinfer.base.config import ModelConfig
from dsinfer.base.expert_load import FORMAT as LOAD_FORMAT
from dsinfer.base.presets import resolve_model
from dsinfer.cli.main import main
from dsinfer.engine.args import EngineArgs
from dsinfer.parallel.eplb import placement_from_load, rebalance_experts
from dsinfer.parallel.placement import ExpertPlacement, moe_layer_ids

# The published test vector (shared/reference/kernel-apis.md, EPLB).
WEIGHT = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
]
PHY2LOG = [
    [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
    [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
]
LOGCNT = [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1], [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]


def zipf(layers: int, experts: int, seed: int = 0, s: float = 1.2) -> torch.Tensor:
    """Zipf-like load: expert of popularity rank k gets ~ 1 / k^s, ranks shuffled per layer."""
    gen = torch.Generator().manual_seed(seed)
    rows = [
        1e5
        / (torch.randperm(experts, generator=gen).double() + 1) ** s
        * (0.8 + 0.4 * torch.rand(experts, generator=gen))
        for _ in range(layers)
    ]
    return torch.stack(rows)


def rank_max_over_mean(phy2log: torch.Tensor, weight: torch.Tensor, num_ranks: int) -> list[float]:
    """Per layer: max / mean per-rank load, each expert's load split evenly over its replicas."""
    out = []
    for slots, w in zip(phy2log.tolist(), weight.tolist(), strict=True):
        copies = [slots.count(e) for e in range(len(w))]
        per_rank = len(slots) // num_ranks
        loads = [
            sum(w[e] / copies[e] for e in slots[r * per_rank : (r + 1) * per_rank]) for r in range(num_ranks)
        ]
        out.append(max(loads) / (sum(loads) / num_ranks))
    return out


def check_consistent(
    phy2log: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, num_logical: int
) -> None:
    layers, num_replicas = phy2log.shape
    assert phy2log.dtype == log2phy.dtype == logcnt.dtype == torch.int64
    assert log2phy.shape == (layers, num_logical, num_replicas - num_logical + 1)
    for layer in range(layers):
        slots = phy2log[layer].tolist()
        assert sorted(set(slots)) == list(range(num_logical))  # every logical expert present
        assert logcnt[layer].tolist() == [slots.count(e) for e in range(num_logical)]
        assert int(logcnt[layer].sum()) == num_replicas
        for e in range(num_logical):
            row = log2phy[layer, e].tolist()
            n = int(logcnt[layer, e])
            assert all(x == -1 for x in row[n:])
            assert sorted(row[:n]) == [p for p, x in enumerate(slots) if x == e]


# The pure function ------------------------------------------------------------------------------
def test_published_test_vector() -> None:
    phy2log, log2phy, logcnt = rebalance_experts(torch.tensor(WEIGHT), 16, 4, 2, 8)
    assert phy2log.tolist() == PHY2LOG
    assert logcnt.tolist() == LOGCNT
    check_consistent(phy2log, log2phy, logcnt, 12)
    # log2phy lists replicas in the order they were made: expert 5 of layer 0 first at slot 0.
    assert log2phy[0, 5].tolist() == [0, 2, -1, -1, -1]


def test_test_vector_without_duplicates_is_unchanged() -> None:
    """No rank holds an expert twice in the published vector, so the flag changes nothing."""
    phy2log, _, _ = rebalance_experts(torch.tensor(WEIGHT), 16, 4, 2, 8, one_replica_per_rank=True)
    assert phy2log.tolist() == PHY2LOG


@pytest.mark.parametrize(
    ("replicas", "groups", "nodes", "ranks"),
    [(16, 4, 2, 8), (16, 4, 4, 4), (24, 4, 2, 4), (12, 4, 2, 4), (18, 3, 2, 6), (32, 2, 1, 8), (24, 1, 1, 1)],
)
def test_properties(replicas: int, groups: int, nodes: int, ranks: int) -> None:
    weight = zipf(5, 12, seed=replicas + ranks)
    phy2log, log2phy, logcnt = rebalance_experts(weight, replicas, groups, nodes, ranks)
    check_consistent(phy2log, log2phy, logcnt, 12)
    again = rebalance_experts(weight.clone(), replicas, groups, nodes, ranks)
    assert all(
        torch.equal(a, b) for a, b in zip((phy2log, log2phy, logcnt), again, strict=True)
    )  # deterministic


def test_hierarchical_keeps_groups_on_nodes() -> None:
    weight = zipf(4, 32)
    phy2log, _, _ = rebalance_experts(weight, 48, 8, 4, 16)  # 8 groups of 4 experts, 2 groups per node
    for slots in phy2log.tolist():
        for node in range(4):
            groups = {e // 4 for e in slots[node * 12 : (node + 1) * 12]}
            assert len(groups) == 2  # a node's slots hold its two whole groups and nothing else


def test_global_when_groups_do_not_divide_nodes() -> None:
    """8 groups on 3 nodes: the global policy, i.e. the hierarchical one with one group and one node."""
    weight = zipf(3, 24)
    got = rebalance_experts(weight, 30, 8, 3, 6)
    want = rebalance_experts(weight, 30, 1, 1, 6)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_balance_beats_no_redundancy_on_skewed_load() -> None:
    weight = zipf(8, 64)
    contiguous = rank_max_over_mean(torch.arange(64).repeat(8, 1), weight, 8)
    for groups, nodes in ((8, 2), (8, 3)):  # hierarchical, global
        phy2log, _, _ = rebalance_experts(weight, 80, groups, nodes, 8)
        balanced = rank_max_over_mean(phy2log, weight, 8)
        assert sum(balanced) / 8 < 0.8 * sum(contiguous) / 8
        assert all(b < c for b, c in zip(balanced, contiguous, strict=True))


def test_uniform_load_is_perfectly_balanced() -> None:
    phy2log, _, logcnt = rebalance_experts(torch.ones(2, 16), 16, 4, 2, 4)
    assert logcnt.eq(1).all()
    assert max(rank_max_over_mean(phy2log, torch.ones(2, 16), 4)) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((10, 4, 2, 8), "num_replicas = 10 is below the 12 logical experts"),
        ((20, 4, 2, 8), "num_replicas = 20 is not divisible by num_ranks = 8"),
        ((24, 8, 4, 4), "num_logical = 12 is not divisible by num_groups = 8"),
        ((18, 4, 2, 3), "num_ranks = 3 is not divisible by num_nodes = 2"),
        ((16, 0, 2, 8), "num_groups must be a positive integer, got 0"),
        ((16, 4, 2, 0), "num_ranks must be a positive integer, got 0"),
    ],
)
def test_impossible_configs(args: tuple[int, int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rebalance_experts(torch.tensor(WEIGHT[:1]), *args)


def test_bad_weight() -> None:
    with pytest.raises(ValueError, match=r"\[layers, num_logical\]"):
        rebalance_experts(torch.ones(12), 16, 4, 2, 8)
    with pytest.raises(ValueError, match=r"load of expert 3 is -1\.0"):
        rebalance_experts(torch.tensor([[1.0, 2.0, 3.0, -1.0]]), 4, 1, 1, 2)


# One replica per rank ---------------------------------------------------------------------------
def test_deepseek_packing_can_put_two_replicas_on_one_rank() -> None:
    """One very hot expert gets more replicas than its node has ranks: DeepSeek's output holds it
    twice on a rank; one_replica_per_rank caps its replicas at the node's ranks and spreads them."""
    weight = torch.tensor([[1000.0] + [1.0] * 7])
    raw, _, raw_cnt = rebalance_experts(weight, 16, 1, 1, 4)
    assert int(raw_cnt[0, 0]) == 9 and any(len(set(raw[0, r * 4 : r * 4 + 4].tolist())) < 4 for r in range(4))
    fixed, log2phy, cnt = rebalance_experts(weight, 16, 1, 1, 4, one_replica_per_rank=True)
    check_consistent(fixed, log2phy, cnt, 8)
    assert int(cnt[0, 0]) == 4
    assert all(len(set(fixed[0, r * 4 : r * 4 + 4].tolist())) == 4 for r in range(4))


def test_one_replica_per_rank_randomized() -> None:
    rng = random.Random(1)
    for _ in range(60):
        nodes, per_node = rng.choice([1, 2, 4]), rng.choice([1, 2, 4])
        ranks, groups = nodes * per_node, nodes * rng.choice([1, 2])
        experts = groups * rng.choice([2, 4])
        slots = rng.randint(-(-experts // ranks), experts // nodes)  # per rank; at most the experts per node
        weight = zipf(2, experts, seed=rng.randrange(1000), s=rng.choice([0.5, 1.5, 4.0]))
        phy2log, log2phy, logcnt = rebalance_experts(
            weight, slots * ranks, groups, nodes, ranks, one_replica_per_rank=True
        )
        check_consistent(phy2log, log2phy, logcnt, experts)
        for row in phy2log.view(-1, slots).tolist():
            assert len(set(row)) == slots


def test_one_replica_per_rank_impossible() -> None:
    with pytest.raises(ValueError, match="5 slots per rank exceed the 4 experts per node"):
        rebalance_experts(torch.ones(1, 8), 20, 2, 2, 4, one_replica_per_rank=True)


# placement_from_load ----------------------------------------------------------------------------
def test_placement_from_load() -> None:
    weight = zipf(3, 16)
    load = {layer: w for layer, w in zip([1, 2, 3], weight.tolist(), strict=True)}
    p = placement_from_load(load, 16, 4, 4, 4, 2)
    assert isinstance(p, ExpertPlacement) and list(p.layers) == [1, 2, 3]
    assert p.num_ranks == 4 and p.num_physical == 20
    phy2log, _, _ = rebalance_experts(weight, 20, 4, 2, 4, one_replica_per_rank=True)
    assert [list(p.layers[layer]) for layer in (1, 2, 3)] == phy2log.tolist()
    contiguous = ExpertPlacement.default([1, 2, 3], 16, 4, 0)
    assert p.stats(load)["balance"] < contiguous.stats(load)["balance"]


def test_placement_from_load_errors_name_the_layer() -> None:
    with pytest.raises(ValueError, match="layer 7: load has 3 values, expected 16"):
        placement_from_load({7: [1.0, 2.0, 3.0]}, 16, 4, 4, 4, 2)
    with pytest.raises(ValueError, match="layer 9: load of expert 2 is nan"):
        placement_from_load({3: [1.0] * 16, 9: [1.0, 1.0, float("nan")] + [1.0] * 13}, 16, 4, 4, 4, 2)
    with pytest.raises(ValueError, match="at least one layer"):
        placement_from_load({}, 16, 4, 4, 4, 2)


# dsinfer eplb ------------------------------------------------------------------------------------
def _stats(tmp_path: Path, roles: dict[str, dict[int, list[float]]]) -> Path:
    doc = {"format": LOAD_FORMAT, "roles": {r: {str(k): v for k, v in ls.items()} for r, ls in roles.items()}}
    path = tmp_path / "expert_load.json"
    path.write_text(json.dumps(doc))
    return path


def test_cli_writes_a_placement_serve_accepts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = ModelConfig.from_file(resolve_model("tiny")[0] / "config.json")
    weight = zipf(2, config.n_routed_experts).tolist()
    stats = _stats(tmp_path, {"decode": {1: weight[0], 2: weight[1]}, "prefill": {1: [1.0] * 16}})
    out = tmp_path / "placement.json"
    argv = ["eplb", "--stats", str(stats), "--role", "decode", "--pool-size", "4"]
    assert main([*argv, "--num-redundant-experts", "4", "--num-nodes", "2", "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    placement = ExpertPlacement.load(out)  # what dsinfer serve --placement does
    for mtp in (0, 1):
        placement.check_matches(moe_layer_ids(config, mtp), config.n_routed_experts, 4)
    assert EngineArgs(placement=out).placement == out
    assert placement.num_physical == 20
    assert list(placement.layers) == moe_layer_ids(config, config.num_nextn_predict_layers)
    load = {1: weight[0], 2: weight[1]}
    assert placement.stats(load)["balance"] < ExpertPlacement.default([1, 2], 16, 4, 4).stats(load)["balance"]
    uniform = placement_from_load({3: [1.0] * 16}, 16, 4, 4, config.n_group, 2)
    assert placement.layers[3] == uniform.layers[3]  # a layer without statistics: uniform load


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"--stats": "missing.json"}, "cannot read expert load statistics"),
        ({"--role": "prefill"}, "no expert load for role 'prefill'"),
        ({"--pool-size": "3"}, "num_replicas = 20 is not divisible by num_ranks = 3"),
        ({"--pool-size": "0"}, "--pool-size must be >= 1, got 0"),
        ({"--num-redundant-experts": "-1"}, "--num-redundant-experts must be >= 0, got -1"),
        (
            {"--pool-size": "3", "--num-redundant-experts": "5", "--num-nodes": "2"},
            "num_ranks = 3 is not divisible by num_nodes = 2",
        ),
        ({"--model": "no-such-model"}, "neither a checkpoint directory nor a preset"),
        ({"--model": "deepseek-v3"}, "load for layer 1, not a MoE layer of the model"),
        ({"-o": "no/such/dir/p.json"}, "cannot write the placement"),
    ],
)
def test_cli_errors(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    change: dict,
    message: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    _stats(tmp_path, {"decode": {1: [1.0] * 16}})
    flags = {
        "--stats": "expert_load.json",
        "--role": "decode",
        "--pool-size": "4",
        "--num-redundant-experts": "4",
        "-o": "placement.json",
        **change,
    }
    assert main(["eplb", *[x for kv in flags.items() for x in kv]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dsinfer: error: ") and "\n" not in err and message in err, err


def test_cli_wrong_expert_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stats = _stats(tmp_path, {"decode": {2: [1.0] * 15}})
    argv = [
        "eplb",
        "--stats",
        str(stats),
        "--role",
        "decode",
        "--pool-size",
        "2",
        "--num-redundant-experts",
        "0",
    ]
    assert main([*argv, "-o", str(tmp_path / "p.json")]) == 2
    assert "layer 2 has 15 expert loads, the model has 16 experts" in capsys.readouterr().err
