"""A short schemathesis run (benchmarks/api_fuzz.py: not_a_server_error over the served OpenAPI
schema) against ``dsinfer serve``; the long run's result is benchmarks/results/api_fuzz.md."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "api_fuzz.py"


def test_schemathesis_finds_no_server_error(tmp_path: Path) -> None:
    out = tmp_path / "fuzz.md"
    command = [
        *(sys.executable, str(SCRIPT), "--phases", "fuzzing", "--max-examples", "4"),
        *("--out", str(out), "--log", str(tmp_path / "server.log"), "--timeout", "600"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    report = out.read_text() if out.exists() else done.stdout + done.stderr
    assert done.returncode == 0, report[-6000:]
    cases = re.search(r"(\d+) generated, (\d+) passed", report)
    assert cases is not None and int(cases.group(1)) > 0 and cases.group(1) == cases.group(2), report[-3000:]
