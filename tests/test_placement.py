"""Expert placement: default layouts, greedy load balancing, routing tables, the placement file."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from dsinfer.base.config import ModelConfig
from dsinfer.base.presets import resolve_model
from dsinfer.parallel.elastic_placement import keep_ranks, placement_for_members
from dsinfer.parallel.placement import FORMAT, ExpertPlacement, _packable, _pick, moe_layer_ids

E = 16  # logical experts, like the tiny model
LAYERS = [1, 2, 3]


def skewed(num_logical: int = E, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [1000.0 / (e + 1) * rng.uniform(0.8, 1.2) for e in range(num_logical)]


def assert_valid(p: ExpertPlacement) -> None:
    """Every expert hosted, no rank hosts an expert twice, slots per rank as declared."""
    for layer in p.layers:
        hosted = [p.local_experts(layer, r) for r in range(p.num_ranks)]
        assert all(len(h) == p.slots_per_rank for h in hosted)
        assert all(len(set(h)) == len(h) for h in hosted)
        assert set().union(*hosted) == set(range(p.num_logical))
        assert [e for h in hosted for e in h] == list(p.layers[layer])


def max_over_mean(p: ExpertPlacement, layer: int, load: list[float]) -> float:
    per_rank = p.rank_loads(layer, load)
    return max(per_rank) / (sum(per_rank) / len(per_rank))


# Default layouts ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ranks", "redundant"), [(1, 0), (2, 0), (2, 2), (2, 6), (4, 0), (4, 4), (4, 8), (4, 12)]
)
def test_default_layout(ranks: int, redundant: int) -> None:
    p = ExpertPlacement.default(LAYERS, E, ranks, redundant)
    assert_valid(p)
    assert p.num_physical == E + redundant and p.slots_per_rank == (E + redundant) // ranks
    assert list(p.layers) == LAYERS and len(set(p.layers.values())) == 1
    per_rank_logical = E // ranks
    for r in range(ranks):
        block = p.local_experts(1, r)[:per_rank_logical]
        assert block == list(range(r * per_rank_logical, (r + 1) * per_rank_logical))  # contiguous
    copies = [len(s) for s in p.replicas(1)]
    assert sum(copies) == E + redundant and max(copies) - min(copies) <= 1  # copies spread over experts


def test_default_layout_exact() -> None:
    p = ExpertPlacement.default([3], E, 4, 4)
    assert [p.local_experts(3, r) for r in range(4)] == [
        [0, 1, 2, 3, 4],
        [4, 5, 6, 7, 8],
        [8, 9, 10, 11, 12],
        [12, 13, 14, 15, 0],
    ]
    uneven = ExpertPlacement.default([3], E, 3, 2)  # 18 slots: blocks of 6, 5, 5 + one copy on ranks 1, 2
    assert [uneven.local_experts(3, r) for r in range(3)] == [
        [0, 1, 2, 3, 4, 5],
        [6, 7, 8, 9, 10, 11],
        [11, 12, 13, 14, 15, 0],
    ]


def test_default_errors() -> None:
    with pytest.raises(ValueError, match="= 19 slots cannot be spread evenly over 4 ranks"):
        ExpertPlacement.default(LAYERS, E, 4, 3)
    with pytest.raises(ValueError, match="exceed the 16 routed experts"):
        ExpertPlacement.default(LAYERS, E, 1, 16)
    with pytest.raises(ValueError, match="no MoE layers"):
        ExpertPlacement.default([], E, 2)
    with pytest.raises(ValueError, match="layer 7, which is not among"):
        ExpertPlacement.default(LAYERS, E, 2, load={7: [1.0] * E})
    with pytest.raises(ValueError, match="layer 1: load has 3 values, expected 16"):
        ExpertPlacement.default(LAYERS, E, 2, load={1: [1.0] * 3})
    with pytest.raises(ValueError, match=r"layer 1: load of expert 2 is -1\.0"):
        ExpertPlacement.default(LAYERS, E, 2, load={1: [1.0, 1.0, -1.0] + [1.0] * 13})


# Load-based placement -------------------------------------------------------------------------
@pytest.mark.parametrize(("ranks", "redundant"), [(2, 0), (4, 0), (4, 4), (4, 8), (8, 8)])
def test_load_balances_better_than_default(ranks: int, redundant: int) -> None:
    load = {layer: skewed(seed=layer) for layer in LAYERS}
    plain = ExpertPlacement.default(LAYERS, E, ranks, redundant)
    balanced = ExpertPlacement.default(LAYERS, E, ranks, redundant, load=load)
    assert_valid(balanced)
    for layer in LAYERS:
        assert max_over_mean(balanced, layer, load[layer]) < max_over_mean(plain, layer, load[layer])
    assert balanced.stats(load)["balance"] < plain.stats(load)["balance"]
    if redundant:
        copies = [len(s) for s in balanced.replicas(1)]
        assert copies[0] == max(copies) > 1  # the hottest expert is replicated


def test_load_redundant_experts_reach_near_perfect_balance() -> None:
    load = {1: skewed(seed=1)}
    p = ExpertPlacement.default([1], E, 4, 16, load=load)
    assert p.stats(load)["balance"] < 1.1
    assert ExpertPlacement.default([1], E, 4, 16).stats(load)["balance"] > 1.5


def test_load_only_for_some_layers() -> None:
    p = ExpertPlacement.default(LAYERS, E, 4, 4, load={2: skewed()})
    plain = ExpertPlacement.default(LAYERS, E, 4, 4)
    assert p.layers[1] == plain.layers[1] == p.layers[3]
    assert p.layers[2] != plain.layers[2]


def test_deterministic() -> None:
    load = {layer: skewed(seed=layer) for layer in LAYERS}
    assert ExpertPlacement.default(LAYERS, E, 4, 4, load=load) == ExpertPlacement.default(
        LAYERS, E, 4, 4, load=load
    )
    assert ExpertPlacement.default(LAYERS, E, 4, 4) == ExpertPlacement.default(LAYERS, E, 4, 4)


def test_greedy_never_gets_stuck() -> None:
    """Ties, zero loads and many redundant copies: the packing always finds a valid placement."""
    rng = random.Random(1)
    for _ in range(300):
        ranks = rng.choice([2, 3, 4, 6, 8])
        num_logical = rng.choice([4, 6, 8, 12])
        redundant = rng.randrange(0, num_logical * (ranks - 1) + 1, ranks) + (-num_logical) % ranks
        load = [rng.choice([0.0, 0.0, 1.0, 5.0, rng.uniform(0, 100)]) for _ in range(num_logical)]
        assert_valid(ExpertPlacement.default([0], num_logical, ranks, redundant, load={0: load}))


def test_packing_keeps_later_experts_placeable() -> None:
    # Rank 1 is the least loaded, but taking its last slot leaves free slots [2, 0, 1], and a
    # later expert with 3 copies needs 3 distinct ranks: rank 0 (the one with most room) it is.
    assert _packable([1, 1, 1], [3]) and not _packable([2, 0, 1], [3])
    assert _pick([1, 2, 0], [2, 1, 1], 1, [3]) == [0]
    assert _pick([1, 2, 0], [2, 1, 1], 2, [2]) == [1, 0]


# Queries --------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_load", [False, True])
def test_routing_table_covers_all_replicas(use_load: bool) -> None:
    load = {layer: skewed(seed=layer) for layer in LAYERS} if use_load else None
    p = ExpertPlacement.default(LAYERS, E, 4, 8, load=load)
    for layer in LAYERS:
        table, n = p.routing_table(layer)
        assert table.dtype == n.dtype == torch.int64
        assert table.shape == (E, int(n.max())) and n.shape == (E,)
        replicas = p.replicas(layer)
        for e in range(E):
            hit = [int(table[e, j % int(n[e])]) for j in range(int(n[e]))]
            assert sorted(hit) == replicas[e] and len(set(hit)) == len(hit)
            assert all(p.layers[layer][s] == e for s in hit)
            assert (table[e, int(n[e]) :] == -1).all()


def test_routing_table_is_on_cpu_under_a_meta_device_context() -> None:
    p = ExpertPlacement.default(LAYERS, E, 2, 2)
    with torch.device("meta"):
        table, n = p.routing_table(1)
    assert table.device.type == n.device.type == "cpu" and int(n.sum()) == E + 2


def test_stats() -> None:
    p = ExpertPlacement.default(LAYERS, E, 4)
    assert p.stats({1: [1.0] * E, 2: [0.0] * E}) == {"balance": 1.0, "max_balance": 1.0}
    hot = [10.0] + [0.0] * (E - 1)
    assert p.stats({1: hot}) == {"balance": 4.0, "max_balance": 4.0}
    with pytest.raises(ValueError, match="at least one layer"):
        p.stats({})


def test_validation_errors() -> None:
    ok = tuple(range(E))
    with pytest.raises(ValueError, match="layer 2 has 15 slots, layer 1 has 16"):
        ExpertPlacement(2, E, {1: ok, 2: ok[:15]})
    with pytest.raises(ValueError, match="layer 1: 16 slots, not a positive multiple of 3 ranks"):
        ExpertPlacement(3, E, {1: ok})
    with pytest.raises(ValueError, match="layer 1: expert 15 has no slot"):
        ExpertPlacement(2, E, {1: (*ok[:15], 0)})
    with pytest.raises(ValueError, match="layer 1: slot 3 holds expert 16"):
        ExpertPlacement(2, E, {1: (0, 1, 2, 16, *ok[4:])})
    with pytest.raises(ValueError, match=r"layer 1: rank 1 hosts expert 8 twice \(slots 18 and 19\)"):
        ExpertPlacement(2, E, {1: (*ok, 0, 1, 8, 8)})
    with pytest.raises(ValueError, match="layer id -1"):
        ExpertPlacement(2, E, {-1: ok})


def test_check_matches() -> None:
    p = ExpertPlacement.default([1, 2, 3, 4], E, 2, 2)
    p.check_matches([1, 2, 3], E, 2)  # an extra (MTP) layer is fine
    with pytest.raises(ValueError, match="placement has no MoE layer 5"):
        p.check_matches([1, 2, 5], E, 2)
    with pytest.raises(ValueError, match="placement is for 2 ranks, the pool has 4"):
        p.check_matches([1, 2, 3], E, 4)
    with pytest.raises(ValueError, match="placement is for 16 experts, the model has 32"):
        p.check_matches([1, 2, 3], 32, 2)


# The placement file ---------------------------------------------------------------------------
def test_save_load_round_trip(tmp_path: Path) -> None:
    p = ExpertPlacement.default(LAYERS, E, 4, 4, load={2: skewed()})
    path = tmp_path / "placement.json"
    p.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT and data["num_ranks"] == 4 and data["num_logical"] == E
    assert data["layers"]["2"] == list(p.layers[2])
    assert ExpertPlacement.load(path) == p


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "p.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("{not json", "not valid JSON"),
        ({"format": "other/1", "num_ranks": 2, "num_logical": 2, "layers": {}}, "format is 'other/1'"),
        ([1, 2], "format is 'list'"),
        (
            {"format": FORMAT, "num_ranks": "2", "num_logical": 2, "layers": {}},
            "num_ranks must be an integer",
        ),
        ({"format": FORMAT, "num_ranks": 2, "num_logical": 2, "layers": []}, "layers must be an object"),
        ({"format": FORMAT, "num_ranks": 2, "num_logical": 2, "layers": {"x": [0, 1]}}, "layer id 'x'"),
        (
            {"format": FORMAT, "num_ranks": 2, "num_logical": 2, "layers": {"1": [0, "1"]}},
            "slots must be a list",
        ),
        (
            {"format": FORMAT, "num_ranks": 2, "num_logical": 2, "layers": {"1": [0, 1, 1, 1]}},
            "rank 1 hosts expert 1",
        ),
        ({"format": FORMAT, "num_ranks": 1, "num_logical": 2, "layers": {}}, "no MoE layers"),
    ],
)
def test_load_errors(tmp_path: Path, data: object, message: str) -> None:
    path = _write(tmp_path, data)
    with pytest.raises(ValueError, match=message) as info:
        ExpertPlacement.load(path)
    assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value)


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read expert placement"):
        ExpertPlacement.load(tmp_path / "absent.json")


# Model presets --------------------------------------------------------------------------------
def _preset(name: str | None) -> ModelConfig:
    return ModelConfig.from_file(resolve_model(name)[0] / "config.json")


def test_for_model_tiny() -> None:
    config = _preset(None)
    assert moe_layer_ids(config) == [1, 2, 3]
    p = ExpertPlacement.for_model(config, 2, num_mtp_layers=1)
    assert list(p.layers) == [1, 2, 3, 4] and p.num_physical == 16 and p.slots_per_rank == 8
    assert p.local_experts(4, 1) == list(range(8, 16))
    assert_valid(p)
    with pytest.raises(ValueError, match="2 MTP layers asked for"):
        ExpertPlacement.for_model(config, 2, num_mtp_layers=2)


def test_moe_layer_ids_follow_the_config_rule() -> None:
    config = _preset(None).model_copy(update={"num_hidden_layers": 8, "moe_layer_freq": 2})
    assert moe_layer_ids(config) == [i for i in range(8) if config.is_moe_layer(i)] == [2, 4, 6]


def test_for_model_deepseek_v3_prefill_layout() -> None:
    config = _preset("deepseek-v3")
    p = ExpertPlacement.for_model(config, 32, num_redundant=32, num_mtp_layers=1)
    assert list(p.layers) == list(range(3, 62))
    assert p.num_physical == 288 and p.slots_per_rank == 9
    copies = [len(s) for s in p.replicas(61)]
    assert sorted(set(copies)) == [1, 2] and copies.count(2) == 32
    assert_valid(p)


# Elastic EP ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ranks", "redundant", "dead"), [(2, 2, 1), (2, 8, 0), (4, 0, 2), (4, 4, 0), (8, 8, 5)]
)
def test_keep_ranks_keeps_every_survivors_experts_and_covers_all(
    ranks: int, redundant: int, dead: int
) -> None:
    current = ExpertPlacement.default([1, 2], 8 if ranks < 8 else 16, ranks, redundant)
    kept = [r for r in range(ranks) if r != dead]
    shrunk = keep_ranks(current, kept)
    assert shrunk.num_ranks == ranks - 1 and shrunk.num_logical == current.num_logical
    for layer in current.layers:
        for new, old in enumerate(kept):
            mine = shrunk.local_experts(layer, new)
            assert mine[: current.slots_per_rank] == current.local_experts(layer, old)  # nothing moves
        assert all(shrunk.replicas(layer))  # every expert has a slot (also checked at construction)
    if redundant >= current.num_logical * (ranks - 1):  # every expert already on every survivor
        assert shrunk.slots_per_rank == current.slots_per_rank


def test_keep_ranks_spreads_the_orphans_and_pads_with_the_least_replicated() -> None:
    current = ExpertPlacement(3, 6, {1: (0, 1, 2, 3, 4, 5)})
    shrunk = keep_ranks(current, [0, 2])  # rank 1 held experts 2 and 3
    assert shrunk.layers == {1: (0, 1, 2, 4, 5, 3)}
    uneven = keep_ranks(ExpertPlacement(3, 6, {1: (0, 1, 2, 3, 4, 5)}), [2])
    assert uneven.layers == {1: (4, 5, 0, 1, 2, 3)}
    with pytest.raises(ValueError, match="not distinct ranks"):
        keep_ranks(current, [0, 0])


def test_placement_for_members_is_the_initial_one_when_whole() -> None:
    initial = ExpertPlacement.default([1, 2], 8, 4, 4)
    assert placement_for_members(initial, [0, 1, 2, 3]) is initial
    assert placement_for_members(initial, [0, 1, 3]) == keep_ranks(initial, [0, 1, 3])
