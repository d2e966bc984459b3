"""The expert-load statistics file: tokens routed to each logical expert, per MoE layer, per role.

Written by the gateway (``GET /expert_load``, summed over the ranks of each role) and read by the
placement code (``ExpertPlacement.default(load=...)``, the expert-parallel load balancer)::

    {"format": "dsinfer-expert-load/1",
     "roles": {"decode": {"3": [12, 0, 7, ...], "4": [...]}, "prefill": {...}}}
"""

from __future__ import annotations

import json
from pathlib import Path

FORMAT = "dsinfer-expert-load/1"


def sum_loads(loads: list[dict[int, list[int]]]) -> dict[int, list[int]]:
    """Element-wise sum of per-layer load vectors (ranks of one role)."""
    total: dict[int, list[int]] = {}
    for load in loads:
        for layer, counts in load.items():
            acc = total.setdefault(layer, [0] * len(counts))
            for i, c in enumerate(counts):
                acc[i] += c
    return dict(sorted(total.items()))


def document(per_role: dict[str, dict[int, list[int]]]) -> dict:
    return {
        "format": FORMAT,
        "roles": {
            role: {str(layer): counts for layer, counts in layers.items()}
            for role, layers in per_role.items()
        },
    }


def read_expert_load(path: Path, role: str) -> dict[int, list[float]]:
    """One role's per-layer load from a statistics file; ValueError naming the file otherwise."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read expert load statistics: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not an expert load file (format must be {FORMAT!r})")
    layers = data.get("roles", {}).get(role)
    if not isinstance(layers, dict):
        raise ValueError(f"{path}: no expert load for role {role!r}")
    try:
        return {int(layer): [float(c) for c in counts] for layer, counts in layers.items()}
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: bad expert load entry: {e}") from None
