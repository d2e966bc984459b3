"""Stage ``gpu-tests``: ``pytest -m gpu`` over tests/ (the tests marked ``@pytest.mark.gpu``), with
a JUnit report whose counts become the figures. On a CPU every one of them skips: the stage is
then "skip", with the number collected."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

from .common import ROOT, StageContext, StageResult, run_logged


def marked_files() -> list[str]:
    """Test files holding a GPU-marked test (collecting all of tests/ takes long on 2 cores)."""
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").glob("test_*.py")
        if "pytest.mark.gpu" in p.read_text()
    )


def run(ctx: StageContext, result: StageResult) -> None:
    junit = ctx.out / "junit.xml"
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
    ]
    argv += marked_files()
    code, tail = run_logged(argv, ctx.out / "pytest.log", ctx.budget_s * 0.95)
    if not junit.is_file():
        result.error = f"pytest wrote no report (exit {code}):\n{tail}"
        return
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite is not None
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [
        case.get("classname", "") + "::" + case.get("name", "")
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    result.figures.update(
        counts, passed=counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    )
    result.figures["failed"] = failed
    result.check("no GPU test failed", not failed and counts["errors"] == 0, ", ".join(failed))
    result.check("pytest finished", code is not None, "killed at the time limit" if code is None else "")
    if counts["tests"] and counts["skipped"] == counts["tests"]:
        result.skipped = f"all {counts['tests']} GPU tests skipped (no CUDA)"
    result.summary = (
        f"{result.figures['passed']} passed, {counts['failures'] + counts['errors']} failed, "
        f"{counts['skipped']} skipped of {counts['tests']}"
    )
