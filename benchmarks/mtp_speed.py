"""MTP against plain decoding on the built-in model: decode speed, the draft's share of a step,
the verify's cost, and the outputs compared token for token.

Two offline engines in one process on the same checkpoint (``tiny-chat``, the trained built-in
model, by default), the second with ``speculative_mtp``. Each writes the Chrome step trace
(dsinfer/base/trace.py): a ``STEP`` span per step (with its prefill tokens and the tokens it
produced), ``FORWARD`` (the target model's forward: a plain step's one token, or the verify's
token plus draft) and ``MTP_DRAFT`` (the MTP layer's forward and the draft's sampling).

Workload: chat prompts of one of the model's trained tasks (``--task``): ``mul``, two-digit
products worked out as long multiplication (replies of about 40 tokens, drafted with about 100%
acceptance), or ``lines``, a table of 6-8 lines then "Repeat the lines." (40-120 tokens, 80-92%
acceptance). ``--model wide``: a random model whose batch-1 step is bound by reading its weights
(about 1 GB in float32, built here with transformers), made a bigram model whose MTP layer agrees
with it (full acceptance at any size), over random prompts of 32-64 tokens, 64 tokens each.
``--model deep``: the same kind of random bigram model with DeepSeek-V3's proportion of decoder
layers to MTP layers (61 to 1, the first 3 dense) at a small width, where the built-in model and
``wide`` have 4 to 1.
For each batch B,
``--repeats`` paired passes (the engines alternate which runs first); each pass generates the
first B prompts to EOS (at most 256 tokens), greedy. Prefix caching is off, so every pass
prefills its prompts. Per engine and batch, medians over the passes:

- decode tok/s: tokens produced by decode-only steps over those steps' time (what MTP speeds up);
- end-to-end tok/s: output tokens over the pass's wall time (prefill and the batch's tail included);
- step, forward and draft times of decode-only steps (medians), the draft's share of the MTP
  step, and the verify's forward against a plain one (its two query tokens per sequence);
- MTP acceptance (drafts accepted / verified) over the batch's passes;
- the speed-ups: the median (and range) of the ratios of the passes run back to back, so that
  the slow drifts of a shared machine cancel.

``--num-steps N``: the MTP engine drafts N tokens a step (``speculative_num_steps``; each draft
after the first is the MTP layer run again over the one before it); acceptance then counts every
draft, and the weight bounds model N drafts (harness/mtp_bounds.py). ``--steps-by-batch B:M,...``:
from B sequences in a step on, M drafts (``speculative_steps_by_batch``; the bounds follow it).
The report also gives, per batch, the fewest drafts a step whose bound reaches 1.5x when every
draft is accepted, and a roofline of the same steps (harness/mtp_bounds.py ``Roofline``) at this
machine's read bandwidth and GEMM rate, measured after the passes, with how far a plain step runs
from it.

Then, at batch 16: greedy and seeded sampling (temperature 0.8, a seed per request) each
compared token for token between the engines.

    .venv/bin/python benchmarks/mtp_speed.py --out benchmarks/results/mtp_speed.json \\
        --markdown benchmarks/results/mtp_speed.md
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from dsinfer.base.presets import DEFAULT_MODEL
from dsinfer.base.sampling_params import SamplingParams
from dsinfer.base.trace import load_trace
from dsinfer.engine.args import parse_steps_by_batch, steps_at
from dsinfer.engine.llm import LLM
from dsinfer.evals.tasks import lookup_context, make_question, render_context
from dsinfer.sim.model_dims import ModelShape
from harness.checkpoints import MTP_DEEP, MTP_WIDE, agreeing_mtp_checkpoint, build_checkpoint
from harness.mtp_bounds import MTPBound, Roofline, measure_rates
from harness.provenance import load_average, run_machine
from harness.results import add_output_args, machine_lines, save_report, table

MAX_TOKENS = 256
RANDOM_TOKENS = 64  # output tokens per request of a random model
BOUNDS = (
    "batch",
    "verify / plain",
    "by weights",
    "roofline",
    "draft share",
    "by weights",
    "roofline",
    "layer floor",
    "speed-up",
    "by weights",
    "roofline",
    "plain step / roofline",
)
RANDOM_MODELS = {"wide": MTP_WIDE, "deep": MTP_DEEP}
SAME_BATCH = 16  # the batch whose outputs are compared between the engines
TARGET_SPEEDUP = 1.5  # issue 46's batch-1 target: the report gives the drafts its bound needs
SPEED = ("batch", "acceptance", "plain decode", "MTP decode", "speed-up", "plain e2e", "MTP e2e", "speed-up")
PHASES = (
    "batch",
    "plain step",
    "MTP step",
    "tokens per sequence and MTP step",
    "plain forward",
    "verify forward",
    "verify / plain",
    "draft",
    "draft share",
    "MTP step less draft / plain step",
)


def _checkpoint(model: str | None, scratch: Path) -> str | None:
    if model not in RANDOM_MODELS:
        return model
    print(f"building the {model} checkpoint (transformers, random weights)", flush=True)
    source = build_checkpoint(scratch / f"{model}-source", RANDOM_MODELS[model], num_shards=1)
    return str(agreeing_mtp_checkpoint(source, scratch / model))


def _sampling(args: argparse.Namespace, **params: Any) -> SamplingParams:
    if args.model in RANDOM_MODELS:  # a bigram model's replies cycle: fixed lengths
        return SamplingParams(max_tokens=RANDOM_TOKENS, ignore_eos=True, **params)
    return SamplingParams(max_tokens=MAX_TOKENS, **params)


def _random_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(2, MTP_WIDE["vocab_size"]) for _ in range(rng.randrange(32, 65))] for _ in range(count)
    ]


def _question(task: str, rng: random.Random) -> str:
    if task == "lines":
        return render_context(lookup_context(rng, rng.randrange(6, 9))) + "Repeat the lines."
    return make_question(task, rng).prompt


def _prompts(llm: LLM, task: str, count: int, seed: int) -> list[list[int]]:
    tok, rng = llm.get_tokenizer(), random.Random(seed)
    prompts = []
    for _ in range(count):
        messages = [{"role": "user", "content": _question(task, rng)}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        prompts.append(tok.encode(text, add_special_tokens=False))
    return prompts


def _pass(
    llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> dict[str, Any]:
    start = time.perf_counter_ns()
    outs = llm.generate(prompts, params, use_tqdm=False)
    end = time.perf_counter_ns()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"start_ns": start, "end_ns": end, "tokens": tokens, "output_tokens": sum(map(len, tokens))}


def _phases(events: list[dict[str, Any]], start_ns: int, end_ns: int) -> dict[str, float]:
    """Decode-only steps of one pass, from the trace: their tokens, time and phase medians."""
    inside = [e for e in events if start_ns / 1e3 <= e["ts"] and e["ts"] + e["dur"] <= end_ns / 1e3]
    steps = {e["args"]["step"]: e for e in inside if e["name"] == "STEP" and e["args"]["prefill_tokens"] == 0}
    phase = {name: [e["dur"] for e in inside if e["name"] == name and e["args"]["step"] in steps]
             for name in ("FORWARD", "MTP_DRAFT")}  # fmt: skip
    seconds = sum(e["dur"] for e in steps.values()) / 1e6
    out = {
        "decode_steps": len(steps),
        "decode_tok_s": sum(e["args"]["tokens_out"] for e in steps.values()) / seconds,
        "tokens_per_seq_step": sum(e["args"]["tokens_out"] for e in steps.values())
        / sum(e["args"]["seqs"] for e in steps.values()),
        "step_ms": statistics.median(e["dur"] for e in steps.values()) / 1e3,
        "forward_ms": statistics.median(phase["FORWARD"]) / 1e3,
    }
    if phase["MTP_DRAFT"]:
        out["draft_ms"] = statistics.median(phase["MTP_DRAFT"]) / 1e3
        draft = sum(phase["MTP_DRAFT"]) / 1e6
        out["draft_share"] = draft / seconds
    return out


def _acceptance(llm: LLM) -> tuple[int, int]:
    stats = llm.engine.scheduler.stats
    return stats.drafts_proposed, stats.drafts_accepted


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="mtp-speed-") as scratch:  # traces, a random checkpoint
        return _run(args, Path(scratch))


def _run(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    model = _checkpoint(args.model, scratch)
    batches = [int(b) for b in args.batches.split(",")]
    count = max(*batches, SAME_BATCH)
    engines = {
        mode: LLM(
            model,
            dtype=args.dtype,
            device=args.device,
            cuda_graph_max_bs=count,  # graphs (CUDA only) for every batch the passes run
            speculative_mtp=mode == "mtp",
            speculative_num_steps=args.num_steps if mode == "mtp" else 1,
            speculative_steps_by_batch=args.steps_by_batch if mode == "mtp" else "",
            speculative_draft_dtype=args.draft_dtype if mode == "mtp" else "auto",
            enable_prefix_caching=False,
            kv_cache_memory=2**30,
            trace_dir=scratch / mode,
            trace_flush_steps=10**6,
        )
        for mode in ("plain", "mtp")
    }
    device = engines["plain"].engine.runner.device
    if args.model in RANDOM_MODELS:
        prompts = _random_prompts(count, args.seed)
    else:
        prompts = _prompts(engines["plain"], args.task, count, args.seed)
    greedy = _sampling(args, temperature=0.0)
    for llm in engines.values():  # compile and warm every path once
        llm.generate(prompts[: max(batches)], greedy, use_tqdm=False)
    passes: list[dict[str, Any]] = []
    acceptance: dict[int, float | None] = {}
    for batch in batches:
        before = _acceptance(engines["mtp"])
        for rep in range(args.repeats):
            order = ("plain", "mtp") if rep % 2 == 0 else ("mtp", "plain")
            for mode in order:
                result = _pass(engines[mode], prompts[:batch], greedy)
                passes.append({"batch": batch, "mode": mode, "rep": rep, **result})
                print(f"batch {batch} {mode} pass {rep}: {result['output_tokens']} tokens", flush=True)
        proposed, accepted = (a - b for a, b in zip(_acceptance(engines["mtp"]), before, strict=True))
        acceptance[batch] = accepted / proposed if proposed else None
    seeded = [_sampling(args, temperature=0.8, seed=i) for i in range(SAME_BATCH)]
    same = {
        name: _pass(engines["plain"], prompts[:SAME_BATCH], params)["tokens"]
        == _pass(engines["mtp"], prompts[:SAME_BATCH], params)["tokens"]
        for name, params in (("greedy", greedy), ("seeded", seeded))
    }
    for llm in engines.values():
        llm.engine.close()  # flushes the traces
    traces = {mode: load_trace(next((scratch / mode).glob("*.json"))) for mode in engines}
    shape = ModelShape.preset(model or DEFAULT_MODEL)
    schedule = parse_steps_by_batch(args.steps_by_batch)
    dtype = getattr(torch, args.dtype)
    bandwidth, flops = measure_rates(device, dtype, shape.hidden)
    value_bytes = torch.tensor([], dtype=dtype).element_size()  # the weights' and the cache's
    draft_dtype = dtype if args.draft_dtype == "auto" else getattr(torch, args.draft_dtype)
    draft_flops = flops if draft_dtype == dtype else measure_rates(device, draft_dtype, shape.hidden)[1]
    bounds = []
    for b in batches:
        out = [p["output_tokens"] / b for p in passes if p["batch"] == b and p["mode"] == "mtp"]
        # the mean context a decode step attends over: the prompt and half the reply
        context = statistics.mean(map(len, prompts[:b])) + statistics.median(out) / 2
        roofline = Roofline(bandwidth, flops, value_bytes, value_bytes, context)
        draft_roofline = (
            Roofline(bandwidth, draft_flops, draft_dtype.itemsize, value_bytes, context)
            if draft_dtype != dtype
            else None
        )
        drafts = steps_at(args.num_steps, schedule, b)
        bounds.append(asdict(MTPBound.of(shape, b, acceptance[b] or 0.0, drafts, roofline, draft_roofline)))
    needed = {b: MTPBound.drafts_for(shape, b, TARGET_SPEEDUP) for b in batches}
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cuda_graphs": engines["plain"].engine.runner.decode_graphs is not None,
        "rows": _rows(passes, traces, acceptance),
        "identical": same,
        "bounds": bounds,
        "roofline_machine": {
            "read_gb_s": bandwidth / 1e9,
            "gemm_gflop_s": flops / 1e9,
            **({"draft_gemm_gflop_s": draft_flops / 1e9} if draft_dtype != dtype else {}),
        },
        "drafts_for_target": needed,
    }


def _rows(
    passes: list[dict[str, Any]],
    traces: dict[str, list[dict[str, Any]]],
    acceptance: dict[int, float | None],
) -> list[dict[str, Any]]:
    rows = []
    for batch in sorted(acceptance):
        row: dict[str, Any] = {"batch": batch}
        per_pass: dict[str, list[dict[str, float]]] = {}
        for mode in ("plain", "mtp"):
            mine = sorted(
                (p for p in passes if p["batch"] == batch and p["mode"] == mode), key=lambda p: p["rep"]
            )
            per_pass[mode] = [
                {"e2e_tok_s": p["output_tokens"] / ((p["end_ns"] - p["start_ns"]) / 1e9),
                 **_phases(traces[mode], p["start_ns"], p["end_ns"])}
                for p in mine
            ]  # fmt: skip
            row[mode] = {k: statistics.median(x[k] for x in per_pass[mode]) for k in per_pass[mode][0]}
        row["acceptance"] = acceptance[batch]
        # speed-ups of each pair of passes run back to back: slow drifts of a shared machine cancel
        for key, name in (("decode_tok_s", "decode_speedup"), ("e2e_tok_s", "e2e_speedup")):
            ratios = [m[key] / p[key] for p, m in zip(per_pass["plain"], per_pass["mtp"], strict=True)]
            row[name], row[name + "_range"] = statistics.median(ratios), (min(ratios), max(ratios))
        row["verify_vs_plain_forward"] = row["mtp"]["forward_ms"] / row["plain"]["forward_ms"]
        # the verifying step without its draft against a plain step: the verify's cost where a
        # forward span only times its launch (CUDA graphs), sampling and bookkeeping included
        row["verify_vs_plain_step"] = (row["mtp"]["step_ms"] - row["mtp"]["draft_ms"]) / row["plain"][
            "step_ms"
        ]
        rows.append(row)
    return rows


def _speedup(row: dict[str, Any], name: str) -> str:
    low, high = row[name + "_range"]
    return f"{row[name]:.2f}x ({low:.2f}-{high:.2f})"


def _verify_cost(row: dict[str, Any], key: str) -> float:
    if key in row:
        return row[key]
    return (row["mtp"]["step_ms"] - row["mtp"]["draft_ms"]) / row["plain"]["step_ms"]  # older records


def _roof(bound: dict[str, Any], name: str, form: str) -> str:
    value = bound.get("roofline_" + name)  # absent from older records
    return "-" if value is None else form.format(value)


def _needed(needed: dict[Any, int | None]) -> str:
    # json turns the batches into strings
    return ", ".join(f"batch {b}: {'none up to 64' if n is None else n}" for b, n in needed.items())


def markdown(result: dict[str, Any]) -> str:
    rows = [
        (r["batch"], f"{r['acceptance']:.1%}", f"{r['plain']['decode_tok_s']:,.0f}", f"{r['mtp']['decode_tok_s']:,.0f}",
         _speedup(r, "decode_speedup"), f"{r['plain']['e2e_tok_s']:,.0f}", f"{r['mtp']['e2e_tok_s']:,.0f}",
         _speedup(r, "e2e_speedup"))
        for r in result["rows"]
    ]  # fmt: skip
    phases = [
        (r["batch"], f"{r['plain']['step_ms']:.2f}", f"{r['mtp']['step_ms']:.2f}", f"{r['mtp']['tokens_per_seq_step']:.2f}",
         f"{r['plain']['forward_ms']:.2f}", f"{r['mtp']['forward_ms']:.2f}", f"{r['verify_vs_plain_forward']:.2f}",
         f"{r['mtp']['draft_ms']:.2f}", f"{r['mtp']['draft_share']:.0%}",
         f"{_verify_cost(r, 'verify_vs_plain_step'):.2f}")
        for r in result["rows"]
    ]  # fmt: skip
    bounds = {b["batch"]: b for b in result.get("bounds", [])}
    # under CUDA graphs a forward span times its launch: the verify's cost is then its step's
    verify = "verify_vs_plain_step" if result.get("cuda_graphs") else "verify_vs_plain_forward"
    weights = [
        (r["batch"], f"{_verify_cost(r, verify):.2f}", f"{b['verify_vs_plain']:.2f}", _roof(b, "verify_vs_plain", "{:.2f}"),
         f"{r['mtp']['draft_share']:.0%}", f"{b['draft_share']:.0%}", _roof(b, "draft_share", "{:.0%}"),
         f"{b['layer_floor']:.0%}", f"{r['decode_speedup']:.2f}x", f"{b['speedup']:.2f}x", _roof(b, "speedup", "{:.2f}x"),
         "-" if b.get("roofline_plain_ms") is None else f"{r['plain']['step_ms'] / b['roofline_plain_ms']:.1f}x")
        for r in result["rows"] if (b := bounds.get(r["batch"])) is not None
    ]  # fmt: skip
    rates = result.get("roofline_machine")
    same = result["identical"]
    return "\n".join(
        [
            "# MTP against plain decoding (offline, one process, paired passes)",
            "",
            *machine_lines(result["machine"]),
            f"- model {result['model']}, {result['dtype']}; task {result['task']}; "
            f"{result.get('num_steps', 1)} MTP draft(s) a step"
            + (f" (by batch size: {result['steps_by_batch']})" if result.get("steps_by_batch") else "")
            + (
                f", drafted in {result['draft_dtype']}"
                if result.get("draft_dtype", "auto") not in ("auto", result["dtype"])
                else ""
            )
            + f"; device {result.get('device', 'cpu')}"
            + (
                ", decode and draft steps replayed from CUDA graphs (a forward's time is its launch; the "
                "draft's includes its sampling, which waits for the GPU)"
                if result.get("cuda_graphs")
                else ""
            ),
            f"- medians of {result['repeats']} paired passes per batch; outputs identical to plain decoding "
            f"(batch 16): greedy {'yes' if same['greedy'] else 'NO'}, seeded {'yes' if same['seeded'] else 'NO'}",
            "",
            "Output tokens per second (medians); speed-ups: the median of the paired passes' ratios (their "
            "range in brackets):",
            "",
            *table(SPEED, rows, "r" * len(SPEED)),
            "",
            "Decode-only steps (medians, ms): the step, the tokens an MTP step yields per sequence (mean), the "
            "target's forward (a plain step's, the verify's), the MTP layer's draft and its share of the "
            "MTP steps' time, and the MTP step less its draft against a plain step (the verify's cost where "
            "a forward only times its launch: CUDA graphs):",
            "",
            *table(PHASES, phases, "r" * len(PHASES)),
            "",
            *(
                [
                    "What bounds them (harness/mtp_bounds.py): measured against the weights each step reads "
                    "(dense ones once, routed experts once per distinct expert under uniform routing), the "
                    "cost of a step set by reading weights; a roofline, each part of a step (dense weights, "
                    "routed experts, attention over the mean context) timed as the longer of reading its "
                    "bytes and doing its FLOPs"
                    + (
                        f" at this machine's {rates['read_gb_s']:.1f} GB/s read and "
                        f"{rates['gemm_gflop_s']:.0f} GFLOP/s GEMM (measured here"
                        + (
                            f"; the draft's at its {rates['draft_gemm_gflop_s']:.0f} GFLOP/s and its weights' bytes"
                            if "draft_gemm_gflop_s" in rates
                            else ""
                        )
                        + ")"
                        if rates
                        else ""
                    )
                    + "; and the draft's share when every layer costs the same (a step set by "
                    "per-operation overhead). The roofline bounds a step that runs at it; the last "
                    "column says how far a plain step runs from it: several times its roofline time is a "
                    "step set by per-operation overhead and kernels below the machine's rates, which an "
                    "MTP step spreads over its tokens (there the measured speed-up passes the roofline's):",
                    "",
                    *table(BOUNDS, weights, "r" * len(BOUNDS)),
                    "",
                    f"The fewest drafts a step whose bound reaches {TARGET_SPEEDUP}x with every draft "
                    "accepted: " + _needed(result.get("drafts_for_target", {})) + ".",
                    "",
                ]
                if weights
                else []
            ),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="checkpoint, preset, wide or deep (default: the built-in model)"
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto", help="auto (CUDA where there is one), cpu, cuda")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--task",
        default="mul",
        help="mul (worked long multiplication) or lines; a random model: random prompts",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the questions")
    parser.add_argument(
        "--num-steps", type=int, default=1, help="MTP drafts a step (the engine's --speculative-num-steps)"
    )
    parser.add_argument(
        "--steps-by-batch",
        default="",
        help="fewer drafts at larger batches, e.g. 64:3 (the engine's --speculative-steps-by-batch)",
    )
    parser.add_argument(
        "--draft-dtype",
        default="auto",
        help="dtype the MTP layer drafts in (the engine's --speculative-draft-dtype; auto: --dtype)",
    )
    add_output_args(parser)
    args = parser.parse_args()
    machine = run_machine()
    result: dict[str, Any] = {
        "machine": machine,
        "model": args.model or "tiny-chat",
        "dtype": args.dtype,
        "task": "random prompts" if args.model in RANDOM_MODELS else args.task,
        "repeats": args.repeats,
        "num_steps": args.num_steps,
        "steps_by_batch": args.steps_by_batch,
        "draft_dtype": args.draft_dtype,
        **run(args),
    }
    machine["load_after"] = load_average()
    save_report(result, markdown(result), args.out, args.markdown)


if __name__ == "__main__":
    main()
