"""``dsinfer plan``: the plan meets the SLO in the simulator and one pool fewer of either role
does not; serve profiles feed it through the serve parser."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dsinfer.cli.errors import UsageError
from dsinfer.cli.main import main
from dsinfer.cli.plan import load_pool_specs
from dsinfer.cli.plan_cache import measured_hit_fraction
from dsinfer.sim import planner
from dsinfer.sim.deployment import Assumptions
from dsinfer.sim.workload import DAY, TrafficProfile, mean_rate

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parent.parent
TRAFFIC_FILE = ROOT / "configs" / "traffic" / "small-day-night.yaml"
WINDOW = planner.SimWindow(duration=8.0, warmup=2.0, prefill_duration=30.0)

PREFILL_PROFILE = """role: prefill
model: deepseek-v3
pool-size: 8
nnodes: 1
num-redundant-experts: 8
enable-overlap: true
speculative-mtp: true
max-num-batched-tokens: 2048
"""
DECODE_PROFILE = """role: decode
model: deepseek-v3
pool-size: 16
nnodes: 2
num-redundant-experts: 16
speculative-mtp: true
kv-cache-memory: 40GiB
max-num-seqs: 128
"""


@pytest.fixture()
def profiles(tmp_path: Path) -> list[str]:
    (tmp_path / "p.yaml").write_text(PREFILL_PROFILE)
    (tmp_path / "d.yaml").write_text(DECODE_PROFILE)
    return [str(tmp_path / "p.yaml"), str(tmp_path / "d.yaml")]


def test_profiles_to_pool_specs(profiles: list[str], tmp_path: Path) -> None:
    specs = load_pool_specs(profiles, ["decode.enable-overlap=true", "decode.max-num-seqs=100"])
    p, d = specs["prefill"], specs["decode"]
    assert (p.pool_size, p.nnodes, p.num_redundant_experts, p.overlap, p.max_num_batched_tokens) == (
        8,
        1,
        8,
        True,
        2048,
    )
    assert (d.pool_size, d.nnodes, d.overlap, d.mtp, d.max_num_seqs, d.kv_cache_bytes) == (
        16,
        2,
        True,
        True,
        100,
        40 * 2**30,
    )
    with pytest.raises(UsageError, match="no decode profile"):
        load_pool_specs(profiles[:1], [])
    with pytest.raises(UsageError, match=r"ROLE\.KEY=VALUE"):
        load_pool_specs(profiles, ["gateway.x=1"])
    (tmp_path / "bad.yaml").write_text("role: prefill\nno-such-flag: 1\n")
    with pytest.raises(UsageError, match="unknown key"):
        load_pool_specs([str(tmp_path / "bad.yaml"), profiles[1]], [])
    # the shipped H800 profiles load
    shipped = [
        str(ROOT / "configs" / "profiles" / f"deepseek-v3-h800-{r}.yaml")
        for r in ("prefill-ep32", "decode-ep144")
    ]
    specs = load_pool_specs(shipped, [])
    assert (specs["prefill"].pool_size, specs["decode"].pool_size) == (32, 144)


def test_plan_is_minimal_in_the_simulator(profiles: list[str]) -> None:
    traffic = TrafficProfile.load(TRAFFIC_FILE)
    specs = load_pool_specs(profiles, ["decode.enable-overlap=true"])
    result = planner.plan(traffic, specs["prefill"], specs["decode"], Assumptions(), blocks=4, window=WINDOW)
    assert result.verified()
    for block in result.blocks:
        assert block.checks["plan"][0]
        for role in ("prefill", "decode"):
            if (block.prefill_pools if role == "prefill" else block.decode_pools) > 1:
                assert block.checks[f"{role}-1"][0] is False
    day, *_, night = sorted(result.blocks, key=lambda b: -b.peak_rate)
    assert day.prefill_pools > night.prefill_pools and day.decode_pools > night.decode_pools
    nodes = result.mean_nodes(traffic)
    assert nodes["total"] == pytest.approx(nodes["prefill"] + nodes["decode"])
    assert result.peak_nodes() >= nodes["total"]
    # the capacities carry the daily volume
    assert mean_rate(traffic) * DAY > 0 and result.capacity["decode"].rate > 0


def test_cli(profiles: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    argv = ["plan", "--config", profiles[0], "--config", profiles[1], "--traffic", str(TRAFFIC_FILE)]
    argv += [
        "--blocks",
        "2",
        "--duration",
        "4",
        "--prefill-duration",
        "10",
        "--warmup",
        "2",
        "--no-verify",
        "--quiet",
    ]
    argv += ["--prefill-budgets", "2048", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "daily mean nodes" in text and "prefill pool: 1 nodes, EP8" in text
    data = json.loads(out.read_text())
    assert len(data["blocks"]) == 2 and data["mean_nodes"]["total"] > 0
    assert data["prefill_pool"]["attention_token_weight"] is None
    assert main([*argv, "--attention-chunking"]) == 0
    assert "token-equivalents (attention-aware chunking)" in capsys.readouterr().out
    assert 2000 < json.loads(out.read_text())["prefill_pool"]["attention_token_weight"] < 2700
    assert main(["plan", "--config", profiles[0], "--traffic", str(TRAFFIC_FILE)]) == 2
    assert "no decode profile" in capsys.readouterr().err


def test_cli_takes_measured_cache_hits(
    profiles: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A kv_replay result's best dsinfer setting replaces the profile's hit rate, and the plan
    without hits shows what the cache saves; bad values are named."""
    replay = tmp_path / "replay.json"
    runs = [("off", 0.0), ("device", 0.05), ("shared", 0.6), ("vllm", 0.7)]
    replay.write_text(json.dumps({"runs": [{"setting": n, "share_total": v} for n, v in runs]}))
    argv = ["plan", "--config", profiles[0], "--config", profiles[1], "--traffic", str(TRAFFIC_FILE)]
    argv += ["--blocks", "1", "--duration", "4", "--prefill-duration", "10", "--warmup", "2"]
    argv += ["--no-verify", "--quiet", "--prefill-budgets", "2048", "--cache-hits", str(replay)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert f"KV cache: 60.0% of input tokens served from cache ({replay}, setting shared)" in text
    saved = float(text.split("the cache saves ")[1].split(" nodes")[0])
    without = float(text.split("without it: ")[1].split(" nodes")[0])
    with_cache = float(text.split("daily mean nodes: ")[1].split(" ")[0])
    assert saved == pytest.approx(without - with_cache, abs=0.06) and saved > 0

    assert measured_hit_fraction(f"{replay}:device") == (0.05, f"{replay}, setting device")
    assert measured_hit_fraction("0.25") == (0.25, "given")
    for bad, needle in (
        ("1.5", "in [0, 1)"),
        (f"{replay}:nope", "no setting 'nope'"),
        ("x.json", "not a fraction"),
    ):
        with pytest.raises(UsageError, match=re.escape(needle)):
            measured_hit_fraction(bad)
