"""Expert placement: which logical expert each physical expert slot holds, per MoE layer.

An expert-parallel group of R ranks holds ``num_physical`` slots per MoE layer, the same number
on every layer: rank ``p // slots_per_rank`` holds slot ``p`` at local index
``p % slots_per_rank``. Every logical expert has at least one slot; the ``num_physical -
num_logical`` redundant slots replicate hot experts, never twice on one rank.

``ExpertPlacement.default`` is a simple greedy layout: replicate the expert with the highest
load per replica, one copy at a time, then pack the replicas heaviest first onto the least-loaded
rank with room. DeepSeek's hierarchical and global EPLB policies are in ``dsinfer.parallel.eplb``
(``placement_from_load``), which the ``dsinfer eplb`` command and online rebalancing use.
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsinfer.base.config import ModelConfig
from dsinfer.base.rank_shape import expert_slots_per_rank
from dsinfer.base.v4_config import V4Config

FORMAT = "dsinfer-expert-placement/1"


def moe_layer_ids(config: ModelConfig | V4Config, num_mtp_layers: int = 0) -> list[int]:
    """The model's MoE layer ids (``ModelConfig.is_moe_layer``; every DeepSeek-V4 layer), then the
    MTP layers ``num_hidden_layers .. num_hidden_layers + num_mtp_layers - 1`` (always MoE)."""
    if isinstance(config, V4Config):
        n = config.num_hidden_layers
        return list(range(n + num_mtp_layers))  # the checkpoint says how many it has
    if not 0 <= num_mtp_layers <= config.num_nextn_predict_layers:
        raise ValueError(
            f"{num_mtp_layers} MTP layers asked for, the config has num_nextn_predict_layers="
            f"{config.num_nextn_predict_layers}"
        )
    n = config.num_hidden_layers
    return [i for i in range(n) if config.is_moe_layer(i)] + list(range(n, n + num_mtp_layers))


@dataclass(frozen=True)
class ExpertPlacement:
    num_ranks: int
    num_logical: int
    layers: dict[int, tuple[int, ...]]  # layer id -> logical expert of each physical slot

    def __post_init__(self) -> None:
        if not _is_int(self.num_ranks) or self.num_ranks < 1:
            raise ValueError(f"num_ranks must be a positive integer, got {self.num_ranks!r}")
        if not _is_int(self.num_logical) or self.num_logical < 1:
            raise ValueError(f"num_logical must be a positive integer, got {self.num_logical!r}")
        if not self.layers:
            raise ValueError("placement has no MoE layers")
        bad = next((layer for layer in self.layers if not _is_int(layer) or layer < 0), None)
        if bad is not None:
            raise ValueError(f"layer id {bad!r} is not a non-negative integer")
        layers = {layer: tuple(slots) for layer, slots in sorted(self.layers.items())}
        object.__setattr__(self, "layers", layers)
        first = next(iter(layers))
        for layer, slots in layers.items():
            if len(slots) != len(layers[first]):
                raise ValueError(
                    f"layer {layer} has {len(slots)} slots, layer {first} has {len(layers[first])}"
                )
            self._check_layer(layer, slots)

    def _check_layer(self, layer: int, slots: tuple[int, ...]) -> None:
        if not slots or len(slots) % self.num_ranks:
            raise ValueError(
                f"layer {layer}: {len(slots)} slots, not a positive multiple of {self.num_ranks} ranks"
            )
        per_rank = len(slots) // self.num_ranks
        seen: dict[tuple[int, int], int] = {}  # (rank, expert) -> slot
        for p, e in enumerate(slots):
            if not _is_int(e) or not 0 <= e < self.num_logical:
                raise ValueError(
                    f"layer {layer}: slot {p} holds expert {e!r}, not in [0, {self.num_logical})"
                )
            key = (p // per_rank, e)
            if key in seen:
                raise ValueError(
                    f"layer {layer}: rank {key[0]} hosts expert {e} twice (slots {seen[key]} and {p})"
                )
            seen[key] = p
        missing = sorted(set(range(self.num_logical)) - set(slots))
        if missing:
            raise ValueError(f"layer {layer}: expert {missing[0]} has no slot")

    # Queries ----------------------------------------------------------------------------------
    @property
    def num_physical(self) -> int:
        return len(next(iter(self.layers.values())))

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    def _slots(self, layer: int) -> tuple[int, ...]:
        try:
            return self.layers[layer]
        except KeyError:
            raise KeyError(f"no expert placement for layer {layer} (layers: {list(self.layers)})") from None

    def local_experts(self, layer: int, rank: int) -> list[int]:
        """Logical expert of each of ``rank``'s slots, in slot order."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} not in [0, {self.num_ranks})")
        s = self.slots_per_rank
        return list(self._slots(layer)[rank * s : (rank + 1) * s])

    def replicas(self, layer: int) -> list[list[int]]:
        """Per logical expert, its physical slots in ascending order."""
        out: list[list[int]] = [[] for _ in range(self.num_logical)]
        for p, e in enumerate(self._slots(layer)):
            out[e].append(p)
        return out

    def routing_table(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(replica_slots int64 [num_logical, max_replicas], num_replicas int64 [num_logical]).

        Row e lists expert e's slots ascending, padded with -1 (never read: the hot path takes
        ``replica_slots[e, j % num_replicas[e]]``). Always on the CPU (also under a default-device
        context such as meta); callers keep it per layer.
        """
        reps = self.replicas(layer)
        width = max(len(r) for r in reps)
        table = torch.tensor([r + [-1] * (width - len(r)) for r in reps], dtype=torch.int64, device="cpu")
        return table, torch.tensor([len(r) for r in reps], dtype=torch.int64, device="cpu")

    def rank_loads(self, layer: int, load: list[float]) -> list[float]:
        """Per-rank load when each expert's ``load`` is split evenly over its replicas."""
        slots = self._slots(layer)
        copies = [0] * self.num_logical
        for e in slots:
            copies[e] += 1
        out = [0.0] * self.num_ranks
        for p, e in enumerate(slots):
            out[p // self.slots_per_rank] += load[e] / copies[e]
        return out

    def stats(self, load: dict[int, list[float]]) -> dict[str, float]:
        """Balance (max / mean per-rank load, 1.0 is perfect) over the layers in ``load``:
        ``balance`` is the mean over those layers, ``max_balance`` the worst layer."""
        if not load:
            raise ValueError("stats needs the load of at least one layer")
        ratios = []
        for layer, values in sorted(load.items()):
            per_rank = self.rank_loads(layer, _check_load(layer, values, self.num_logical))
            mean = sum(per_rank) / len(per_rank)
            ratios.append(max(per_rank) / mean if mean > 0 else 1.0)
        return {"balance": sum(ratios) / len(ratios), "max_balance": max(ratios)}

    def check_matches(self, moe_layers: list[int], num_logical: int, num_ranks: int) -> None:
        """ValueError naming the first mismatch with a model and pool. Extra layers (e.g. MTP
        layers the model runs without) are allowed."""
        if self.num_ranks != num_ranks:
            raise ValueError(f"placement is for {self.num_ranks} ranks, the pool has {num_ranks}")
        if self.num_logical != num_logical:
            raise ValueError(f"placement is for {self.num_logical} experts, the model has {num_logical}")
        for layer in moe_layers:
            if layer not in self.layers:
                raise ValueError(f"placement has no MoE layer {layer} (it has {list(self.layers)})")

    # Construction -----------------------------------------------------------------------------
    @classmethod
    def default(
        cls,
        moe_layers: list[int],
        num_logical: int,
        num_ranks: int,
        num_redundant: int = 0,
        load: dict[int, list[float]] | None = None,
    ) -> ExpertPlacement:
        """Contiguous blocks of experts per rank (layers without ``load``), or the greedy
        load-balanced placement (layers with ``load``: per logical expert, e.g. tokens routed)."""
        expert_slots_per_rank(num_logical, num_redundant, num_ranks)  # ValueError when they cannot be spread
        load = load or {}
        unknown = sorted(set(load) - set(moe_layers))
        if unknown:
            raise ValueError(f"load given for layer {unknown[0]}, which is not among the MoE layers")
        blocks = _contiguous(num_logical, num_ranks, num_redundant)
        layers = {
            layer: _balanced(_check_load(layer, load[layer], num_logical), num_ranks, num_redundant)
            if layer in load
            else blocks
            for layer in moe_layers
        }
        return cls(num_ranks, num_logical, layers)

    @classmethod
    def for_model(
        cls, config: ModelConfig | V4Config, num_ranks: int, num_redundant: int = 0, num_mtp_layers: int = 0
    ) -> ExpertPlacement:
        """The default layout over the model's MoE layers and its first ``num_mtp_layers`` MTP layers."""
        return cls.default(
            moe_layer_ids(config, num_mtp_layers), config.n_routed_experts, num_ranks, num_redundant
        )

    # Files ------------------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        rows = ",\n".join(f'    "{layer}": {json.dumps(list(slots))}' for layer, slots in self.layers.items())
        Path(path).write_text(
            f'{{\n  "format": "{FORMAT}",\n  "num_ranks": {self.num_ranks},\n'
            f'  "num_logical": {self.num_logical},\n  "layers": {{\n{rows}\n  }}\n}}\n'
        )

    @classmethod
    def load(cls, path: Path) -> ExpertPlacement:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except OSError as e:
            raise ValueError(f"{path}: cannot read expert placement ({e.strerror or e})") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        try:
            return cls(**_parse(data))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"format is {found!r}, expected {FORMAT!r}")
    for key in ("num_ranks", "num_logical"):
        if not _is_int(data.get(key)):
            raise ValueError(f"{key} must be an integer, got {data.get(key)!r}")
    raw = data.get("layers")
    if not isinstance(raw, dict):
        raise ValueError(f"layers must be an object of layer id -> slot list, got {type(raw).__name__}")
    layers: dict[int, tuple[int, ...]] = {}
    for key, slots in raw.items():
        if not (key.isascii() and key.isdigit()):
            raise ValueError(f"layer id {key!r} is not a non-negative integer")
        if not isinstance(slots, list) or not all(_is_int(e) for e in slots):
            raise ValueError(f"layer {key}: slots must be a list of integers")
        layers[int(key)] = tuple(slots)
    return {"num_ranks": data["num_ranks"], "num_logical": data["num_logical"], "layers": layers}


