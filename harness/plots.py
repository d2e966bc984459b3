"""Plots of benchmark results: one PNG beside each results JSON that has a series (numbers over
concurrency, batch, context, time, steps, ranks or runs), so that a report's tables come with a
picture of them.

``PLOTTERS`` maps a results file's name (a glob) to the function that draws it from the loaded
JSON; ``AGGREGATES`` draws one figure over several files of a folder (throughput against batch
over the offline runs, the serving runs one after another). ``plot_result(json_path)`` writes
``<name>.png`` beside ``<name>.json`` (and refreshes the folder's aggregates that file is part
of); ``python -m harness.plots benchmarks/results`` renders every one. The figures are drawn on
matplotlib's ``Figure`` (saved through its Agg canvas: no pyplot, no global state), with titles,
axes with units and a footnote of the machine, date and commit the results record.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from fnmatch import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

Doc = dict[str, Any]
Plotter = Callable[[Doc, Path], None]
Aggregate = Callable[[list[tuple[str, Doc]], Path], None]

DPI = 100
PERCENTILE_KEYS = ("p50", "p90", "p99")
ENGINE_COLORS = {"dsinfer": "tab:blue", "vllm": "tab:orange", "transformers": "tab:green"}
POLICY_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive")
RATIO_TICKS = (1, 1.25, 1.5, 2, 3, 5, 10, 20, 30)


# Figures ---------------------------------------------------------------------------------------
def figure(panels: int = 1, cols: int = 1, size: tuple[float, float] = (10, 5)) -> tuple[Figure, list[Axes]]:
    """A figure of ``panels`` axes in ``cols`` columns (more axes than panels are hidden)."""
    from matplotlib.figure import Figure

    rows = -(-panels // cols)
    fig = Figure(figsize=size)
    axes = list(fig.subplots(rows, cols, squeeze=False).ravel())
    for ax in axes[panels:]:
        ax.set_visible(False)
    return fig, axes[:panels]


def save(fig: Figure, path: Path, title: str, note: str = "") -> Path:
    """``fig`` with its title and the footnote ``note`` to ``path`` (a PNG of 256 colours)."""
    fig.suptitle(title, fontsize=12)
    fig.tight_layout(rect=(0, 0.03 if note else 0, 1, 1))
    if note:
        fig.text(0.005, 0.005, note, fontsize=7, color="dimgray", ha="left", va="bottom")
    from PIL import Image  # matplotlib's own dependency

    drawn = io.BytesIO()
    fig.savefig(drawn, dpi=DPI, format="png")
    # a 256-colour palette: a third of the bytes of matplotlib's RGBA, the same to the eye
    Image.open(drawn).convert("RGB").quantize(256).save(path, format="png", optimize=True)
    return path


def _places(doc: Doc) -> list[Doc]:
    return [p for p in (doc, doc.get("meta"), doc.get("machine")) if isinstance(p, dict)]


def _first(doc: Doc, keys: Sequence[str]) -> Any:
    """The first of ``keys`` set in the results, their ``meta`` or their ``machine``."""
    return next((p[k] for p in _places(doc) for k in keys if p.get(k)), None)


def _machine(doc: Doc) -> str:
    machine = doc.get("machine") or (doc.get("meta") or {}).get("machine")
    if isinstance(machine, str):
        return machine.split(";")[0]
    if isinstance(machine, dict):
        model = str(machine.get("cpu_model") or machine.get("cpu") or "?")
        cpus = machine.get("online_cpus") or machine.get("cores")
        return f"{model}, {cpus} CPUs" if cpus and "core" not in model else model
    device = _first(doc, ("device",))
    return str(device.get("name") if isinstance(device, dict) else device or "")


def _commit(doc: Doc) -> str:
    commit = _first(doc, ("commit", "git_commit", "git", "dsinfer_git"))
    if isinstance(commit, dict):
        commit = commit.get("commit")
    return str(commit).split()[0][:7] if commit else ""


def machine_note(doc: Doc) -> str:
    """The footnote: machine (CPU model and CPUs, or the GPU), date and commit, those recorded."""
    date = str(_first(doc, ("date", "date_utc")) or "")[:16].replace("T", " ")
    parts = [("machine", _machine(doc)), ("date", date), ("commit", _commit(doc))]
    return " · ".join(f"{name}: {value}" for name, value in parts if value)


def _bars(
    ax: Axes,
    labels: Sequence[str],
    series: dict[str, Sequence[float | None]],
    points: dict[str, Sequence[Sequence[float]]] | None = None,
) -> None:
    """Grouped vertical bars: one group per label, one bar per series (None: no bar); ``points``:
    the single measurements behind a series' bars (its passes or repeats), as dots on them."""
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, [float("nan") if v is None else v for v in values], width, label=name)
        for x, dots in zip(xs, (points or {}).get(name, ()), strict=False):
            _dots(ax, x, dots)
    ax.set_xticks(range(len(labels)), labels)


def _round(n: float) -> str:
    for size, suffix in ((2**20, "M"), (2**10, "K")):
        if n >= size and n % size == 0:
            return f"{n // size:g}{suffix}"
    return f"{n:g}"


def _log2_x(ax: Axes, values: Iterable[float], label: str) -> None:
    """A log-2 x axis labelled ``label`` with a tick at each of ``values`` (1K, 1M where round)."""
    ticks = sorted(set(values))
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [_round(t) for t in ticks])
    ax.set_xlabel(f"{label} (log scale)")


def _log_y(ax: Axes, label: str) -> None:
    """A log y axis labelled ``label``, its ticks as plain numbers (40, not 4 x 10^1)."""
    from matplotlib.ticker import LogFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(LogFormatter())
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
    ax.set_ylabel(f"{label} (log scale)")


def _dots(ax: Axes, x: float, values: Iterable[float], color: str = "black") -> None:
    """Single measurements (passes, repeats) as small dots over a bar or line."""
    ys = list(values)
    ax.scatter([x] * len(ys), ys, s=12, color=color, zorder=3)


