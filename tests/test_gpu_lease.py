"""scripts/gpu-lease, the prepared command for a lent GPU machine: its default plan names real kit
stages and leaves phase 2 its reserve; its CPU smoke runs both phases, checks the archives when
they are there, and packs no more files than the device tool brings back."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from scripts.gpukit.lease import PACK_LIMIT, PHASE1, PHASE2, PHASE2_WITHOUT_LIBRARIES, parse_args
from scripts.gpukit.stages import BY_NAME

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[1]
LEASE = [sys.executable, str(ROOT / "scripts" / "gpu-lease")]


def test_default_plan() -> None:
    args = parse_args(["--out", "o", "--pack", "p"])
    assert args.phase1 == list(PHASE1) and args.phase2 == list(PHASE2)
    for name in (*PHASE1, *PHASE2, *PHASE2_WITHOUT_LIBRARIES):
        assert name in BY_NAME, name
    assert "adapters" in PHASE2 and "adapters" not in PHASE1  # the libraries' check waits for their builds
    assert 0 < args.phase2_reserve_s < args.deadline_s <= 600 - 30  # the device tool's 10-minute call
    with pytest.raises(SystemExit):
        parse_args(["--out", "o", "--pack", "p", "--phase1", "nope"])


def test_cpu_smoke(tmp_path: Path) -> None:
    sources = tmp_path / "sources"
    sources.mkdir()  # no archives: the check must say so, not pass
    run = subprocess.run(
        [*LEASE, "--cpu-smoke", "--out", str(tmp_path / "work"), "--pack", str(tmp_path / "pack"),
         "--sources", str(sources), "--phase1", "env,ncu", "--phase2", "v3-graphs", "--deadline-s", "300"],
        capture_output=True, text=True, timeout=400, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    packed = sorted(p.name for p in (tmp_path / "pack").iterdir())
    assert packed == ["lease.json", "lease.md", "phase1_summary.md", "phase2_summary.md", "results.tgz"]
    assert len(packed) <= PACK_LIMIT
    meta = json.loads((tmp_path / "pack" / "lease.json").read_text())
    assert [s["step"] for s in meta["steps"]] == ["phase1", "builds", "phase2"]
    assert meta["steps"][0]["stages"] == {"env": "pass", "ncu": "skip"}
    assert meta["steps"][2]["stages"] == {"v3-graphs": "pass"}
    assert all("archive check FAILED" in b["note"] for b in meta["builds"]), meta["builds"]
    text = (tmp_path / "pack" / "lease.md").read_text()
    assert (
        text.startswith("# gpu-lease (CPU smoke)") and "| phase2 |" in text and "| v3-graphs | PASS |" in text
    )
    with tarfile.open(tmp_path / "pack" / "results.tgz") as tar:
        names = tar.getnames()
    assert "lease/phase1/summary.json" in names and "lease/phase2/v3-graphs/result.json" in names


def test_deepgemm_build() -> None:
    """DeepGEMM is built once, by the system's g++ where there is one (the image's /opt/gcc links
    libstdc++ statically, and such a DeepGEMM crashes at its first call), and self-tested under
    nvcc's JIT first."""
    from scripts.gpukit.lease import LIBRARIES, deepgemm_variants

    ((name, env),) = deepgemm_variants()
    assert name == "deep-gemm" and LIBRARIES[name] == "deep_gemm"
    if Path("/usr/bin/g++").exists():
        assert env["CXX"] == "/usr/bin/g++" and env["LDSHARED"].startswith("/usr/bin/g++ -shared")
    else:
        assert env == {}
    assert parse_args(["--out", "o", "--pack", "p"]).deepgemm_jit == "nvcc"
