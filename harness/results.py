"""Results: percentiles and medians of measurements, numbers and markdown tables for reports, and
the JSON and markdown files a benchmark writes."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.provenance import utc_now

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default), None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """``{"p50", "p90", "p99", "mean"}`` of ``values`` (each None for no values)."""
    out: dict[str, float | None] = {f"p{q}": percentile(values, q) for q in PERCENTILES}
    out["mean"] = sum(values) / len(values) if values else None
    return out


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None, or None."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    """``value * scale`` with thousands separators and ``digits`` decimals; "-" for None."""
    return "-" if value is None else f"{value * scale:,.{digits}f}"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> list[str]:
    """A markdown table: ``align`` has one letter per column, ``l`` (default) or ``r``."""
    marks = [("---:" if (align[i : i + 1] == "r") else "---") for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(marks) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def summarize_runs(
    runs: list[dict[str, Any]],
    key: Callable[[dict[str, Any]], tuple[Hashable, ...]],
    fields: Sequence[str],
    name: Callable[[tuple[Hashable, ...]], str] = lambda k: " ".join(map(str, k)),
    order: Callable[[tuple[Hashable, ...]], Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per ``key`` of the runs (named ``name(key)``, sorted, by ``order`` if given): the median of
    each of ``fields`` over its runs, and ``repeats``, how many runs there were."""
    out: dict[str, dict[str, Any]] = {}
    for k in sorted({key(r) for r in runs}, key=order):
        mine = [r for r in runs if key(r) == k]
        out[name(k)] = {**{f: median(r[f] for r in mine) for f in fields}, "repeats": len(mine)}
    return out


def report_header(report: dict[str, Any]) -> list[str]:
    """The markdown bullets a report starts with: date, machine, commit and command, those it has."""
    lines = [f"- date: {report['date']}"] if "date" in report else []
    machine = report.get("machine")
    if machine:
        text = machine if isinstance(machine, str) else ", ".join(f"{k} {v}" for k, v in machine.items())
        lines.append(f"- machine: {text}")
    if "commit" in report:
        lines.append(f"- commit: {report['commit']}")
    if "command" in report:
        lines.append(f"- command: `{report['command']}`")
    return lines


def machine_lines(machine: dict[str, Any]) -> list[str]:
    """The bullets of a ``provenance.run_machine`` record: date and commit, the machine and its
    load, the command."""
    m = machine
    threads = f", {m['torch_threads']} torch threads" if "torch_threads" in m else ""
    return [
        f"- date: {m['date']}; commit {m['commit']}",
        f"- machine: {m['cpu_model']}, ISA {', '.join(m['cpu_isa'])}; {m['online_cpus']} cores{threads}; "
        f"load average before {m['load_before'][0]:.2f}, after {m['load_after'][0]:.2f}",
        f"- command: `{m['command']}`",
    ]


@dataclass
class ToolRun:
    """Another tool's run against a server (schemathesis, lm-eval): its exit code and output, the
    load average at its start and how long it took."""

    code: int
    output: str
    load: tuple[float, float, float]
    seconds: float

    def write(self, path: Path, title: str, facts: Sequence[str], tool: str, summary: str) -> int:
        """The report to ``path``: the ``facts`` as bullets, the machine and its load, the date
        and the seconds, then the tool's own output; ``summary`` printed. -> the tool's code."""
        machine = f"{platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}"
        lines = [f"# {title}", "", *(f"- {fact}" for fact in facts)]
        lines += [f"- machine: {machine}; load average at start {' / '.join(f'{x:.1f}' for x in self.load)}"]
        lines += [f"- date: {utc_now(seconds=False)}, {self.seconds:.0f} s", "", f"{tool}'s output:", ""]
        path.write_text("\n".join([*lines, "```", self.output.strip(), "```", ""]), encoding="utf-8")
        print(f"{summary}, exit code {self.code}, {self.seconds:.0f} s -> {path}")
        return self.code


def run_tool(run: Callable[[], tuple[int, str]]) -> ToolRun:
    """``run()`` (a tool against a server it starts: -> its exit code and output), timed."""
    load, start = os.getloadavg(), time.monotonic()
    code, output = run()
    return ToolRun(code, output, load, time.monotonic() - start)


def add_output_args(
    parser: argparse.ArgumentParser, out: Path | None = None, markdown: Path | None = None
) -> None:
    """``--out`` (the JSON results) and ``--markdown`` (the tables, also printed)."""
    parser.add_argument("--out", type=Path, default=out, help="JSON results")
    parser.add_argument("--markdown", type=Path, default=markdown, help="markdown tables (also printed)")


def choose(parser: argparse.ArgumentParser, value: str, allowed: Iterable[str], what: str) -> list[str]:
    """The comma-separated names of ``value``; one not in ``allowed`` is the parser's error."""
    names, known = value.split(","), list(allowed)
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown {what} {unknown[0]!r}; choose from {', '.join(known)}")
    return names


def jsonable_args(args: argparse.Namespace, leave_out: Iterable[str] = ()) -> dict[str, Any]:
    """The parsed arguments for a report (paths as strings)."""
    skip = set(leave_out)
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in skip}


def write_json(path: Path, doc: Any, indent: int = 1, default: Callable[[Any], Any] = str) -> None:
    """``doc`` as JSON in ``path`` (folders made), replaced whole (a reader never sees half);
    ``default``: what a value JSON has no type for becomes (numpy's floats: ``float``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=indent, default=default) + "\n")
    tmp.replace(path)


def save_report(
    report: dict[str, Any], text: str, out: Path | None, markdown: Path | None, indent: int = 2
) -> None:
    """Print the markdown ``text``; write it to ``markdown`` and the JSON ``report`` to ``out``
    where asked."""
    print(text)
    if out is not None:
        write_json(out, report, indent)
    if markdown is not None:
        markdown.parent.mkdir(parents=True, exist_ok=True)
        markdown.write_text(text)
