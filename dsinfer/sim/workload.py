"""Traffic profiles: a daily volume with a day/night curve, prompt/output lengths, cache hits, SLO.

A profile (configs/traffic/*.yaml) names the published aggregates it must reproduce and the
shapes of the distributions; :func:`calibrate` solves the free parameters so that the traffic has
them. The model is one of conversations:

- every request brings ``new`` input tokens (lognormal, ``new_tokens.sigma``) and gets ``output``
  tokens (lognormal, ``output.sigma``), independent;
- with probability ``q`` it continues a recent conversation (follows one of the last few hundred
  requests): its prompt is that request's prompt and output (the history, cached: whole pages,
  the last prompt token always computed) followed by its new tokens; otherwise it starts one
  (prompt = its new tokens);
  prompts are capped at ``max_context`` (the API's context window) by cutting the history;
- in the stationary state E[P] = E[new] + q (E[P] + E[O]) and hits / input = q (E[P] + E[O]) / E[P],
  so the published input/output ratio R and hit fraction H fix q = H R / (R + 1) and E[new] =
  E[O] (R (1 - q) - q); the mean context per output token (the KV length each decode step attends
  over, averaged over output tokens) E[P] + E[O (O - 1)] / (2 E[O]) then fixes E[O].

Cached tokens are hits of a global cache (DeepSeek's on-disk KV cache on 3FS serves any prefill
rank). Arrivals are Poisson with rate ``mean_rate * (1 + A cos(2 pi (t - peak_hour) / 24 h))``,
``A`` set by ``peak_over_trough``; the mean rate carries ``daily_input_tokens`` per day.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dsinfer.base.documents import read_document

DAY = 86400.0
PAGE = 64
_CALIBRATION_SAMPLES = 200_000
BURN_IN = 5000  # requests drawn and dropped before the first one returned (conversations under way)
RECENT_TURNS = 512  # a continuation follows one of the last this many requests


class TrafficError(ValueError):
    pass


class LogNormal(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    sigma: float = Field(ge=0.0, le=3.0)
    max: int = Field(ge=1)
    median: float | None = Field(default=None, gt=0)  # None: solved by calibration


class DayNight(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    peak_over_trough: float = Field(default=1.0, ge=1.0)
    peak_hour: float = Field(default=14.0, ge=0.0, lt=24.0)


class Slo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    ttft_p90_s: float = Field(default=2.0, gt=0)
    min_tokens_per_s: float = Field(default=20.0, gt=0)  # per user, mean over the decode window


class TrafficProfile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    daily_input_tokens: float = Field(gt=0)
    daily_output_tokens: float = Field(gt=0)
    mean_decode_context: float | None = Field(default=None, gt=0)  # None: output.median given
    cache_hit_fraction: float = Field(default=0.0, ge=0.0, lt=1.0)
    max_context: int = Field(default=65536, ge=2)  # prompt cap (tokens)
    new_tokens: LogNormal  # median solved from the volumes
    output: LogNormal
    day_night: DayNight = DayNight()
    slo: Slo = Slo()
    seed: int = 0

    @model_validator(mode="after")
    def _given(self) -> TrafficProfile:
        if (self.mean_decode_context is None) == (self.output.median is None):
            raise ValueError("give exactly one of mean_decode_context and output.median")
        if self.new_tokens.median is not None:
            raise ValueError("new_tokens.median is solved from the daily volumes; give only sigma and max")
        return self

    @classmethod
    def load(cls, path: str | Path) -> TrafficProfile:
        path = Path(path)
        data = read_document(path, "YAML", "traffic", TrafficError)
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'profile'}: {err['msg'].removeprefix('Value error, ')}"
                for err in e.errors()
            )
            raise TrafficError(f"{path}: {problems}") from None

    @property
    def amplitude(self) -> float:
        r = self.day_night.peak_over_trough
        return (r - 1.0) / (r + 1.0)


@dataclass(frozen=True)
class Lengths:
    """The calibrated parameters and the moments the sampled traffic reaches."""

    new_median: float
    output_median: float
    continuation_prob: float
    mean_prompt: float
    mean_output: float
    mean_decode_context: float
    cache_hit_fraction: float
    mean_new_tokens: float  # computed (not cached) prompt tokens per request


@dataclass(frozen=True)
class Requests:
    """A batch of sampled requests (arrays of one length)."""

    arrival: np.ndarray
    prompt: np.ndarray
    cached: np.ndarray
    output: np.ndarray
    session: np.ndarray  # conversation id: a continuation shares its cached pages with its conversation


def _scaled(median: float, unit: np.ndarray, cap: int) -> np.ndarray:
    return np.clip(np.rint(median * unit), 1, cap)


def _bisect(f, lo: float, hi: float, iters: int = 40) -> float:  # f increasing; geometric steps
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return math.sqrt(lo * hi)


def calibrate(profile: TrafficProfile) -> Lengths:
    """Solve the profile's free parameters (a fraction of a second; callers that need it often keep
    the result, e.g. in a :class:`dsinfer.sim.cache.SimCache`)."""
    ratio = profile.daily_input_tokens / profile.daily_output_tokens
    hit = profile.cache_hit_fraction
    q = hit * ratio / (ratio + 1.0)
    new_per_output = ratio * (1.0 - hit)  # = ratio (1 - q) - q
    rng = np.random.default_rng(12345)
    zo, zn = rng.standard_normal((2, _CALIBRATION_SAMPLES))
    out, nt = profile.output, profile.new_tokens
    uo, un = np.exp(out.sigma * zo), np.exp(nt.sigma * zn)

    def decode_context(om: float) -> float:
        o = _scaled(om, uo, out.max)
        return ratio * float(o.mean()) + float((o * (o - 1)).mean()) / (2 * float(o.mean()))

    if profile.mean_decode_context is None:
        assert out.median is not None
        om = out.median
    else:
        target = profile.mean_decode_context
        if decode_context(float(out.max)) < target:
            raise TrafficError(
                f"{profile.name}: output.max {out.max} cannot reach mean_decode_context {target}"
            )
        om = _bisect(lambda m: decode_context(m) - target, 1e-3, float(out.max))
    mean_output = float(_scaled(om, uo, out.max).mean())
    target_new = new_per_output * mean_output
    if float(_scaled(nt.max, un, nt.max).mean()) < target_new:
        raise TrafficError(f"{profile.name}: new_tokens.max {nt.max} cannot reach a mean of {target_new:.0f}")
    nm = _bisect(lambda m: float(_scaled(m, un, nt.max).mean()) - target_new, 1e-3, float(nt.max))
    # the moments as sampled (the context cap and page rounding move them slightly)
    check = _sample(profile, 100_000, 4321, nm, om, q)
    p, o, c = (x.astype(np.float64) for x in (check.prompt, check.output, check.cached))
    return Lengths(
        new_median=nm,
        output_median=om,
        continuation_prob=q,
        mean_prompt=float(p.mean()),
        mean_output=float(o.mean()),
        mean_decode_context=float(p.mean() + (o * (o - 1)).mean() / (2 * o.mean())),
        cache_hit_fraction=float(c.sum() / p.sum()),
        mean_new_tokens=float((p - c).mean()),
    )


def _streams(seed: int, n: int) -> list[np.random.Generator]:
    return [np.random.default_rng(child) for child in np.random.SeedSequence(seed).spawn(n)]


def sample(profile: TrafficProfile, n: int, seed: int, lengths: Lengths | None = None) -> Requests:
    """``n`` consecutive requests (arrival times 0) of the stationary conversation process. One
    random stream per quantity, so the first ``n`` requests are the same whatever ``n`` is
    (common random numbers across loads). ``lengths``: the profile's calibration, if known."""
    lengths = lengths or calibrate(profile)
    return _sample(profile, n, seed, lengths.new_median, lengths.output_median, lengths.continuation_prob)


