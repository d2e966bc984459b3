"""Command-line flags of the engine (``--max-model-len`` ...), shared by every command that runs one."""

from __future__ import annotations

import argparse
from typing import Any

from dsinfer.base.config import EP_BACKENDS, LOAD_FORMATS
from dsinfer.base.presets import DEFAULT_MODEL
from dsinfer.engine.args import INDEXER_CACHE_DTYPES, EngineArgs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model", default=None, help=f"checkpoint directory or preset name (default: {DEFAULT_MODEL})"
    )
    group.add_argument("--load-format", default="auto", choices=LOAD_FORMATS)
    group.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    group.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda if present)")
    group.add_argument("--seed", type=int, default=0, help="seed of dummy weights and of unseeded requests")
    group.add_argument("--max-model-len", type=int, default=None, help="default: the model's context length")
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    group.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 4GiB")
    group.add_argument(
        "--indexer-cache-dtype",
        default="auto",
        choices=INDEXER_CACHE_DTYPES,
        help="V3.2's indexer key cache: fp8 (as released), model (the model dtype); auto = fp8 on GPUs",
    )
    group.add_argument(
        "--kv-cache-memory-fraction", type=float, default=None, help="of free memory, if no size"
    )
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    group.add_argument("--kv-disk-cache-dir", default=None, help="on-disk KV cache tier directory")
    group.add_argument("--kv-disk-cache-size", default="8GiB")
    group.add_argument("--speculative-mtp", action="store_true", help="draft with the checkpoint's MTP layer")
    group.add_argument(
        "--num-redundant-experts", type=int, default=0, help="extra expert slots per MoE layer (EP pools)"
    )
    group.add_argument("--placement", default=None, help="expert placement file (JSON) for EP pools")
    group.add_argument(
        "--eplb-interval",
        type=int,
        default=0,
        help="steps between online expert rebalancing checks (0 = off)",
    )
    group.add_argument("--eplb-min-gain", type=float, default=0.05, help="relative balance gain to rebalance")
    group.add_argument(
        "--eplb-stage-budget",
        type=float,
        default=0.1,
        help="online rebalancing: time staging new experts per step, as a fraction of the median step",
    )
    group.add_argument(
        "--prefill-attention-weight",
        type=float,
        default=None,
        help="attention-aware prefill chunks: query-key pairs that cost one token of the step budget "
        "(default: the budget counts tokens only)",
    )
    group.add_argument(
        "--prefill-context-weight",
        type=float,
        default=0.0,
        help="with --prefill-attention-weight: budget cost per cached token a chunk decompresses",
    )
    group.add_argument(
        "--enable-overlap",
        action="store_true",
        help="EP pools: two micro-batches per step, one's dispatch/combine under the other's compute",
    )
    group.add_argument(
        "--ep-backend",
        default="auto",
        choices=EP_BACKENDS,
        help="expert all-to-all of an EP pool: auto = DeepEP on an NCCL group when deep_ep is "
        "installed, else torch all-to-all; torch forces the latter (default: %(default)s)",
    )
    group.add_argument(
        "--overlap-min-tokens",
        type=int,
        default=64,
        help="with --enable-overlap, steps below this many tokens on every rank run one micro-batch",
    )
    group.add_argument(
        "--trace",
        dest="trace_dir",
        default=None,
        metavar="DIR",
        help="write a Chrome trace per rank (DIR/trace-rank{R}.json): stage chunks and EP transfers",
    )
    group.add_argument(
        "--enforce-eager", action="store_true", help="CUDA: never capture the decode step in CUDA graphs"
    )
    group.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=None,
        help="CUDA: largest decode batch captured in a graph (default: --max-num-seqs)",
    )


def engine_args_from(args: argparse.Namespace, **overrides: Any) -> EngineArgs:
    """EngineArgs from parsed flags; pydantic's ValueError names a bad value."""
    fields = {name: getattr(args, name) for name in EngineArgs.model_fields if hasattr(args, name)}
    return EngineArgs(**{**fields, **overrides})
