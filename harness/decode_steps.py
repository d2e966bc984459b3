"""Decode step times at a given context without prefilling it: each model's cache filled with
random values of the right shapes (a decode step's time does not depend on their values), then
``warmup + repeats`` steps of one new token per sequence, the last ``repeats`` timed.

- V3 / V3.2 (``v3_step_times``): a paged pool with every layer's latent (and indexer keys) random;
  the step reads them through the absorbed path.
- V4 (``v4_step_times``): each sequence's hybrid cache (dsinfer/model/v4_state.py) shaped as after
  ``context`` tokens: the window's last rows, one compressed entry per ``rate`` tokens (CSA's
  indexer keys too) and the compressors' state, taken from a real 256-token prefill whose entries
  and window are then replaced.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dsinfer.base.config import ModelConfig
from dsinfer.cache.kv_pool import PagedKVPool
from dsinfer.model.batch import ForwardBatch
from dsinfer.model.deepseek_v4 import DeepseekV4ForCausalLM
from dsinfer.model.v4_state import DenseEntries, SequenceState
from dsinfer.ops import select_ops
from harness.plots import plot_result
from harness.provenance import load_average, run_machine
from harness.results import add_output_args, machine_lines, save_report, table

PAGE = 64


def parse_step_args(doc: str | None, contexts: str) -> argparse.Namespace:
    """The command line of a step-time benchmark (``doc``: its help): contexts and batches swept,
    warm-up and timed steps, and where the results go."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default=contexts)
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    add_output_args(parser)
    return parser.parse_args()


