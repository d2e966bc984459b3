"""``dsinfer plan --cache-hits``: a measured KV-cache hit rate instead of the traffic profile's, and
what the cache saves in nodes (the same plan again with no hits).

The rate is a fraction, or a ``benchmarks/kv_replay.py`` result (its ``--out`` JSON): the share of
input tokens its settings served from cache, the best dsinfer setting's unless ``FILE:SETTING``
names one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dsinfer.cli.errors import UsageError

PEERS = ("vllm",)  # kv_replay settings that are not dsinfer's


def measured_hit_fraction(spec: str) -> tuple[float, str]:
    """(fraction, where it came from) for ``--cache-hits``."""
    try:
        value = float(spec)
    except ValueError:
        return _from_replay(spec)
    if not 0.0 <= value < 1.0:
        raise UsageError(f"--cache-hits {spec}: a fraction of input tokens, in [0, 1)")
    return value, "given"


def _from_replay(spec: str) -> tuple[float, str]:
    path, _, setting = spec.partition(":") if not Path(spec).exists() else (spec, "", "")
    try:
        runs = json.loads(Path(path).read_text())["runs"]
        shares = {r["setting"]: float(r["share_total"]) for r in runs}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"--cache-hits {spec}: not a fraction nor a kv_replay result ({e})") from None
    ours = {name: share for name, share in shares.items() if name not in PEERS}
    if setting:
        if setting not in shares:
            raise UsageError(f"--cache-hits {spec}: no setting {setting!r} (it has {', '.join(shares)})")
        chosen = setting
    elif ours:
        chosen = max(ours, key=lambda name: ours[name])
    else:
        raise UsageError(f"--cache-hits {spec}: no dsinfer setting in it")
    share = shares[chosen]
    if not 0.0 <= share < 1.0:
        raise UsageError(
            f"--cache-hits {spec}: setting {chosen!r} served {share:.1%}, not a fraction in [0, 1)"
        )
    return share, f"{path}, setting {chosen}"


def saving_lines(
    with_cache: dict[str, float], without: dict[str, float], fraction: float, source: str
) -> list[str]:
    """Daily mean nodes (``PlanResult.mean_nodes``) with the measured hits and with none."""
    saved = without["total"] - with_cache["total"]
    share = saved / without["total"] if without["total"] else 0.0
    return [
        "",
        f"  KV cache: {fraction:.1%} of input tokens served from cache ({source})",
        f"  without it: {without['total']:.1f} nodes (prefill {without['prefill']:.1f}, decode {without['decode']:.1f}); "
        f"the cache saves {saved:.1f} nodes ({share:.0%})",
    ]


def plan_without_hits(traffic: Any) -> Any:
    return traffic.model_copy(update={"cache_hit_fraction": 0.0})