def _sample(
    profile: TrafficProfile, n: int, seed: int, new_median: float, output_median: float, q: float
) -> Requests:
    g_n, g_o, g_c, g_s = _streams(seed, 4)
    total = n + BURN_IN
    nt, out = profile.new_tokens, profile.output
    new = _scaled(new_median, np.exp(nt.sigma * g_n.standard_normal(total)), nt.max).astype(np.int64)
    output = _scaled(output_median, np.exp(out.sigma * g_o.standard_normal(total)), out.max).astype(np.int64)
    cont = g_c.random(total) < q
    back = g_s.integers(0, RECENT_TURNS, total)
    prompt = np.empty(total, dtype=np.int64)
    cached = np.zeros(total, dtype=np.int64)
    session = np.empty(total, dtype=np.int64)
    context = np.empty(total, dtype=np.int64)  # per request: its prompt + output (a later turn's history)
    cap = profile.max_context
    sessions = 0
    for i, (fresh, more, cont_i, back_i) in enumerate(
        zip(new.tolist(), output.tolist(), cont.tolist(), back.tolist(), strict=True)
    ):
        fresh = min(fresh, cap)
        if cont_i and i > 0:
            j = max(0, i - 1 - back_i)  # the turn this request follows
            history = min(int(context[j]), cap - fresh)
            p = history + fresh
            cached[i] = min(history, p - 1) // PAGE * PAGE
            session[i] = session[j]
        else:
            p = fresh
            session[i] = sessions
            sessions += 1
        prompt[i] = p
        context[i] = p + more
    keep = slice(BURN_IN, total)
    return Requests(np.zeros(n), prompt[keep], cached[keep], output[keep], session[keep])


def arrivals(
    profile: TrafficProfile, rate: float, duration: float, seed: int, lengths: Lengths | None = None
) -> Requests:
    """Poisson arrivals at a constant ``rate`` (requests/s) over ``duration`` seconds. The same
    seed gives the same requests in the same order at any rate, only closer together."""
    expected = rate * duration
    n_max = int(expected + 10 * math.sqrt(expected) + 20)
    gaps = np.random.default_rng(np.random.SeedSequence(seed).spawn(5)[4]).exponential(size=n_max)
    unit = np.cumsum(gaps)
    n = int(np.searchsorted(unit, expected))
    reqs = sample(profile, n, seed, lengths)
    return Requests(unit[:n] / rate, reqs.prompt, reqs.cached, reqs.output, reqs.session)


def mean_rate(profile: TrafficProfile, lengths: Lengths | None = None) -> float:
    """Requests per second averaged over the day."""
    return profile.daily_input_tokens / DAY / (lengths or calibrate(profile)).mean_prompt


def rate_at(profile: TrafficProfile, t: float | np.ndarray, lengths: Lengths | None = None) -> np.ndarray:
    """Request rate at ``t`` seconds after midnight."""
    phase = 2 * np.pi * (np.asarray(t, dtype=np.float64) / DAY - profile.day_night.peak_hour / 24.0)
    return mean_rate(profile, lengths) * (1.0 + profile.amplitude * np.cos(phase))