def _check_load(layer: int, values: list[float], num_logical: int) -> list[float]:
    values = [float(v) for v in values]
    if len(values) != num_logical:
        raise ValueError(
            f"layer {layer}: load has {len(values)} values, expected {num_logical} (one per expert)"
        )
    bad = next((e for e, v in enumerate(values) if not math.isfinite(v) or v < 0), None)
    if bad is not None:
        raise ValueError(f"layer {layer}: load of expert {bad} is {values[bad]}, not a finite value >= 0")
    return values


def _contiguous(num_logical: int, num_ranks: int, num_redundant: int) -> tuple[int, ...]:
    """Rank r: a contiguous block of experts, then its share of the redundant slots, each a copy
    of the least-replicated expert it does not host, nearest after its block (cyclically)."""
    per_rank = (num_logical + num_redundant) // num_ranks
    # the last (num_redundant % num_ranks) ranks take one extra redundant slot
    redundant = [
        num_redundant // num_ranks + (r >= num_ranks - num_redundant % num_ranks) for r in range(num_ranks)
    ]
    copies = [1] * num_logical
    slots: list[int] = []
    start = 0
    for r in range(num_ranks):
        end = start + per_rank - redundant[r]
        hosted = set(range(start, end))
        for _ in range(redundant[r]):
            e = min(
                (e for e in range(num_logical) if e not in hosted),
                key=lambda e, end=end: (copies[e], (e - end) % num_logical),
            )
            hosted.add(e)
            copies[e] += 1
        slots += range(start, end)
        slots += sorted(hosted - set(range(start, end)))
        start = end
    return tuple(slots)


