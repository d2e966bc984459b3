"""The plots of benchmark results (harness/plots.py): every committed results file of a kind with a
series draws with its plotter and has its PNG committed beside it, and so has every aggregate figure
of a folder (issue 43: every report that has a series has its plot)."""

from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path

import pytest

from harness.plots import (
    AGGREGATES,
    load,
    machine_note,
    plot_aggregate,
    plot_memory,
    plot_result,
    plotter_for,
)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PLOTTED = sorted(p for p in RESULTS.rglob("*.json") if plotter_for(p.name))
FOLDERS = sorted({p.parent for p in RESULTS.rglob("*.json")})
AGGREGATED = [
    (folder, name)
    for folder in FOLDERS
    for name, (pattern, _) in AGGREGATES.items()
    if any(folder.glob(pattern))
]
PNG = b"\x89PNG\r\n\x1a\n"
# results without a series: the GPU kit's stage summaries, parity and V3-engine figures, a GPU
# lease's steps, one offline evaluation's accuracy per task; soak.json keeps no samples (soak.py
# draws its memory plot from the run itself)
NO_SERIES = (
    "*_summary.json",
    "*_parity.json",
    "*_v3_engine.json",
    "lease.json",
    "tiny_chat_eval.json",
    "soak.json",
)


def _id(path: Path) -> str:
    return str(path.relative_to(RESULTS))


def _is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == PNG and path.stat().st_size > 5_000


def test_every_results_file_has_a_plot_kind_or_no_series():
    names = {p.name for p in PLOTTED}
    assert {
        "serving_throughput.json",
        "offline_batch64.json",
        "sim_report.json",
        "eplb_balance.json",
    } <= names
    unplotted = [
        _id(p)
        for p in RESULTS.rglob("*.json")
        if not plotter_for(p.name) and not any(fnmatch(p.name, n) for n in NO_SERIES)
    ]
    assert not unplotted, (
        "register their plotter in harness.plots.PLOTTERS (or NO_SERIES here if they have none)"
    )


@pytest.mark.parametrize("path", PLOTTED, ids=_id)
def test_the_plotter_draws_the_result(path: Path, tmp_path: Path):
    out = tmp_path / path.with_suffix(".png").name
    plotter = plotter_for(path.name)
    assert plotter is not None
    plotter(load(path), out)
    assert _is_png(out)


@pytest.mark.parametrize("path", PLOTTED, ids=_id)
def test_the_result_has_its_plot_beside_it(path: Path):
    png = path.with_suffix(".png")
    assert png.exists() and _is_png(png), f"render it: python -m harness.plots {RESULTS.relative_to(REPO)}"


@pytest.mark.parametrize(("folder", "name"), AGGREGATED, ids=lambda x: x if isinstance(x, str) else _id(x))
def test_the_aggregates_are_drawn_and_committed(folder: Path, name: str, tmp_path: Path):
    assert _is_png(folder / name), f"render it: python -m harness.plots {RESULTS.relative_to(REPO)}"
    pattern, _ = AGGREGATES[name]
    for source in folder.glob(pattern):
        (tmp_path / source.name).write_bytes(source.read_bytes())
    assert plot_aggregate(tmp_path, name) == tmp_path / name
    assert _is_png(tmp_path / name)


def test_plot_result_writes_beside_the_json_and_skips_other_files(tmp_path: Path):
    source = tmp_path / "v4_kv.json"
    source.write_bytes((RESULTS / "v4_kv.json").read_bytes())
    assert plot_result(source) == tmp_path / "v4_kv.png"
    assert _is_png(tmp_path / "v4_kv.png")
    other = tmp_path / "summary.json"
    other.write_text("{}")
    assert plot_result(other) is None and not (tmp_path / "summary.png").exists()
    assert plot_result(None) is None


def test_the_soak_memory_plot(tmp_path: Path):
    memory = {
        "gateway": [(t, 90.0 + t / 100) for t in range(0, 600, 2)],
        "rank decode/0/0": [(t, 800.0) for t in range(0, 600, 2)],
    }
    assert plot_memory(memory, [60.0, 300.0], tmp_path / "soak.png") == tmp_path / "soak.png"
    assert _is_png(tmp_path / "soak.png")


def test_the_footnote_names_machine_date_and_commit():
    doc = {
        "date": "2026-11-24T11:31:10+00:00",
        "machine": {"cpu_model": "AMD EPYC", "online_cpus": 2},
        "git": {"commit": "f001f4f517e442ccfb57fbfdd2e6d5223542a26f", "dirty": False},
    }
    assert machine_note(doc) == "machine: AMD EPYC, 2 CPUs · date: 2026-11-24 11:31 · commit: f001f4f"
    gpu = {"meta": {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-26", "git": {"commit": "0bc4052b9d"}}}
    assert machine_note(gpu) == "machine: NVIDIA H100 80GB HBM3 · date: 2026-11-26 · commit: 0bc4052"
    assert machine_note({}) == ""
