"""Closed-form decode estimates: a pool's per-user speed at a given batch and context, and the
batch a pool settles at while serving a request rate (the simulator's warm start, the planner)."""

from __future__ import annotations

import math

import numpy as np

from dsinfer.sim.cache import SimCache
from dsinfer.sim.cost import decode_step
from dsinfer.sim.deployment import Assumptions, PoolSpec


def analytic_decode_speed(
    spec: PoolSpec, a: Assumptions, batch: float, context: float, cache: SimCache | None = None
) -> float:
    """Tokens/s per user with ``batch`` requests of mean ``context`` on every rank (no imbalance
    beyond the expert placement's, no routing noise)."""
    pm = (cache or SimCache()).pool_model(spec, a)
    ranks = spec.pool_size
    cost = decode_step(pm, np.full(ranks, batch), np.full(ranks, batch * context), None)
    per_step = 1.0 + (a.mtp_acceptance if pm.mtp else 0.0)
    return per_step / cost.time if cost.time > 0 else math.inf


def stationary_batch(
    spec: PoolSpec,
    a: Assumptions,
    rate: float,
    mean_output: float,
    context: float,
    slowdown: float = 1.0,
    cache: SimCache | None = None,
) -> float:
    """Requests per rank of a decode pool serving ``rate`` requests/s at its own speed (fixed
    point), with steps ``slowdown`` times the analytic step time; capped at 4 x max_num_seqs."""
    ranks = spec.pool_size
    cache = cache or SimCache()
    lo, hi = 0.0, 4.0 * spec.max_num_seqs
    for _ in range(40):
        mid = (lo + hi) / 2
        speed = analytic_decode_speed(spec, a, max(mid, 1e-3), context, cache) / slowdown
        served = mid * ranks * speed / mean_output  # requests/s the pool finishes at batch ``mid``
        lo, hi = (mid, hi) if served < rate else (lo, mid)
    return (lo + hi) / 2