def _balanced(load: list[float], num_ranks: int, num_redundant: int) -> tuple[int, ...]:
    num_logical = len(load)
    per_rank = (num_logical + num_redundant) // num_ranks
    copies = [1] * num_logical
    for _ in range(num_redundant):  # one more copy to the highest load per replica (at most one per rank)
        e = max(
            (e for e in range(num_logical) if copies[e] < num_ranks), key=lambda e: (load[e] / copies[e], -e)
        )
        copies[e] += 1
    order = sorted(range(num_logical), key=lambda e: (-load[e] / copies[e], e))
    rank_load = [0.0] * num_ranks
    hosted: list[list[int]] = [[] for _ in range(num_ranks)]
    last_replicated = max((i for i, x in enumerate(order) if copies[x] > 1), default=-1)
    for i, e in enumerate(order):
        # All copies of e at once, each to the least-loaded rank with room that keeps the
        # experts still to place packable (so the greedy never gets stuck on a duplicate).
        free = [per_rank - len(h) for h in hosted]
        ranks = sorted((r for r in range(num_ranks) if free[r]), key=lambda r: (rank_load[r], -free[r], r))
        if i < last_replicated:
            later = heapq.nlargest(per_rank, (copies[x] for x in order[i + 1 :]))
            chosen = _pick(ranks, free, copies[e], later)
        else:
            chosen = ranks[: copies[e]]
        for r in chosen:
            hosted[r].append(e)
            rank_load[r] += load[e] / copies[e]
    return tuple(e for h in hosted for e in sorted(h))


def _pick(ranks: list[int], free: list[int], count: int, later: list[int]) -> list[int]:
    """The first ``count`` of ``ranks`` (in order) that leave the later experts packable. A rank
    is kept if some completion exists; the best completion takes the ranks with the most room."""
    chosen: list[int] = []
    for j, r in enumerate(ranks):
        if len(chosen) == count:
            break
        rest = sorted(ranks[j + 1 :], key=lambda x: -free[x])[: count - len(chosen) - 1]
        taken = {*chosen, r, *rest}
        if _packable([f - (x in taken) for x, f in enumerate(free)], later):
            chosen.append(r)
    return chosen


def _packable(free: list[int], copies_desc: list[int]) -> bool:
    """Whether experts with these copy counts (the largest first) fit into ranks with ``free``
    slots, at most one copy per rank (Gale-Ryser; the total of both sides is equal)."""
    need = 0
    for k, c in enumerate(copies_desc, 1):
        need += c
        if need > sum(min(f, k) for f in free):
            return False
    return True
