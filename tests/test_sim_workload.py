"""Traffic profiles: calibration reproduces the published aggregates, sampling is reproducible
and prefix-consistent across loads, the day/night curve carries the daily volume."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dsinfer.sim.workload import (
    DAY,
    TrafficError,
    TrafficProfile,
    arrivals,
    calibrate,
    mean_rate,
    rate_at,
    sample,
)
from harness.provenance import REPO

DEEPSEEK = REPO / "configs" / "traffic" / "deepseek-v3-day-night.yaml"


def test_shipped_profiles_load() -> None:
    for path in sorted((REPO / "configs" / "traffic").glob("*.yaml")):
        profile = TrafficProfile.load(path)
        calibrate(profile)


def test_calibration_reproduces_published_aggregates() -> None:
    profile = TrafficProfile.load(DEEPSEEK)
    lengths = calibrate(profile)
    assert lengths.mean_decode_context == pytest.approx(4989, rel=0.01)
    assert lengths.cache_hit_fraction == pytest.approx(0.563, abs=0.01)
    assert lengths.mean_prompt / lengths.mean_output == pytest.approx(608 / 168, rel=0.01)
    # the daily volume at the mean rate
    assert mean_rate(profile) * DAY * lengths.mean_prompt == pytest.approx(608e9, rel=1e-9)
    reqs = sample(profile, 20000, seed=3)
    assert reqs.cached.sum() / reqs.prompt.sum() == pytest.approx(0.563, abs=0.03)
    assert np.all(reqs.cached % 64 == 0) and np.all(reqs.cached < reqs.prompt)
    assert reqs.prompt.max() <= profile.max_context
    # continuations reuse the conversation of an earlier request
    cont = reqs.cached > 0
    assert 0 < cont.mean() < 1 and len(np.unique(reqs.session[cont])) < cont.sum()


def test_common_random_numbers() -> None:
    profile = TrafficProfile.load(DEEPSEEK)
    low = arrivals(profile, 50.0, 20.0, seed=1)
    high = arrivals(profile, 100.0, 20.0, seed=1)
    n = len(low.arrival)
    assert len(high.arrival) > 1.5 * n
    assert np.array_equal(high.prompt[:n], low.prompt) and np.array_equal(high.output[:n], low.output)
    assert np.allclose(high.arrival[:n] * 2, low.arrival)
    again = arrivals(profile, 50.0, 20.0, seed=1)
    assert np.array_equal(again.cached, low.cached)


def test_day_night_curve() -> None:
    profile = TrafficProfile.load(DEEPSEEK)
    t = np.linspace(0, DAY, 24 * 60, endpoint=False)
    rates = rate_at(profile, t)
    assert rates.mean() == pytest.approx(mean_rate(profile), rel=1e-6)
    assert rates.max() / rates.min() == pytest.approx(2.0, rel=1e-3)
    assert t[np.argmax(rates)] / 3600 == pytest.approx(14.0, abs=0.05)


def test_invalid_profiles(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ndaily_input_tokens: 1e9\n")
    with pytest.raises(TrafficError, match="daily_output_tokens"):
        TrafficProfile.load(bad)
    with pytest.raises(TrafficError, match="no such traffic file"):
        TrafficProfile.load(tmp_path / "missing.yaml")
    base = dict(
        name="x", daily_input_tokens=1e9, daily_output_tokens=1e9, new_tokens={"sigma": 1, "max": 1000}
    )
    with pytest.raises(ValueError, match="exactly one of"):
        TrafficProfile(**base, output={"sigma": 1, "max": 1000})  # type: ignore[arg-type]
    tight = dict(base, new_tokens={"sigma": 1, "max": 10})
    unreachable = TrafficProfile(**tight, output={"sigma": 0.5, "max": 100, "median": 50})  # type: ignore[arg-type]
    with pytest.raises(TrafficError, match="cannot reach"):
        calibrate(unreachable)