# Throughput: serving and offline ----------------------------------------------------------------
def plot_serving_throughput(doc: Doc, path: Path) -> None:
    """Output tok/s of every server over HTTP (median bar, one dot a pass) and of both offline
    engines in the same run."""
    fig, (ax,) = figure(size=(9, 5))
    rows = [(s["server"], [p["output_tok_s"] for p in s.get("passes", [])]) for s in doc["servers"]]
    rows += [(f"{e} offline", v) for e, v in doc.get("offline_output_tok_s", {}).items()]
    rows = [(name, values) for name, values in rows if values]
    for i, (name, values) in enumerate(rows):
        color = ENGINE_COLORS["vllm" if name.startswith("vllm") else "dsinfer"]
        ax.bar(i, statistics.median(values), 0.6, color=color, alpha=0.55 if "offline" in name else 0.9)
        _dots(ax, i, values)
    ax.set_xticks(range(len(rows)), [name for name, _ in rows])
    ax.set_ylabel("output tokens/s (bar: median; dot: a pass)")
    workload = str(doc.get("workload", "")).split(",")[0]
    save(fig, path, f"Serving throughput, {workload}", machine_note(doc))


def _run_name(name: str, prefix: str) -> str:
    return Path(name).stem.removeprefix(prefix).lstrip("_") or "record"


def plot_serving_runs(docs: list[tuple[str, Doc]], path: Path) -> None:
    """Median output tok/s of each server (and offline engine) in every serving run, in date order."""
    fig, (ax,) = figure(size=(11, 5))
    docs = sorted(docs, key=lambda nd: str(nd[1].get("date")))
    series: dict[str, list[float | None]] = defaultdict(lambda: [None] * len(docs))
    for i, (_, doc) in enumerate(docs):
        for s in doc["servers"]:
            series[s["server"]][i] = s.get("median_output_tok_s")
        for engine, values in doc.get("offline_output_tok_s", {}).items():
            series[f"{engine} offline"][i] = statistics.median(values) if values else None
    for name, values in series.items():
        ax.plot(
            range(len(docs)), values, marker="o", linestyle="--" if "offline" in name else "-", label=name
        )
    ax.set_xticks(range(len(docs)), [_run_name(n, "serving_throughput") for n, _ in docs], rotation=45)
    ax.set_xlabel("run (serving_throughput_<run>.json, in date order)")
    ax.set_ylabel("output tokens/s, median of the passes")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    save(fig, path, "Serving throughput over HTTP, run after run", machine_note(docs[-1][1]))


def _offline_rows(doc: Doc) -> list[Doc]:
    return [r for r in doc["results"] if r.get("status") == "ok" and r.get("timed")]


def _offline_label(r: Doc) -> str:
    dtype = {"bfloat16": "bf16", "float32": "f32"}.get(r["dtype"], r["dtype"])
    return f"{r['engine']} {dtype} {r.get('variant') or ''}".strip()


def plot_offline_batch(doc: Doc, path: Path) -> None:
    """Offline throughput of every engine configuration, and its TTFT and TPOT percentiles."""
    rows = _offline_rows(doc)
    labels = [_offline_label(r) for r in rows]
    fig, axes = figure(3, 3, size=(15, 5))
    axes[0].bar(
        range(len(rows)),
        [r["timed"]["output_tok_s"] for r in rows],
        color=[ENGINE_COLORS.get(r["engine"], "grey") for r in rows],
    )
    axes[0].set_xticks(range(len(rows)), labels)
    axes[0].set_ylabel("output tokens/s")
    for ax, key, title in ((axes[1], "ttft_s", "TTFT"), (axes[2], "tpot_s", "TPOT")):
        series = {
            q: [1000 * (r["timed"].get(key) or {}).get(q, float("nan")) for r in rows]
            for q in PERCENTILE_KEYS
        }
        _bars(ax, labels, series)
        ax.set_ylabel(f"{title}, ms")
        ax.legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
    w = doc["workload"]
    title = f"Offline: batch {w['num_prompts']}, {w['input_len']} tokens in, {w['output_len']} out"
    save(fig, path, title, machine_note(doc))


def plot_offline_by_batch(docs: list[tuple[str, Doc]], path: Path) -> None:
    """Output tok/s against the batch (requests at once) for every engine and dtype, over the
    offline runs that compared all engines (a dot a run, the line through the medians)."""
    points: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for _, doc in docs:
        if any(r["engine"] == "dsinfer" for r in doc["results"]):
            for b in doc["best"]:
                points[f"{b['engine']} {b['dtype']}"][doc["workload"]["num_prompts"]].append(
                    b["output_tok_s"]
                )
    fig, (ax,) = figure(size=(9, 5.5))
    for name, by_batch in sorted(points.items()):
        color = ENGINE_COLORS.get(name.split()[0], "grey")
        style = "-" if name.endswith("bfloat16") else "--"
        batches = sorted(by_batch)
        ax.plot(batches, [statistics.median(by_batch[b]) for b in batches], style, color=color, label=name)
        for b in batches:
            _dots(ax, b, by_batch[b], color)
    _log2_x(ax, [b for by_batch in points.values() for b in by_batch], "batch: requests at once")
    ax.set_ylabel("output tokens/s")
    ax.legend(fontsize=8)
    save(fig, path, "Offline throughput against batch: dsinfer, vLLM, transformers", machine_note(docs[0][1]))


def plot_packed_linear(doc: Doc, path: Path) -> None:
    """tok/s of each pass with packed and with plain weights, alternating in one process."""
    fig, (ax,) = figure(size=(9, 4.5))
    for name, values in doc["output_tok_s"].items():
        ax.plot(
            range(1, len(values) + 1),
            values,
            marker="o",
            label=f"{name} (median {doc['median_tok_s'][name]:,.0f})",
        )
    ax.set_xlabel("pass (packed and plain alternate)")
    ax.set_ylabel("output tokens/s")
    ax.legend(fontsize=8)
    ratio = doc.get("paired_median_ratio_packed_over_plain")
    dtype = "float32" if doc.get("dtype") == "float32" else "bf16"
    save(
        fig, path, f"{dtype} linears packed once vs plain: paired median ratio {ratio:.3f}", machine_note(doc)
    )


