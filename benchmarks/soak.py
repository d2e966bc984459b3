"""Soak drill: hours of steady streaming load on the all-in-one server while its processes are
killed, and what is left afterwards (harness/soak.py has the drill).

    python benchmarks/soak.py --minutes 60 --rate 2 --fault-every 60 \
        --out benchmarks/results/soak_60min

The server: PD, two prefill pools and two decode pools of two ranks (EP2), the built-in model.
Reported: requests completed with their undisturbed text, with other text, with an error (by
why) and hung; the KV pages held after the load; every process's resident memory over time and
its growth over the last three quarters of the run; a plot (memory per process, faults marked).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from harness.plots import plot_memory
from harness.progress import progress
from harness.provenance import provenance
from harness.results import fmt, report_header, save_report, table
from harness.server import serve
from harness.soak import FAULTS, TOPOLOGY, SoakPlan, SoakResult, growth, run_soak

GROWTH_LIMIT = 0.10  # a process whose memory grew more over the watched window is reported


def summarize(result: SoakResult, plan: SoakPlan) -> dict[str, Any]:
    since = plan.duration / 4  # the last three quarters (45 of 60 minutes)
    memory = {
        label: {
            "first_mib": samples[0][1],
            "last_mib": samples[-1][1],
            "peak_mib": max(m for _, m in samples),
            "growth_last_3_4": growth(samples, since),
        }
        for label, samples in sorted(result.memory.items())
    }
    verdicts = result.verdicts()
    return {
        "requests": len(result.outcomes),
        "identical": verdicts["identical"],
        "different": verdicts["different"],
        "errored": verdicts["error"],
        "hung": verdicts["hung"],
        "errors": dict(result.errors().most_common()),
        "different_examples": [o.why for o in result.outcomes if o.verdict == "different"][:5],
        "lost": verdicts["different"] + verdicts["hung"],
        "faults": [vars(f) for f in result.faults],
        "kv_held_after": result.kv_after,
        "memory": memory,
        "grew_over_limit": [
            label
            for label, m in memory.items()
            if m["growth_last_3_4"] is not None and m["growth_last_3_4"] > GROWTH_LIMIT
        ],
        "seconds": result.seconds,
    }


def markdown(report: dict[str, Any]) -> list[str]:
    s = report["summary"]
    lines = ["# Soak drill", "", *report_header(report), ""]
    lines += [
        f"{s['requests']} requests over {s['seconds'] / 60:.1f} min, {len(s['faults'])} faults: "
        f"**{s['identical']} identical to the undisturbed run, {s['different']} different, "
        f"{s['errored']} errored, {s['hung']} hung**; KV held after the load: "
        f"{s['kv_held_after'] or 'none'}; processes whose memory grew over 10% in the last "
        f"three quarters: {', '.join(s['grew_over_limit']) or 'none'}.",
        "",
        "![resident memory per process](soak.png)",
        "",
        "## Errors",
        "",
    ]
    lines += table(["why", "requests"], s["errors"].items(), "lr") if s["errors"] else ["none"]
    lines += ["", "## Faults", ""]
    lines += table(
        ["at (s)", "fault", "target", "ready again after (s)"],
        [
            (fmt(f["at"], digits=0), f["kind"], f["target"], fmt(f["recovered_after"], digits=1))
            for f in s["faults"]
        ],
        "rllr",
    )
    lines += ["", "## Resident memory", ""]
    lines += table(
        ["process", "first MiB", "last MiB", "peak MiB", "growth, last 3/4"],
        [
            (
                label,
                fmt(m["first_mib"], digits=0),
                fmt(m["last_mib"], digits=0),
                fmt(m["peak_mib"], digits=0),
                "-" if m["growth_last_3_4"] is None else f"{100 * m['growth_last_3_4']:+.1f}%",
            )
            for label, m in s["memory"].items()
        ],
        "lrrrr",
    )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=60.0, help="minutes of load")
    p.add_argument("--rate", type=float, default=2.0, help="requests sent per second")
    p.add_argument("--fault-every", type=float, default=60.0, help="seconds from recovery to the next fault")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--out", type=Path, required=True, help="directory for soak.json, soak.md, soak.png")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    plan = SoakPlan(
        duration=args.minutes * 60,
        rate=args.rate,
        fault_every=args.fault_every,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory() as logs,
        serve(TOPOLOGY, Path(logs), startup_timeout=300, say=progress) as server,
    ):
        result = run_soak(server, plan, progress)
    report = {**provenance(), "plan": vars(plan), "topology": TOPOLOGY, "fault_kinds": FAULTS}
    report["summary"] = summarize(result, plan)
    plot_memory(result.memory, [f.at for f in result.faults], args.out / "soak.png")
    save_report(report, "\n".join(markdown(report)) + "\n", args.out / "soak.json", args.out / "soak.md")
    progress(f"written {args.out}/soak.json, soak.md and soak.png")


if __name__ == "__main__":
    main()
