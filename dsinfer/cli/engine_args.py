"""Command-line flags of the engine (``--max-model-len`` ...), shared by every command that runs one.

Every flag of the engine, gateway and pool takes its default (and, where one text serves both, its
help) from its field of EngineArgs, GatewayArgs or PoolArgs: ``field_default``, ``field_help``;
``FieldFlags`` adds such flags.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
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


class FieldFlags:
    """Adds to ``group`` the flags that stand for fields of ``model``."""

    def __init__(self, group: argparse._ArgumentGroup, model: type[BaseModel]) -> None:
        self.group, self.model = group, model

    def __call__(
        self,
        name: str,
        type: Callable[[str], Any] | None = None,
        *,
        help: str | None = None,
        flag: str | None = None,
        **options: Any,
    ) -> None:
        """``--the-field-name`` (or ``flag``) defaulting to the field ``name``; without ``help``, the
        field's description and ``(default: ...)``. ``options`` go to ``add_argument`` as they are."""
        if help is None:
            help = f"{field_help(self.model, name)} (default: %(default)s)"
        if type is not None:
            options["type"] = type
        default = field_default(self.model, name)
        self.group.add_argument(flag or "--" + name.replace("_", "-"), default=default, help=help, **options)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    flag = FieldFlags(group, EngineArgs)
    flag("model", help=f"checkpoint directory or preset name (default: {DEFAULT_MODEL})")
    flag(
        "load_format",
        choices=LOAD_FORMATS,
        help="how the weights are read: safetensors, dummy (random, seeded by --seed), or auto = "
        "safetensors when the checkpoint has them, dummy for a preset without (default: %(default)s)",
    )
    flag(
        "dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="weights and activations; auto = bfloat16 on a GPU, float32 on a CPU (default: %(default)s)",
    )
    flag("device", help="cpu, cuda, cuda:N (default: cuda if present)")
    flag("seed", int)
    flag("max_model_len", int, help="default: the model's context length")
    flag("max_num_seqs", int)
    flag("max_num_batched_tokens", int)
    flag("kv_cache_memory", help="KV cache size, e.g. 4GiB")
    flag(
        "indexer_cache_dtype",
        choices=INDEXER_CACHE_DTYPES,
        help="V3.2's indexer key cache: fp8 (as released), model (the model dtype); auto = fp8 on GPUs"
        " (default: %(default)s)",
    )
    flag("kv_cache_memory_fraction", float, help="of free memory, if no size")
    group.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="compute every prompt whole (default: reuse the cached KV of a prefix seen before)",
    )
    flag(
        "kv_host_cache_size",
        help="host-memory KV tier (pages the pool evicts, hit before the disk), e.g. 16GiB; 0 = off "
        "(default: 0.1 of free host memory at start-up)",
    )
    flag("kv_disk_cache_dir", help="on-disk KV cache tier directory")
    disk_size = field_default(EngineArgs, "kv_disk_cache_size")
    flag(
        "kv_disk_cache_size",
        help=f"{field_help(EngineArgs, 'kv_disk_cache_size')} (default: {size_text(disk_size)})",
    )
    group.add_argument("--speculative-mtp", action="store_true", help="draft with the checkpoint's MTP layer")
    flag(
        "speculative_num_steps",
        int,
        help="draft tokens per step with --speculative-mtp: the MTP layer runs once per draft, each run "
        "reading the last one's output (default: %(default)s)",
    )
    flag(
        "speculative_steps_by_batch",
        help=f"{field_help(EngineArgs, 'speculative_steps_by_batch')} (default: none)",
    )
    flag(
        "speculative_draft_dtype",
        help=f"{field_help(EngineArgs, 'speculative_draft_dtype')} (default: %(default)s)",
    )
    flag("num_redundant_experts", int)
    flag("placement", help="expert placement file (JSON) for EP pools")
    flag(
        "eplb_interval",
        int,
        help="steps between online expert rebalancing checks, 0 = off (default: %(default)s)",
    )
    flag("eplb_min_gain", float)
    flag("eplb_stage_budget", float)
    flag(
        "prefill_attention_weight",
        float,
        help="attention-aware prefill chunks: query-key pairs that cost one token of the step budget "
        "(default: the budget counts tokens only)",
    )
    flag(
        "prefill_context_weight",
        float,
        help="with --prefill-attention-weight: budget cost per cached token a chunk decompresses"
        " (default: %(default)s)",
    )
    group.add_argument(
        "--enable-overlap",
        action="store_true",
        help="EP pools: two micro-batches per step, one's dispatch/combine under the other's compute",
    )
    flag(
        "ep_backend",
        choices=EP_BACKENDS,
        help="expert all-to-all of an EP pool: auto = DeepEP on an NCCL group when deep_ep is "
        "installed, else torch all-to-all; torch forces the latter (default: %(default)s)",
    )
    flag(
        "overlap_min_tokens",
        int,
        help="with --enable-overlap, steps below this many tokens on every rank run one micro-batch "
        "(default: %(default)s)",
    )
    flag(
        "trace_dir",
        flag="--trace",
        dest="trace_dir",
        metavar="DIR",
        help="write a Chrome trace per rank (DIR/trace-rank{R}.json): stage chunks and EP transfers",
    )
    flag("kernel_backends", help=field_help(EngineArgs, "kernel_backends") + " (default: %(default)s)")
    group.add_argument(
        "--enforce-eager", action="store_true", help="CUDA: never capture the decode step in CUDA graphs"
    )
    flag(
        "cuda_graph_max_bs",
        int,
        help="CUDA: largest decode batch captured in a graph (default: --max-num-seqs)",
    )


def engine_args_from(args: argparse.Namespace, **overrides: Any) -> EngineArgs:
    """EngineArgs from parsed flags; pydantic's ValueError names a bad value."""
    fields = {name: getattr(args, name) for name in EngineArgs.model_fields if hasattr(args, name)}
    return EngineArgs(**{**fields, **overrides})