def plot_gemm_f32_paths(doc: Doc, path: Path) -> None:
    """oneDNN's packed float32 GEMM over MKL's time against the rows, a line per weight shape."""
    fig, (ax,) = figure(size=(9, 4.5))
    shapes: dict[str, list[tuple[int, float]]] = {}
    for r in doc["rows"]:
        if "onednn_over_mkl" in r:
            shapes.setdefault(f"{r['n']} x {r['k']}", []).append((r["rows"], r["onednn_over_mkl"]))
    for name, points in shapes.items():
        ax.plot(*zip(*sorted(points), strict=True), marker="o", label=name)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows")
    ax.set_ylabel("oneDNN packed / MKL time")
    ax.legend(fontsize=7, title="weight (out x in)", title_fontsize=7)
    save(fig, path, "float32 linear: oneDNN's packed weight against MKL", machine_note(doc))


def plot_kernel_backends(doc: Doc, path: Path) -> None:
    """tok/s per batch of the auto and baseline kernel backends (median bars, a dot a pass), with
    the median of the paired ratios over each group."""
    rows = doc["rows"]
    fig, (ax,) = figure(size=(9, 4.5))
    names = ("auto", "baseline")
    _bars(
        ax,
        [f"batch {r['batch']}" for r in rows],
        {n: [r["median_tok_s"][n] for r in rows] for n in names},
        {n: [r["tok_s"][n] for r in rows] for n in names},
    )
    for i, r in enumerate(rows):
        top = max(max(r["tok_s"][n]) for n in names)
        ax.annotate(f"{r['median_ratio']:.2f}x", (i, top), ha="center", va="bottom", fontsize=9)
    _log_y(ax, "output tokens/s")
    ax.legend(fontsize=8)
    differ = [k for k, v in doc["backends"]["auto"].items() if doc["backends"]["baseline"][k] != v]
    what = ", ".join(f"{k} {doc['backends']['auto'][k]} vs {doc['backends']['baseline'][k]}" for k in differ)
    save(fig, path, f"Kernel backends, {doc['dtype']}: {what} (paired passes)", machine_note(doc))


def plot_offline_paired(doc: Doc, path: Path) -> None:
    """dsinfer and vLLM tok/s per pair of passes, a line per engine and dtype (the machine's drift
    shows as both lines moving together), with the median of the pairs' ratios per dtype."""
    fig, (ax,) = figure(size=(9, 4.5))
    for row in doc["rows"]:
        for engine, style in (("dsinfer", "-o"), ("vllm", "--s")):
            values = row["tok_s"][engine]
            ax.plot(range(1, len(values) + 1), values, style, label=f"{engine} {row['dtype']}")
    ax.set_xlabel("pair of passes")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ratios = ", ".join(f"{r['dtype']} {r['median_ratio']:.2f}x" for r in doc["rows"])
    save(fig, path, f"dsinfer / vLLM offline, paired passes: {ratios}", machine_note(doc))


def plot_mla_cpu_rows(doc: Doc, path: Path) -> None:
    """The absorbed MLA kernel's call time per shape, a sequence's rows in one task or split."""
    rows = doc["rows"]
    fig, (ax,) = figure(size=(10, 4.5))
    _bars(
        ax,
        [r["shape"] for r in rows],
        {
            "one task per sequence": [r["one_task_us"] for r in rows],
            "rows split over the threads": [r["split_us"] for r in rows],
        },
        {
            "one task per sequence": [r["rounds"]["one"] for r in rows],
            "rows split over the threads": [r["rounds"]["split"] for r in rows],
        },
    )
    _log_y(ax, "median call, us")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8)
    save(fig, path, "CPU absorbed MLA decode: rows in one task vs split", machine_note(doc))


