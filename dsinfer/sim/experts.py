"""Expert load of one expert-parallel pool: popularity, placement, per-slot shares, fan-out.

Assumption (stated in the report, varied there): expert ``e`` of MoE layer ``l`` receives a
fraction ``p[l, e]`` of the layer's routed (token, expert) pairs, with ``p`` drawn once per layer
as lognormal(0, ``skew``) and normalized (``skew = 0``: uniform). The placement is what the servers
run: DeepSeek's EPLB (``dsinfer.parallel.eplb.placement_from_load``, hierarchical when the expert
groups divide the pool's nodes, as DeepSeek uses it for prefill; global otherwise) given the
expected load (perfect statistics), or the default contiguous layout
(``ExpertPlacement.default`` without load: no expert balancer). An expert's pairs split evenly over
its replicas (``ExpertPlacement.rank_loads``' rule).

Fan-out (how many ranks and nodes one token's top-8 reaches, which sets the prefill dispatch
volume) comes from sampling DeepSeek-V3's router on synthetic scores ``log p + Gumbel``: group
score = sum of its top-2, keep ``topk_group`` groups, top-``topk`` experts among them, one replica
chosen at random.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dsinfer.parallel.eplb import placement_from_load
from dsinfer.parallel.placement import ExpertPlacement
from dsinfer.sim.model_dims import ModelShape

POLICIES = ("eplb", "contiguous")
FANOUT_TOKENS = 2048
FANOUT_LAYERS = 4


@dataclass(frozen=True)
class ExpertModel:
    ranks: int
    slots_per_rank: int
    share: np.ndarray  # [moe layers, slots]: fraction of a layer's routed pairs each physical slot gets
    rank_fanout: float  # mean distinct ranks a token is dispatched to
    node_fanout: float  # mean distinct nodes a token is dispatched to
    policy: str
    balance: float  # mean over layers of max/mean expected per-rank load

    @property
    def mean_share(self) -> np.ndarray:
        return self.share.mean(axis=0)

    def rows(self, pairs: float, rng: np.random.Generator | None, layers: int | None = None) -> np.ndarray:
        """Routed rows per slot [layers, slots] for ``pairs`` (token, expert) pairs in the pool;
        Poisson around the expectation when ``rng`` is given (routing noise of one step)."""
        share = self.share if layers is None else self.share[:layers]
        mean = pairs * share
        return rng.poisson(mean).astype(np.float64) if rng is not None else mean

    def rank_rows(self, rows: np.ndarray) -> np.ndarray:
        """[layers, slots] -> [layers, ranks]."""
        return rows.reshape(rows.shape[0], self.ranks, self.slots_per_rank).sum(axis=-1)


def popularity(shape: ModelShape, skew: float, seed: int) -> np.ndarray:
    """[moe layers, experts] expected fraction of routed pairs per expert (rows sum to 1)."""
    rng = np.random.default_rng(seed)
    w = rng.lognormal(0.0, skew, size=(shape.moe_layers, shape.experts)) if skew > 0 else None
    if w is None:
        return np.full((shape.moe_layers, shape.experts), 1.0 / shape.experts)
    return w / w.sum(axis=1, keepdims=True)


def expert_model(
    shape: ModelShape,
    ranks: int,
    gpus_per_node: int,
    redundant: int,
    policy: str = "eplb",
    skew: float = 0.5,
    seed: int = 0,
) -> ExpertModel:
    """The pool's expert load (runs the placement algorithm and samples the router: about a second
    at EP144; :class:`dsinfer.sim.cache.SimCache` keeps results for callers that need them often)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown expert placement policy {policy!r}; choose one of {', '.join(POLICIES)}")
    p = popularity(shape, skew, seed)
    layer_ids = list(range(shape.dense_layers, shape.layers))
    nodes = max(1, -(-ranks // gpus_per_node))
    if policy == "eplb":
        load = {layer: list(p[i] * 1e6) for i, layer in enumerate(layer_ids)}
        placement = placement_from_load(load, shape.experts, ranks, redundant, shape.n_group, nodes)
    else:
        placement = ExpertPlacement.default(layer_ids, shape.experts, ranks, redundant)
    slots = np.array([placement.layers[layer] for layer in layer_ids])  # [L, P] logical expert per slot
    copies = np.stack([np.bincount(row, minlength=shape.experts) for row in slots])
    share = np.take_along_axis(p, slots, axis=1) / np.take_along_axis(copies, slots, axis=1)
    per_rank = share.reshape(len(layer_ids), ranks, placement.slots_per_rank).sum(axis=-1)
    balance = float((per_rank.max(axis=1) / per_rank.mean(axis=1)).mean())
    rank_fanout, node_fanout = _fanout(shape, p, slots, ranks, gpus_per_node, seed)
    return ExpertModel(ranks, placement.slots_per_rank, share, rank_fanout, node_fanout, policy, balance)


def _fanout(
    shape: ModelShape,
    p: np.ndarray,
    slots: np.ndarray,
    ranks: int,
    gpus_per_node: int,
    seed: int,
) -> tuple[float, float]:
    rng = np.random.default_rng(seed + 1)
    per_group = shape.experts // shape.n_group
    slots_per_rank = slots.shape[1] // ranks
    rank_counts, node_counts = [], []
    for layer in np.linspace(0, p.shape[0] - 1, FANOUT_LAYERS).astype(int):
        scores = np.log(p[layer])[None, :] + rng.gumbel(size=(FANOUT_TOKENS, shape.experts))
        grouped = scores.reshape(FANOUT_TOKENS, shape.n_group, per_group)
        group_score = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)
        keep = np.argsort(-group_score, axis=1)[:, : shape.topk_group]
        mask = np.full((FANOUT_TOKENS, shape.n_group), -np.inf)
        np.put_along_axis(mask, keep, 0.0, axis=1)
        masked = (grouped + mask[..., None]).reshape(FANOUT_TOKENS, shape.experts)
        chosen = np.argsort(-masked, axis=1)[:, : shape.topk]  # [T, topk] logical experts
        # one replica per (token, expert), uniformly among the expert's slots
        replicas = [np.flatnonzero(slots[layer] == e) for e in range(shape.experts)]
        pick = rng.random(chosen.shape)
        slot = np.empty_like(chosen)
        for e in np.unique(chosen):
            where = chosen == e
            options = replicas[e]
            slot[where] = options[np.minimum((pick[where] * len(options)).astype(int), len(options) - 1)]
        rank = slot // slots_per_rank
        node = rank // gpus_per_node
        rank_counts.append(_distinct_per_row(rank).mean())
        node_counts.append(_distinct_per_row(node).mean())
    return float(np.mean(rank_counts)), float(np.mean(node_counts))


def _distinct_per_row(a: np.ndarray) -> np.ndarray:
    s = np.sort(a, axis=1)
    return 1 + (np.diff(s, axis=1) != 0).sum(axis=1)
