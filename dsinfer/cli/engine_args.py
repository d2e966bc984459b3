"""Command-line flags of the engine (``--max-model-len`` ...), shared by every command that runs one.

Every flag of the engine, gateway and pool takes its default (and, where one text serves both, its
help) from its field of EngineArgs, GatewayArgs or PoolArgs: ``field_default``, ``field_help``.
"""

from __future__ import annotations

import argparse
from typing import Any

from pydantic import BaseModel

from dsinfer.base.config import EP_BACKENDS, LOAD_FORMATS
from dsinfer.base.presets import DEFAULT_MODEL
from dsinfer.engine.args import INDEXER_CACHE_DTYPES, EngineArgs

_BINARY_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def field_default(model: type[BaseModel], name: str) -> Any:
    """The default of ``model``'s field ``name``: flags take their defaults from the argument
    models (EngineArgs, GatewayArgs, PoolArgs), so that none is written twice."""
    field = model.model_fields[name]
    if field.is_required():
        raise TypeError(f"{model.__name__}.{name} is required: it has no default to give a flag")
    return field.get_default(call_default_factory=True)


def field_help(model: type[BaseModel], name: str) -> str:
    """The field's ``Field(description=...)``: a flag's help, where one text serves both."""
    description = model.model_fields[name].description
    if description is None:
        raise TypeError(f"{model.__name__}.{name} has no description to give a flag")
    return description


def size_text(size: int) -> str:
    """``size`` bytes in the largest binary unit that holds it whole (8GiB); parse_size reads it back."""
    for unit, scale in _BINARY_UNITS:
        if size and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def _default(name: str) -> Any:
    return field_default(EngineArgs, name)


def _help(name: str) -> str:
    return field_help(EngineArgs, name)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=_default("model"),
        help=f"checkpoint directory or preset name (default: {DEFAULT_MODEL})",
    )
    group.add_argument(
        "--load-format",
        default=_default("load_format"),
        choices=LOAD_FORMATS,
        help="how the weights are read: safetensors, dummy (random, seeded by --seed), or auto = "
        "safetensors when the checkpoint has them, dummy for a preset without (default: %(default)s)",
    )
    group.add_argument(
        "--dtype",
        default=_default("dtype"),
        choices=("auto", "float32", "bfloat16", "float16"),
        help="weights and activations; auto = bfloat16 on a GPU, float32 on a CPU (default: %(default)s)",
    )
    group.add_argument(
        "--device", default=_default("device"), help="cpu, cuda, cuda:N (default: cuda if present)"
    )
    group.add_argument(
        "--seed", type=int, default=_default("seed"), help=f"{_help('seed')} (default: %(default)s)"
    )
    group.add_argument(
        "--max-model-len",
        type=int,
        default=_default("max_model_len"),
        help="default: the model's context length",
    )
    group.add_argument(
        "--max-num-seqs",
        type=int,
        default=_default("max_num_seqs"),
        help=f"{_help('max_num_seqs')} (default: %(default)s)",
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=_default("max_num_batched_tokens"),
        help=f"{_help('max_num_batched_tokens')} (default: %(default)s)",
    )
    group.add_argument(
        "--kv-cache-memory", default=_default("kv_cache_memory"), help="KV cache size, e.g. 4GiB"
    )
    group.add_argument(
        "--indexer-cache-dtype",
        default=_default("indexer_cache_dtype"),
        choices=INDEXER_CACHE_DTYPES,
        help="V3.2's indexer key cache: fp8 (as released), model (the model dtype); auto = fp8 on GPUs"
        " (default: %(default)s)",
    )
    group.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=_default("kv_cache_memory_fraction"),
        help="of free memory, if no size",
    )
    group.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="compute every prompt whole (default: reuse the cached KV of a prefix seen before)",
    )
    group.add_argument(
        "--kv-disk-cache-dir", default=_default("kv_disk_cache_dir"), help="on-disk KV cache tier directory"
    )
    group.add_argument(
        "--kv-disk-cache-size",
        default=_default("kv_disk_cache_size"),
        help=f"{_help('kv_disk_cache_size')} (default: {size_text(_default('kv_disk_cache_size'))})",
    )
    group.add_argument("--speculative-mtp", action="store_true", help="draft with the checkpoint's MTP layer")
    group.add_argument(
        "--num-redundant-experts",
        type=int,
        default=_default("num_redundant_experts"),
        help=f"{_help('num_redundant_experts')} (default: %(default)s)",
    )
    group.add_argument(
        "--placement", default=_default("placement"), help="expert placement file (JSON) for EP pools"
    )
    group.add_argument(
        "--eplb-interval",
        type=int,
        default=_default("eplb_interval"),
        help="steps between online expert rebalancing checks, 0 = off (default: %(default)s)",
    )
    group.add_argument(
        "--eplb-min-gain",
        type=float,
        default=_default("eplb_min_gain"),
        help=f"{_help('eplb_min_gain')} (default: %(default)s)",
    )
    group.add_argument(
        "--eplb-stage-budget",
        type=float,
        default=_default("eplb_stage_budget"),
        help=f"{_help('eplb_stage_budget')} (default: %(default)s)",
    )
    group.add_argument(
        "--prefill-attention-weight",
        type=float,
        default=_default("prefill_attention_weight"),
        help="attention-aware prefill chunks: query-key pairs that cost one token of the step budget "
        "(default: the budget counts tokens only)",
    )
    group.add_argument(
        "--prefill-context-weight",
        type=float,
        default=_default("prefill_context_weight"),
        help="with --prefill-attention-weight: budget cost per cached token a chunk decompresses"
        " (default: %(default)s)",
    )
    group.add_argument(
        "--enable-overlap",
        action="store_true",
        help="EP pools: two micro-batches per step, one's dispatch/combine under the other's compute",
    )
    group.add_argument(
        "--ep-backend",
        default=_default("ep_backend"),
        choices=EP_BACKENDS,
        help="expert all-to-all of an EP pool: auto = DeepEP on an NCCL group when deep_ep is "
        "installed, else torch all-to-all; torch forces the latter (default: %(default)s)",
    )
    group.add_argument(
        "--overlap-min-tokens",
        type=int,
        default=_default("overlap_min_tokens"),
        help="with --enable-overlap, steps below this many tokens on every rank run one micro-batch "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--trace",
        dest="trace_dir",
        default=_default("trace_dir"),
        metavar="DIR",
        help="write a Chrome trace per rank (DIR/trace-rank{R}.json): stage chunks and EP transfers",
    )
    group.add_argument(
        "--enforce-eager", action="store_true", help="CUDA: never capture the decode step in CUDA graphs"
    )
    group.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=_default("cuda_graph_max_bs"),
        help="CUDA: largest decode batch captured in a graph (default: --max-num-seqs)",
    )


def engine_args_from(args: argparse.Namespace, **overrides: Any) -> EngineArgs:
    """EngineArgs from parsed flags; pydantic's ValueError names a bad value."""
    fields = {name: getattr(args, name) for name in EngineArgs.model_fields if hasattr(args, name)}
    return EngineArgs(**{**fields, **overrides})