def step_grid(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(batch, context) of every measurement ``add_step_args``'s flags ask for, batch-major."""
    return [(b, c) for b in map(int, args.batches.split(",")) for c in map(int, args.contexts.split(","))]


def step_machine() -> dict[str, Any]:
    """Where a step-time run comes from, taken before it starts (it sets ``load_after`` at its end)."""
    return run_machine(torch.get_num_threads())


def step_report(title: str, machine: dict[str, Any], sections: Sequence[tuple[str, list[str]]]) -> str:
    """A step-time run's markdown: ``title``, its provenance, then each section's lead line and
    its lines (a table, or nothing)."""
    lines = [f"# {title}", "", *machine_lines(machine)]
    for lead, body in sections:
        lines += ["", lead, *(["", *body] if body else [])]
    return "\n".join(lines) + "\n"


def sweep(args: argparse.Namespace, measure: Callable[[int, int], dict[str, Any]]) -> list[dict[str, Any]]:
    """A row per (batch, context) of the grid the flags ask for: ``measure(batch, context)``'s
    fields after the two, each row printed as it lands."""
    rows = []
    for batch, context in step_grid(args):
        rows.append({"batch": batch, "context": context, **measure(batch, context)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def save_step_run(
    args: argparse.Namespace,
    machine: dict[str, Any],
    fields: dict[str, Any],
    markdown: Callable[[dict[str, Any]], str],
) -> None:
    """The run's results file (its ``machine``, ``fields`` and the ops) with its markdown and plot."""
    machine["load_after"] = load_average()
    result = {"machine": machine, **fields, "ops": select_ops("cpu").describe()}
    save_report(result, markdown(result), args.out, args.markdown)
    plot_result(args.out)


def step_times_section(
    rows: list[dict[str, Any]], shapes: str, series: dict[str, str], ratio: tuple[str, str, str]
) -> tuple[str, list[str]]:
    """The decode-step section of ``step_report``: per row its batch, context, each of ``series``
    (name -> label) as median (min) ms, and ``ratio`` (numerator, denominator, label)."""
    num, den, label = ratio
    body = [
        (
            r["batch"],
            f"{r['context']:,}",
            *(f"{r[f'{name}_ms']:.1f} ({r[f'{name}_min_ms']:.1f})" for name in series),
            f"{r[f'{num}_ms'] / r[f'{den}_ms']:.2f}",
        )
        for r in rows
    ]
    lead = (
        f"Decode step (2 layers with {shapes} attention shapes, float32, CPU), median of the timed "
        "steps (min in brackets), ms:"
    )
    return lead, table(("batch", "context", *series.values(), label), body, "r" * (len(series) + 3))


def timing_fields(name: str, seconds: list[float]) -> dict[str, float]:
    """``{name}_ms`` (the median) and ``{name}_min_ms`` of timed steps."""
    return {f"{name}_ms": 1e3 * statistics.median(seconds), f"{name}_min_ms": 1e3 * min(seconds)}


def _timed(step: Any, warmup: int, repeats: int) -> list[float]:
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def v3_step_times(
    model: Any, config: ModelConfig, context: int, batch: int, warmup: int, repeats: int
) -> list[float]:
    pages_per_seq = -(-(context + 1) // PAGE)
    pool = PagedKVPool.for_model(
        config, config.num_hidden_layers, batch * pages_per_seq, torch.float32, "cpu"
    )
    gen = torch.Generator().manual_seed(0)
    for layer in pool.caches:
        for cache in layer.tensors():
            cache.copy_(torch.randn(cache.shape, generator=gen))
    tables = torch.arange(batch * pages_per_seq, dtype=torch.int32).view(batch, pages_per_seq)
    slots = tables[:, context // PAGE].long() * PAGE + context % PAGE

    def step() -> None:
        forward = ForwardBatch(
            positions=torch.full((batch,), context, dtype=torch.int64),
            slot_mapping=slots,
            block_tables=tables,
            q_lens=[1] * batch,
            kv_lens=[context + 1] * batch,
            num_absorbed=batch,
        )
        ids = torch.randint(2, config.vocab_size, (batch,), generator=gen)
        model.compute_logits(model(ids, forward, pool.caches))

    return _timed(step, warmup, repeats)


def v4_state_at(model: DeepseekV4ForCausalLM, context: int, seed: int = 0) -> SequenceState:
    """A sequence's V4 cache shaped as after ``context`` tokens (a multiple of 256)."""
    config = model.config
    if context % 256:
        raise ValueError(f"context {context} is not a multiple of 256")
    gen = torch.Generator().manual_seed(seed)
    state = model.new_state()
    model(torch.randint(2, config.vocab_size, (256,), generator=gen), state)
    for index, layer in enumerate(state.layers):
        layer.window = torch.randn(layer.window.shape, generator=gen)
        rate = config.compress_rate(index)
        for series in (layer.compressed, layer.indexer):
            if series is not None:
                width = series.entries.read().shape[1]
                series.entries = DenseEntries(torch.randn(context // rate, width, generator=gen))
    state.length = context
    return state


def v4_step_times(
    model: DeepseekV4ForCausalLM, context: int, batch: int, warmup: int, repeats: int
) -> tuple[list[float], dict[str, int]]:
    """-> (the step times, the bytes one sequence's cache holds by group)."""
    states = [v4_state_at(model, context, seed) for seed in range(batch)]
    gen = torch.Generator().manual_seed(1)

    def step() -> None:
        for state in states:
            state.length = context  # every timed step decodes at ``context``
        ids = torch.randint(2, model.config.vocab_size, (batch,), generator=gen)
        model.compute_logits(model.forward_many(ids, states, [1] * batch))

    return _timed(step, warmup, repeats), states[0].nbytes()


def v4_mtp_step_times(
    model: DeepseekV4ForCausalLM, context: int, batch: int, warmup: int, repeats: int
) -> tuple[list[float], list[float]]:
    """MTP on ``model`` (with its MTP layer) at ``context``: (verification steps: the last token
    and a draft per sequence through the target with undo records, its logits, the draft taken
    back as rejected; the MTP layer's drafts: one position per sequence over its window, and the
    draft logits)."""
    states = [v4_state_at(model, context, seed) for seed in range(batch)]
    config, gen = model.config, torch.Generator().manual_seed(2)
    for state in states:  # the MTP layer's window, as after a prompt
        mtp = state.layers[config.num_hidden_layers]
        mtp.window = torch.randn(config.sliding_window - 1, config.head_dim, generator=gen)
    last: list[torch.Tensor] = []

    def verify() -> None:
        for state in states:
            state.length = context
        ids = torch.randint(2, config.vocab_size, (2 * batch,), generator=gen)
        streams = model.forward_streams(ids, states, [2] * batch, undo=[True] * batch)
        model.compute_logits(model.finish(streams, states, [2] * batch))
        for state in states:
            model.drop_last(state)
        last[:] = [streams[0::2]]  # each sequence's kept position

    def draft() -> None:
        ids = torch.randint(2, config.vocab_size, (batch,), generator=gen)
        out = model.forward_mtp(last[0], ids, states, [context] * batch, [1] * batch)
        model.compute_mtp_logits(out)

    verify()
    return _timed(verify, warmup, repeats), _timed(draft, warmup, repeats)
