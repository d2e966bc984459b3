"""scripts/gpu-check, the GPU acceptance kit (docs/gpu.md): its CPU smoke run goes through every
stage's plumbing at tiny sizes and writes the summary with every stage present; without CUDA and
without --cpu-smoke it stops with one clear line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts.gpukit.kit import _budgets, parse_args
from scripts.gpukit.stages import BY_NAME

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[1]
KIT = [sys.executable, str(ROOT / "scripts" / "gpu-check")]


@pytest.mark.slow
def test_cpu_smoke_runs_every_stage(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check"
    run = subprocess.run(
        [*KIT, "--cpu-smoke", "--out", str(out)], capture_output=True, text=True, timeout=900
    )
    summary = json.loads((out / "summary.json").read_text())
    statuses = {r["stage"]: r["status"] for r in summary["stages"]}
    assert list(statuses) == list(BY_NAME), statuses
    failed = {
        r["stage"]: (r["summary"], r.get("error"), [c for c in r["checks"] if not c["ok"]])
        for r in summary["stages"]
        if r["status"] == "fail"
    }
    assert not failed, failed
    assert run.returncode == 0, run.stderr[-3000:]
    assert statuses["gpu-tests"] == "skip"  # every GPU test skips on a CPU; the rest ran
    assert statuses["ncu"] == "skip"  # no Nsight Compute on a CPU: its drivers ran unprofiled
    assert all(s == "pass" for name, s in statuses.items() if name not in ("gpu-tests", "ncu")), statuses
    markdown = (out / "summary.md").read_text()
    assert markdown.startswith("# gpu-check (CPU smoke")
    for name in BY_NAME:
        assert f"| {name} | " in markdown and f"## {name}: " in markdown
        assert (out / name / "result.json").is_file()
    kernels = next(r for r in summary["stages"] if r["stage"] == "kernels")
    assert kernels["figures"]["mla"] and kernels["figures"]["grouped_gemm"] and kernels["figures"]["sparse"]
    assert kernels["figures"]["library_errors"] == []  # the libraries are absent on a CPU: nothing raised


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_without_cuda_one_clear_line(tmp_path: Path) -> None:
    run = subprocess.run([*KIT, "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA GPU here"), run.stdout
    assert "--cpu-smoke" in lines[0] and not run.stderr.strip()


def test_stage_selection_and_budgets(tmp_path: Path) -> None:
    args = parse_args(["--out", str(tmp_path), "--stages", "kernels,env", "--budget-s", "kernels=30"])
    assert [s.name for s in args.selected] == ["kernels", "env"]  # the order given
    assert args.budgets == {"kernels": 30.0}
    assert _budgets("45") == dict.fromkeys(BY_NAME, 45.0)
    assert [s.name for s in parse_args(["--out", "x", "--skip", "server,v3-engine"]).selected] == [
        n for n in BY_NAME if n not in ("server", "v3-engine")
    ]
    with pytest.raises(SystemExit):
        parse_args(["--out", "x", "--stages", "nope"])
    with pytest.raises(ValueError, match="unknown stage"):
        _budgets("nope=3")


def test_env_stage_checks_every_dependency() -> None:
    """The env stage fails fast on a package dsinfer needs (a GPU run once lost two stages to a
    missing llguidance): every dependency in pyproject.toml is among the imports it checks."""
    import tomllib
    from packaging.requirements import Requirement

    from scripts.gpukit.stage_env import IMPORT_NAMES, NEEDED, TRANSFER

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    checked = {name for name, _ in NEEDED} | set(TRANSFER)
    for dep in deps:
        dist = Requirement(dep).name.lower()
        module = IMPORT_NAMES.get(dist, dist.replace("-", "_"))
        assert module in checked, f"{dist} ({module}) is not checked by the env stage"


def test_a_stage_killed_at_its_limit_keeps_its_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage's checks are saved as they pass: a stage killed at its limit (a GPU run once lost a
    parity stage's finished checks that way) reports them, and fails."""
    import time

    from scripts.gpukit import kit
    from scripts.gpukit.common import StageResult

    def killed(argv: list[str], log_path: Path, timeout: float, env: dict[str, str] | None = None):
        partial = StageResult("parity", autosave=log_path.parent)
        partial.check("float32 tokens equal", True, "7/7")
        return None, "tail of the log"

    monkeypatch.setattr(kit, "run_logged", killed)
    args = parse_args(["--out", str(tmp_path), "--stages", "parity"])
    result = kit.run_stage(BY_NAME["parity"], args, time.monotonic() + 600)
    assert result["status"] == "fail" and result["partial"]
    assert result["summary"].startswith("killed at its") and "after 1 checks (kept)" in result["summary"]
    assert [c["name"] for c in result["checks"]] == ["float32 tokens equal"]
    assert "autosave" not in json.loads((tmp_path / "parity" / "result.json").read_text())
