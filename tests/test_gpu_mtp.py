"""scripts/gpu-mtp's plumbing on CPU: arguments, the deadline, and one archive of the outputs."""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu-mtp"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_no_stage_packs_the_events_and_the_machine(tmp_path: Path) -> None:
    done = _run(str(tmp_path), "--stages", "none", "--deadline-s", "30")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.log", "results.tgz"]
    with tarfile.open(tmp_path / "results.tgz") as archive:
        names = {Path(n).name for n in archive.getnames()}
    assert {"events.log", "gpu.csv"} <= names
    assert "done" in (tmp_path / "events.log").read_text()


def test_a_stage_without_time_left_is_skipped(tmp_path: Path) -> None:
    done = _run(str(tmp_path), "--stages", "tiny_f32", "--deadline-s", "5")
    assert done.returncode == 0, done.stderr
    assert "skip mtp_speed_tiny_f32" in (tmp_path / "events.log").read_text()


def test_an_unknown_argument_is_refused(tmp_path: Path) -> None:
    done = _run(str(tmp_path), "--stage", "x")
    assert done.returncode == 2 and "unknown argument --stage" in done.stderr