# Latency distributions ---------------------------------------------------------------------------
def _cdf(ax: Axes, values: Sequence[float], label: str) -> None:
    xs = sorted(values)
    ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def plot_pd_serving(doc: Doc, path: Path) -> None:
    """TTFT and TPOT of every request, as distributions, per server and seed, for each workload."""
    runs = doc["runs"]
    fig, axes = figure(2 * len(runs), 2, size=(13, 4.5 * len(runs)))
    for row, (workload, run) in enumerate(runs.items()):
        for ax, key, what in zip(
            axes[2 * row : 2 * row + 2], ("ttft", "tpot"), ("TTFT", "TPOT"), strict=True
        ):
            for phase in run["phases"]:
                values = [1000 * r[key] for r in phase["requests"] if r.get(key) is not None]
                if values:
                    _cdf(ax, values, f"{phase['name']} seed {phase['seed']}")
            ax.set_xscale("log")
            ax.set_xlabel(f"{what}, ms (log scale)")
            ax.set_ylabel("share of requests")
            ax.set_title(f"{workload} workload: {what}", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    save(fig, path, "PD serving: latency distributions per request", machine_note(next(iter(runs.values()))))


def plot_decode_step(doc: Doc, path: Path) -> None:
    """Decode step period (median and p90) and output tok/s of each commit and setting (median of
    the repeats, a dot a repeat)."""
    fig, axes = figure(2, 2, size=(12, 4.5))
    names = list(doc["summary"])

    def repeats(field: str) -> list[list[float]]:
        return [[r[field] for r in doc["runs"] if f"{r['label']} {r['setting']}" == n] for n in names]

    for ax, fields, unit in (
        (axes[0], ("step_ms_median", "step_ms_p90"), "decode step, ms"),
        (axes[1], ("output_tok_s",), "output tokens/s"),
    ):
        series = {f.removeprefix("step_ms_"): [doc["summary"][n][f] for n in names] for f in fields}
        _bars(ax, names, series, {fields[0].removeprefix("step_ms_"): repeats(fields[0])})
        ax.set_ylabel(unit)
        ax.legend(fontsize=8)
    args = doc.get("args", {})
    title = f"Served 2-rank decode pool: {args.get('concurrency')} requests x {args.get('output_len')} tokens"
    save(fig, path, title, machine_note(doc))


# Model and cache ---------------------------------------------------------------------------------
def plot_v4_kv(doc: Doc, path: Path) -> None:
    """KV cache one request holds against its context, per model."""
    contexts = doc["results"]["contexts"]
    fig, (ax,) = figure(size=(9, 5))
    for model in [k for k in contexts[0] if k != "context"]:
        ax.plot(
            [c["context"] for c in contexts],
            [c[model]["total"] / 2**30 for c in contexts],
            marker="o",
            label=model,
        )
    _log2_x(ax, [c["context"] for c in contexts], "context, tokens")
    _log_y(ax, "KV cache per request, GiB")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    save(fig, path, "KV cache per request: DeepSeek-V4 against V3 (bf16 values)", machine_note(doc))


def plot_context_decode(doc: Doc, path: Path) -> None:
    """Decode step time against context, per batch: V3's dense MLA against V3.2's sparse attention
    (v32_decode) or V4's compressed sparse attention (v4_decode: ``doc["series"]``)."""
    series = doc.get("series", [["v3_ms", "V3 dense"], ["v32_ms", "V3.2 sparse"]])
    batches = sorted({s["batch"] for s in doc["steps"]})
    fig, axes = figure(len(batches), len(batches), size=(6 * len(batches), 4.5))
    for ax, batch in zip(axes, batches, strict=True):
        steps = [s for s in doc["steps"] if s["batch"] == batch]
        for key, label in series:
            ax.plot([s["context"] for s in steps], [s[key] for s in steps], marker="o", label=label)
        _log2_x(ax, [s["context"] for s in steps], "context, tokens")
        ax.set_ylabel("decode step, ms (median)")
        ax.set_title(f"batch {batch}", fontsize=10)
        ax.legend()
    title = doc.get("title", "Decode step: DeepSeek-V3.2 sparse attention against V3 (2 layers, CPU)")
    save(fig, path, title, machine_note(doc))


# Simulator ---------------------------------------------------------------------------------------
def plot_sim_plan(doc: Doc, path: Path) -> None:
    """The simulator's day plan: prefill and decode nodes per block of hours, the peak request
    rate each block is sized for, the daily mean."""
    plan = doc["plan"]
    blocks = plan["blocks"]
    starts = [b["hours"][0] for b in blocks]
    widths = [b["hours"][1] - b["hours"][0] for b in blocks]
    prefill = [b["prefill_pools"] * plan["prefill_pool"]["nodes"] for b in blocks]
    decode = [b["decode_pools"] * plan["decode_pool"]["nodes"] for b in blocks]
    fig, (ax,) = figure(size=(10, 5))
    ax.bar(starts, prefill, widths, align="edge", label="prefill nodes", edgecolor="white")
    ax.bar(starts, decode, widths, bottom=prefill, align="edge", label="decode nodes", edgecolor="white")
    ax.axhline(plan["mean_nodes"]["total"], color="black", linestyle=":", label="daily mean nodes")
    rate = ax.twinx()
    peaks = [b["peak_requests_per_s"] for b in blocks]
    rate.step(
        [*starts, blocks[-1]["hours"][1]],
        [*peaks, peaks[-1]],
        where="post",
        color="tab:red",
        label="peak requests/s",
    )
    rate.set_ylabel("peak requests/s of the block", color="tab:red")
    rate.set_ylim(bottom=0)
    ax.set_xticks(range(0, 25, 4))
    ax.set_xlabel("hour of the day")
    pool = plan["prefill_pool"]
    ax.set_ylabel(f"nodes ({pool['ranks'] // pool['nodes']} GPUs each)")
    handles = [h for a in (ax, rate) for h in a.get_legend_handles_labels()[0]]
    ax.legend(handles=handles, loc="upper left", fontsize=8)
    title = f"Day plan for {plan['traffic']}: mean {plan['mean_nodes']['total']:.1f} nodes, peak {plan['peak_nodes']}"
    save(fig, path, title, machine_note(doc))


# Expert placement -------------------------------------------------------------------------------
def plot_eplb_balance(doc: Doc, path: Path) -> None:
    """Max / mean per-rank expert load of every scenario before (no redundancy) and after each
    placement policy."""
    rows = doc["rows"]
    policies = list(rows[0]["results"])
    after = iter(POLICY_COLORS)
    fig, (ax,) = figure(size=(11, 0.45 * len(rows) + 2))
    for i, policy in enumerate(policies):
        xs = [(r["results"].get(policy) or {}).get("mean") for r in rows]
        before = policy == "none"
        ax.scatter(
            [float("nan") if x is None else x for x in xs],
            [j + (i - len(policies) / 2) * 0.08 for j in range(len(rows))],
            marker="X" if before else "o",
            s=60 if before else 22,
            color="tab:red" if before else next(after, "black"),
            label=f"{policy} (before)" if before else policy,
            zorder=3,
        )
    labels = [
        f"{r['model']} EP{r['ranks']}+{r['redundant']} ({r['nodes']} nodes), s={r['zipf_s']}" for r in rows
    ]
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xticks(RATIO_TICKS, [f"{t:g}" for t in RATIO_TICKS])
    ax.axvline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("max / mean per-rank load, mean over layers (log scale; 1 = even)")
    ax.grid(alpha=0.3, axis="x", which="both")
    ax.legend(fontsize=8, loc="lower right")
    save(fig, path, "EPLB balance: expert load before and after placement", machine_note(doc))


def plot_expert_load(doc: Doc, path: Path) -> None:
    """Tokens each expert received per MoE layer, relative to the layer's mean, per role."""
    roles = doc["roles"]
    fig, axes = figure(len(roles), len(roles), size=(6 * len(roles), 4.5))
    for ax, (role, layers) in zip(axes, sorted(roles.items()), strict=True):
        experts = len(next(iter(layers.values())))
        shares = {
            f"layer {n}": [c * len(counts) / (sum(counts) or 1) for c in counts]
            for n, counts in layers.items()
        }
        _bars(ax, [str(e) for e in range(experts)], shares)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xlabel("expert")
        ax.set_ylabel("tokens routed / layer mean")
        ax.set_title(role, fontsize=10)
        ax.legend(fontsize=8)
    save(fig, path, "Measured expert load of the trained tiny-chat router", machine_note(doc))


def _stall_panel(ax: Axes, result: Doc) -> None:
    base, run = result["baseline"], result["rebalance"]
    for data, label, color in ((base, "no rebalance", "grey"), (run, "rebalance", "tab:blue")):
        median = data["median_ms"]
        ax.plot(
            range(1, len(data["step_ms"])),
            [s / median for s in data["step_ms"][1:]],
            color=color,
            linewidth=0.8,
            label=label,
        )
    for e in run["events"]:
        end = e.get("swap_step") or len(run["step_ms"])
        ax.axvspan(e["decision_step"], end, color="tab:orange", alpha=0.2)
        if e.get("freed_step"):
            ax.axvline(e["freed_step"], color="tab:green", linewidth=0.8)
    ax.axhline(2.0, color="tab:red", linestyle="--", linewidth=0.8)
    ax.set_ylim(0, 3.5)
    worst = run.get("max_moving_ratio")
    worst_text = f"{worst:.2f}x" if worst else "-"
    ax.set_title(
        f"EP{result['world']} {result['config']} #{result['repeat']}: worst while moving {worst_text}",
        fontsize=9,
    )
    ax.set_xlabel("step (orange: staging, green: freed)")
    ax.set_ylabel("step time / median")


def plot_eplb_stall(doc: Doc, path: Path) -> None:
    """Pool step time over the steps with and without an online rebalance, against the target
    (twice the median)."""
    results = doc["results"]
    fig, axes = figure(len(results), 2, size=(12, 2.7 * -(-len(results) // 2)))
    for ax, result in zip(axes, results, strict=True):
        _stall_panel(ax, result)
    axes[0].legend(fontsize=7, loc="upper right")
    save(
        fig,
        path,
        "EPLB stall: step times while expert weights move (red: target 2x median)",
        machine_note(doc),
    )


# Transfer, overlap, recovery, intake -------------------------------------------------------------
def plot_kv_transfer(doc: Doc, path: Path) -> None:
    """Best and median GB/s against the size moved, per pattern and backend, with memcpy."""
    modes = list(dict.fromkeys(r["mode"] for r in doc["results"]))
    fig, axes = figure(len(modes), len(modes), size=(5 * len(modes), 4.5))
    for ax, mode in zip(axes, modes, strict=True):
        for backend in dict.fromkeys(r["backend"] for r in doc["results"]):
            rows = [r for r in doc["results"] if r["mode"] == mode and r["backend"] == backend]
            line = ax.plot(
                [r["target_mib"] for r in rows],
                [r["best_gbps"] for r in rows],
                marker="o",
                label=f"{backend} best",
            )
            ax.plot(
                [r["target_mib"] for r in rows],
                [r["median_gbps"] for r in rows],
                "--",
                color=line[0].get_color(),
                label=f"{backend} median",
            )
        for method, style in zip(
            dict.fromkeys(m["method"] for m in doc["memcpy"]), (":", "-."), strict=False
        ):
            rows = [m for m in doc["memcpy"] if m["method"] == method]
            ax.plot(
                [m["bytes"] / 2**20 for m in rows],
                [m["best_gbps"] for m in rows],
                style,
                color="grey",
                label=f"{method} best",
            )
        _log2_x(ax, [r["target_mib"] for r in doc["results"]], "size moved, MiB (about)")
        _log_y(ax, "GB/s")
        ax.set_title(mode, fontsize=10)
    axes[0].legend(fontsize=7)
    save(
        fig,
        path,
        "KV transfer bandwidth: write_pages over NIXL and Mooncake against memcpy",
        machine_note(doc),
    )


def plot_overlap(doc: Doc, path: Path) -> None:
    """EP pool step time with two-micro-batch overlap off and on, per pool size (median bar,
    a dot a repeat)."""
    runs = doc["runs"]
    worlds = sorted({r["world"] for r in runs})
    settings = list(dict.fromkeys(r["setting"] for r in runs))
    fig, axes = figure(2, 2, size=(12, 4.5))
    for ax, phase in zip(axes, ("prefill", "decode"), strict=True):
        series = {s: [doc["summary"][f"{w} {s}"][f"{phase}_median_ms"] for w in worlds] for s in settings}
        points = {
            s: [
                [r["result"][phase]["median_ms"] for r in runs if (r["world"], r["setting"]) == (w, s)]
                for w in worlds
            ]
            for s in settings
        }
        _bars(ax, [f"{w} ranks" for w in worlds], series, points)
        ax.set_ylabel(f"{phase} step, ms")
        ax.set_title(f"{phase} (bars: overlap off / on)", fontsize=10)
        ax.legend(fontsize=8)
    save(fig, path, "Two-micro-batch overlap: EP pool step time", machine_note(doc))


def plot_rank_recovery(doc: Doc, path: Path) -> None:
    """After a rank's kill -9: seconds to the next token and to the pool whole again, per mode
    and pool size (median bar, a dot a repeat)."""
    runs = doc["runs"]
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    sizes = sorted({r["ep"] for r in runs})
    fig, axes = figure(2, 2, size=(12, 4.5))
    for ax, key, what in (
        (axes[0], "kill_to_token_median_s", "kill to the next token, s"),
        (axes[1], "kill_to_whole_s", "kill to the pool whole again, s"),
    ):
        series = {m: [doc["summary"][f"{m} EP{n}"][key] for n in sizes] for m in modes}
        points = {
            m: [[r[key] for r in runs if (r["mode"], r["ep"]) == (m, n) and r[key]] for n in sizes]
            for m in modes
        }
        _bars(ax, [f"EP{n}" for n in sizes], series, points)
        ax.set_ylabel(what)
        ax.legend(fontsize=8)
    _log_y(axes[0], "kill to the next token, s")
    save(fig, path, "Rank recovery after kill -9 of one rank", machine_note(doc))


def plot_tracing_cost(doc: Doc, path: Path) -> None:
    """Tracing off against on: requests/s and TTFT p50 (median bar, a dot a repeat)."""
    runs, modes = doc["runs"], list(doc["summary"])
    fig, axes = figure(2, 2, size=(10, 4))
    for ax, key, what, scale in (
        (axes[0], "requests_per_s", "completed requests/s", 1.0),
        (axes[1], "ttft_p50", "TTFT p50, ms", 1e3),
    ):
        medians = [doc["summary"][m][key] for m in modes]
        series = {"median": [None if v is None else v * scale for v in medians]}
        points = {"median": [[r[key] * scale for r in runs if r["mode"] == m and r[key]] for m in modes]}
        _bars(ax, [f"tracing {m}" for m in modes], series, points)
        ax.set_ylabel(what)
    save(fig, path, "The cost of tracing (every request traced, OTLP/HTTP)", machine_note(doc))


def plot_overload(doc: Doc, path: Path) -> None:
    """Overload drills: each run's requests by outcome (stacked), the big prompts' refusal and
    /health times, the gateway's resident memory through the drills."""
    r = doc["results"]
    runs = [(f"burst {b['concurrency']}", b) for b in r["bursts"]]
    runs += [(f"{s['factor']}x load", s) for s in r["sustained"]]
    fig, axes = figure(3, 3, size=(15, 4.5))
    bottom = [0.0] * len(runs)
    for outcome, color in (("completed", "tab:green"), ("refused", "tab:orange"), ("failed", "tab:red")):
        values = [float(run[outcome]) for _, run in runs]
        axes[0].bar(range(len(runs)), values, bottom=bottom, color=color, label=outcome)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axes[0].set_xticks(range(len(runs)), [name for name, _ in runs], rotation=45, ha="right", fontsize=8)
    axes[0].set_ylabel("requests")
    axes[0].legend(fontsize=8)
    big = r["big_prompts"]
    labels = [f"#{b['repeat']} {'at once' if b['at_once'] else 'one by one'}" for b in big]
    _bars(
        axes[1],
        labels,
        {"refusal max": [b["refusal_max_ms"] for b in big], "/health max": [b["health_max_ms"] for b in big]},
    )
    axes[1].axhline(100, color="gray", linestyle="--", linewidth=1)
    axes[1].set_ylabel("ms (7.9 MB prompts)")
    axes[1].tick_params(axis="x", labelsize=7, rotation=30)
    axes[1].legend(fontsize=8)
    memory = r["memory_mib"]
    axes[2].plot(list(memory), list(memory.values()), marker="o")
    axes[2].set_ylabel("gateway RSS, MiB")
    axes[2].tick_params(axis="x", labelsize=7, rotation=30)
    axes[2].set_ylim(bottom=0)
    save(fig, path, "Overload drills on the all-in-one server", machine_note(doc))


def plot_kv_replay(doc: Doc, path: Path) -> None:
    """A trace replayed per KV tier setting: the input share each tier served (stacked) against
    what the trace allows, and TTFT."""
    runs = doc["runs"]
    names = [r["setting"] for r in runs]
    fig, axes = figure(2, 2, size=(11, 4.5))
    bottom = [0.0] * len(runs)
    for tier, color in (("memory", "tab:blue"), ("host", "tab:green"), ("disk", "tab:orange")):
        values = [100 * r["share"].get(tier, 0.0) for r in runs]
        axes[0].bar(range(len(runs)), values, bottom=bottom, color=color, label=f"from {tier}")
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axes[0].axhline(100 * doc["ideal_share"], color="gray", linestyle="--", label="the trace allows")
    axes[0].set_xticks(range(len(runs)), names)
    axes[0].set_ylabel("input tokens served from cache, %")
    axes[0].legend(fontsize=8)
    _bars(
        axes[1],
        names,
        {
            "TTFT p50": [r["ttft_p50_s"] * 1e3 for r in runs],
            "TTFT p90": [r["ttft_p90_s"] * 1e3 for r in runs],
        },
    )
    axes[1].set_ylabel("ms")
    axes[1].legend(fontsize=8)
    save(fig, path, "Mooncake conversation trace replayed against the KV tiers", machine_note(doc))


def plot_intake(doc: Doc, path: Path) -> None:
    """While oversized prompts arrive: the longest /health and short-request latency, and the
    gateway's peak memory growth, per prompt size and commit."""
    labels = list(dict.fromkeys(r["label"] for r in doc["runs"]))
    sizes = sorted({r["prompt_mb"] for r in doc["runs"]})
    fig, axes = figure(3, 3, size=(15, 4.5))
    for ax, get, what in (
        (axes[0], lambda r: r["oversized"]["health_s"]["max"], "/health, longest, s"),
        (axes[1], lambda r: r["oversized"]["short_s"]["max"], "short request, longest, s"),
        (axes[2], lambda r: r["oversized"]["peak_rss_growth_mib"], "gateway peak RSS growth, MiB"),
    ):
        values = {
            lb: [
                statistics.median(get(r) for r in doc["runs"] if r["label"] == lb and r["prompt_mb"] == mb)
                for mb in sizes
            ]
            for lb in labels
        }
        _bars(ax, [f"{doc.get('concurrent', '')} x {mb:g} MB" for mb in sizes], values)
        _log_y(ax, what)
        ax.legend(fontsize=8)
    save(fig, path, "Gateway intake while multi-MB prompts arrive", machine_note(doc))


# Accuracy ----------------------------------------------------------------------------------------
def plot_accuracy(doc: Doc, path: Path) -> None:
    """Exact match per task of every mode, and each mode's output tok/s over the whole set."""
    runs = doc["runs"]
    tasks = list(next(iter(runs.values()))["accuracy"])
    fig, axes = figure(2, 2, size=(14, 4.5))
    _bars(axes[0], tasks, {mode: [100 * run["accuracy"][t] for t in tasks] for mode, run in runs.items()})
    axes[0].set_ylabel("exact match, %")
    lowest = min(100 * a for r in runs.values() for a in r["accuracy"].values())
    axes[0].set_ylim(max(0.0, lowest - 10), 100.5)
    axes[0].legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    axes[1].bar(range(len(runs)), [run["output_tokens_per_s"] for run in runs.values()])
    axes[1].set_xticks(range(len(runs)), list(runs), rotation=20, fontsize=8)
    axes[1].set_ylabel("output tokens/s, whole set")
    save(fig, path, "Accuracy of the built-in model per task, and throughput", machine_note(doc))


# GPU kernels -------------------------------------------------------------------------------------
def plot_kernels(doc: Doc, path: Path) -> None:
    """Each kernel case's fraction of the GPU's roofline (memory or compute, whichever binds), per
    family; the gate's tokens/s against tokens."""
    families = [f for f in ("mla", "dense_gemm", "grouped_gemm") if doc.get(f)]
    gate = doc.get("gate") or []
    fig, axes = figure(len(families) + bool(gate), 2, size=(14, 4.2 * -(-(len(families) + bool(gate)) // 2)))
    for ax, family in zip(axes[: len(families)], families, strict=True):
        cases = doc[family]
        ax.barh(
            range(len(cases)),
            [c.get("roofline_fraction") or 0 for c in cases],
            color=["tab:blue" if c.get("bound") == "memory" else "tab:purple" for c in cases],
        )
        ax.set_yticks(range(len(cases)), [c["case"] for c in cases], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, 1)
        ax.set_xlabel("fraction of the roofline (blue: memory-bound, purple: compute-bound)")
        ax.set_title(family, fontsize=10)
    if gate:
        ax = axes[len(families)]
        ax.plot([c["tokens"] for c in gate], [c["tokens_per_s"] for c in gate], marker="o")
        _log2_x(ax, [c["tokens"] for c in gate], "tokens")
        _log_y(ax, "tokens/s")
        ax.set_title("gate", fontsize=10)
    save(fig, path, "Kernels against the GPU's roofline", machine_note(doc))


def plot_mla_sweep(doc: Doc, path: Path) -> None:
    """MLA decode kernel: latent-cache bandwidth of every launch configuration swept, against
    the copy bandwidth."""
    # a launch that failed (out of shared memory, registers) has an error and no rate
    cases = [c for c in doc["mla"] if any("cache_tb_per_s" in s for s in c.get("sweep") or ())]
    fig, axes = figure(len(cases), 1, size=(11, 4.5 * len(cases)))
    copy = doc.get("ceilings", {}).get("copy_tb_per_s")
    for ax, case in zip(axes, cases, strict=True):
        measured = [s for s in case["sweep"] if "cache_tb_per_s" in s]
        sweep = sorted(measured, key=lambda s: -s["cache_tb_per_s"])
        labels = [
            f"m{s['block_m']} n{s['block_n']} w{s['num_warps']} s{s['num_stages']} split{s['num_splits']}"
            for s in sweep
        ]
        ax.bar(range(len(sweep)), [s["cache_tb_per_s"] for s in sweep])
        ax.set_xticks(range(len(sweep)), labels, rotation=60, fontsize=7)
        if copy:
            ax.axhline(copy, color="tab:red", linestyle="--", label=f"copy {copy:.2f} TB/s")
            ax.legend(fontsize=8)
        ax.set_ylabel("latent cache read, TB/s")
        ax.set_title(case["case"], fontsize=10)
    save(fig, path, "MLA decode kernel: launch configurations swept", machine_note(doc))


def plot_gemm_sweep(doc: Doc, path: Path) -> None:
    """FP8 GEMM tile sweep: fraction of the FP8 peak of every tile configuration, a line per case."""
    families = [f for f in ("dense", "masked", "contiguous") if doc.get(f)]
    fig, axes = figure(len(families), 1, size=(10, 3.3 * len(families)))
    for ax, family in zip(axes, families, strict=True):
        configs = list(dict.fromkeys(row["config"] for case in doc[family] for row in case["rows"]))
        for case in doc[family]:
            by_config = {row["config"]: row.get("of_fp8", float("nan")) for row in case["rows"]}
            ax.plot(
                range(len(configs)),
                [by_config.get(c, float("nan")) for c in configs],
                marker="o",
                label=case["case"],
            )
        ax.set_xticks(range(len(configs)), configs, rotation=30, fontsize=7)
        ax.set_ylabel("fraction of FP8 peak")
        ax.set_title(family, fontsize=10)
        ax.legend(fontsize=6, ncol=2)
    save(
        fig,
        path,
        f"FP8 GEMM tile sweep (FP8 peak {doc.get('fp8_tflops', 0):,.0f} TFLOP/s)",
        machine_note(doc),
    )


def plot_decode_graph(doc: Doc, path: Path) -> None:
    """V3 decode step (cut to a few layers) against batch size: eager, static buffers, CUDA graphs."""
    results = doc["results"]
    fig, (ax,) = figure(size=(9, 5))
    for mode in ("eager", "static", "graph"):
        rows = [r for r in results if r.get(mode)]
        ax.plot([r["batch_size"] for r in rows], [r[mode]["median_ms"] for r in rows], marker="o", label=mode)
    _log2_x(ax, [r["batch_size"] for r in results], "batch size")
    _log_y(ax, "decode step, ms (median)")
    ax.legend()
    model = doc.get("model", {})
    title = f"Decode step: {model.get('layers')} layers of DeepSeek-V3, context {results[0]['context']}"
    save(fig, path, title, machine_note(doc))


# Soak ---------------------------------------------------------------------------------------------
def plot_memory(memory: dict[str, list[tuple[float, float]]], faults_at: Iterable[float], path: Path) -> Path:
    """The soak drill's resident memory of every process over time (``(seconds, MiB)`` samples),
    faults marked."""
    fig, (ax,) = figure(size=(11, 6))
    for label, samples in sorted(memory.items()):
        ax.plot([t / 60 for t, _ in samples], [m for _, m in samples], label=label, linewidth=1)
    for at in faults_at:
        ax.axvline(at / 60, color="grey", alpha=0.3, linewidth=0.8)
    ax.set_xlabel("minutes (grey: a fault)")
    ax.set_ylabel("resident memory, MiB")
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    return save(fig, path, "Soak: resident memory of every process")


def plot_mtp_speed(doc: Doc, path: Path) -> None:
    """MTP against plain decoding: decode and end-to-end tok/s per batch (median bars), and the
    MTP step's time split into the verify forward, the draft and the rest."""
    rows = doc["rows"]
    labels = [f"batch {r['batch']}" for r in rows]
    fig, axes = figure(3, 3, size=(15, 4.5))
    for ax, key, what in (
        (axes[0], "decode_tok_s", "decode tok/s"),
        (axes[1], "e2e_tok_s", "end-to-end tok/s"),
    ):
        _bars(ax, labels, {mode: [r[mode][key] for r in rows] for mode in ("plain", "mtp")})
        for i, r in enumerate(rows):
            speedup = r["decode_speedup" if key == "decode_tok_s" else "e2e_speedup"]
            ax.annotate(f"{speedup:.2f}x", (i, r["mtp"][key]), ha="center", va="bottom", fontsize=8)
        ax.set_ylabel(what)
        ax.legend(fontsize=8)
    bottom = [0.0] * len(rows)
    parts = (("verify forward", "forward_ms"), ("draft", "draft_ms"))
    for name, key in parts:
        values = [r["mtp"][key] / r["mtp"]["step_ms"] for r in rows]
        axes[2].bar(range(len(rows)), values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axes[2].set_xticks(range(len(rows)), labels)
    axes[2].set_ylabel("share of the MTP step (medians)")
    axes[2].legend(fontsize=8)
    title = f"MTP against plain decoding: {doc['model']}, {doc['dtype']}, {doc['task']}"
    save(fig, path, title, machine_note(doc))


def plot_mtp_serving(doc: Doc, path: Path) -> None:
    """MTP through dsinfer serve: output tok/s per concurrency (median bars, a dot a pass)."""
    rows, passes = doc["rows"], doc["passes"]
    labels = [f"{r['concurrency']} stream{'s' if r['concurrency'] > 1 else ''}" for r in rows]
    series = {mode: [r[mode] for r in rows] for mode in ("plain", "mtp")}
    points = {
        mode: [[p["tok_s"] for p in passes if p["mode"] == mode and p["concurrency"] == r["concurrency"]]
               for r in rows]
        for mode in ("plain", "mtp")
    }  # fmt: skip
    fig, axes = figure(1, 1, size=(7, 4.5))
    _bars(axes[0], labels, series, points)
    axes[0].set_ylabel("output tok/s")
    axes[0].legend(fontsize=8)
    save(fig, path, "MTP through dsinfer serve (all-in-one PD)", machine_note(doc))


def plot_lone_and_burst(doc: Doc, path: Path) -> None:
    """A lone request's latency and a burst's output tok/s per topology, a bar per commit (medians
    of the repeats, a dot a repeat)."""
    rows, runs = doc["rows"], doc["runs"]
    topologies = list(dict.fromkeys(r["topology"] for r in rows))
    commits = list(dict.fromkeys(f"{r['commit']} ({r['sha']})" for r in rows))
    fig, axes = figure(2, 2, size=(12, 4.5))
    for ax, field, unit in (
        (axes[0], "lone_ms", "lone request, ms"),
        (axes[1], "burst_tok_s", "burst output tok/s"),
    ):
        series = {
            c: [next(r[field] for r in rows if r["topology"] == t and f"{r['commit']} ({r['sha']})" == c)
                for t in topologies]
            for c in commits
        }  # fmt: skip
        points = {
            c: [
                [x[field] for x in runs if x["topology"] == t and c.startswith(f"{x['commit']} (")]
                for t in topologies
            ]
            for c in commits
        }
        _bars(ax, topologies, series, points)
        ax.set_ylabel(unit)
        ax.legend(fontsize=8)
    save(fig, path, "A lone request and a burst through dsinfer serve, two commits", machine_note(doc))


# Registry -----------------------------------------------------------------------------------------
PLOTTERS: dict[str, Plotter] = {
    "serving_throughput*.json": plot_serving_throughput,
    "offline_batch*.json": plot_offline_batch,
    "offline_paired*.json": plot_offline_paired,
    "packed_linear*.json": plot_packed_linear,
    "gemm_f32_paths*.json": plot_gemm_f32_paths,
    "kernel_backends*.json": plot_kernel_backends,
    "pd_serving.json": plot_pd_serving,
    "decode_step*.json": plot_decode_step,
    "v4_kv.json": plot_v4_kv,
    "v32_decode.json": plot_context_decode,
    "v4_decode.json": plot_context_decode,
    "sim_report.json": plot_sim_plan,
    "eplb_balance.json": plot_eplb_balance,
    "tiny_chat_expert_load.json": plot_expert_load,
    "eplb_stall*.json": plot_eplb_stall,
    "kv_transfer_bandwidth.json": plot_kv_transfer,
    "overlap.json": plot_overlap,
    "rank_recovery.json": plot_rank_recovery,
    "intake.json": plot_intake,
    "overload.json": plot_overload,
    "kv_replay*.json": plot_kv_replay,
    "tracing_cost.json": plot_tracing_cost,
    "mtp_speed*.json": plot_mtp_speed,
    "mla_cpu_rows*.json": plot_mla_cpu_rows,
    "mtp_serving*.json": plot_mtp_serving,
    "lone_and_burst*.json": plot_lone_and_burst,
    "accuracy.json": plot_accuracy,
    "*sweep_mla*.json": plot_mla_sweep,
    "*sweep_gemm*.json": plot_gemm_sweep,
    "*kernels*.json": plot_kernels,
    "*decode_graph*.json": plot_decode_graph,
}
# figure name -> (the results files of its folder it draws, the plotter)
AGGREGATES: dict[str, tuple[str, Aggregate]] = {
    "offline_throughput_by_batch.png": ("offline_batch*.json", plot_offline_by_batch),
    "serving_throughput_runs.png": ("serving_throughput*.json", plot_serving_runs),
}


def plotter_for(name: str) -> Plotter | None:
    """The plotter of a results file named ``name``, or None (no series to draw)."""
    return next((p for pattern, p in PLOTTERS.items() if fnmatch(name, pattern)), None)


def load(path: Path) -> Doc:
    return json.loads(path.read_text())


def _plot_one(json_path: Path) -> Path | None:
    plotter = plotter_for(json_path.name)
    if plotter is None:
        return None
    out = json_path.with_suffix(".png")
    plotter(load(json_path), out)
    return out


def plot_aggregate(folder: Path, name: str) -> Path | None:
    """The aggregate figure ``name`` over its results files in ``folder``; None if there are none."""
    pattern, plotter = AGGREGATES[name]
    files = sorted(folder.glob(pattern))
    if not files:
        return None
    plotter([(f.name, load(f)) for f in files], folder / name)
    return folder / name


def plot_result(json_path: Path | None) -> Path | None:
    """``<name>.png`` beside the results file ``json_path`` when its kind has a series (else, or
    for no file, None), and the aggregates of its folder it is part of redrawn."""
    if json_path is None:
        return None
    out = _plot_one(json_path)
    for name, (pattern, _) in AGGREGATES.items():
        if fnmatch(json_path.name, pattern):
            plot_aggregate(json_path.parent, name)
    return out


def render_all(root: Path) -> list[Path]:
    """Every plot of every results file under ``root`` and every aggregate of its folders."""
    files = sorted(root.rglob("*.json"))
    written = [p for p in map(_plot_one, files) if p is not None]
    for folder in sorted({f.parent for f in files}):
        written += [p for p in (plot_aggregate(folder, name) for name in AGGREGATES) if p is not None]
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render the plot of every benchmark results JSON.")
    parser.add_argument("root", type=Path, nargs="?", default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    for path in render_all(args.root):
        print(f"wrote {path} ({path.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
