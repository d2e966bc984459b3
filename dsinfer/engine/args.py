"""Engine arguments, shared by the offline API and (later) the servers' command lines."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dsinfer.base.config import EP_BACKENDS, LOAD_FORMATS
from dsinfer.base.kv_spec import IndexerFormat
from dsinfer.ops import parse_prefer

INDEXER_CACHE_DTYPES = ("auto", "fp8", "model")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "K": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "KI": 2**10,
    "MI": 2**20,
    "GI": 2**30,
    "TI": 2**40,
}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string with a unit: '2GiB', '512MB', '1073741824'."""
    if isinstance(value, int):
        return value
    match = _SIZE.match(value)
    if not match:
        raise ValueError(f"cannot read {value!r} as a size (examples: 2GiB, 512MB, 1073741824)")
    unit = (match.group(2) or "").upper().removesuffix("B")
    return int(float(match.group(1)) * _UNITS[unit])


def steps_at(num_steps: int, steps_by_batch: tuple[tuple[int, int], ...], num_seqs: int) -> int:
    """The drafts a step of ``num_seqs`` sequences proposes: ``num_steps``, or the last entry of
    ``steps_by_batch`` (increasing batch sizes) whose batch size ``num_seqs`` reaches."""
    for batch, steps in steps_by_batch:
        if num_seqs >= batch:
            num_steps = steps
    return num_steps


def parse_steps_by_batch(value: str) -> tuple[tuple[int, int], ...]:
    """'16:3,64:1' -> ((16, 3), (64, 1)); '' -> ()."""
    pairs = []
    for part in filter(None, (p.strip() for p in value.split(","))):
        batch, sep, steps = part.partition(":")
        if not sep or not batch.strip().isdigit() or not steps.strip().isdigit():
            raise ValueError(f"cannot read {part!r} of {value!r} as BATCH:DRAFTS (example: 16:3,64:1)")
        pairs.append((int(batch), int(steps)))
    return tuple(pairs)


HOST_TIER_FRACTION = 0.1  # of the host's free memory: the host-memory KV tier's default size


class EngineArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = None  # checkpoint directory or preset; None = the built-in model (tiny-chat)
    load_format: str = "auto"
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"
    kernel_backends: str = Field(
        "auto",
        description="kernel backends tried first where they run, comma-separated (e.g. numba: the "
        "float32-math CPU kernels, not AMX; torch: the references everywhere); auto = the best here",
    )
    seed: int = Field(0, description="seed of dummy weights and of unseeded requests")
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = Field(256, description="most sequences running at once")
    max_num_batched_tokens: int = Field(
        2048, description="token budget of one step (prefill chunks + decodes)"
    )
    kv_cache_memory: int | None = None  # bytes for the KV cache; None = default_kv_budget()
    # V3.2's indexer key cache: fp8 (DeepSeek's release format), model (the model dtype, as
    # transformers scores), auto = fp8 on a GPU, model on a CPU
    indexer_cache_dtype: str = "auto"
    kv_cache_memory_fraction: float | None = None  # default: kv_fraction_for(device)
    enable_prefix_caching: bool = True
    # host-memory KV tier (pages the pool evicts); None = host_tier_bytes' default, 0 = off
    kv_host_cache_size: int | None = None
    kv_disk_cache_dir: Path | None = None  # on-disk KV tier; None = off
    kv_disk_cache_size: int = Field(8 * 2**30, description="size of the on-disk KV tier, e.g. 64GiB")
    speculative_mtp: bool = False
    # drafts per step with --speculative-mtp: the MTP layer runs once per draft, each run reading the
    # last one's output (SGLang's --speculative-num-steps, vLLM's num_speculative_tokens)
    speculative_num_steps: int = 1
    speculative_steps_by_batch: str | None = Field(
        None,
        description="fewer drafts a step at larger batches: 'B:N,...', from B sequences in a step on "
        "N drafts (at most --speculative-num-steps), e.g. 16:3,64:1",
    )
    speculative_draft_dtype: str = Field(
        "auto",
        description="dtype the MTP layer drafts in: auto (the model's), float32, bfloat16 or float16; "
        "a narrower one drafts faster, the target still verifies in --dtype (outputs unchanged)",
    )
    num_redundant_experts: int = Field(
        0, description="extra expert slots per MoE layer, spread over an EP pool's ranks"
    )
    placement: Path | None = None  # expert placement file (JSON); None = the default layout
    eplb_interval: int = 0  # steps between online expert-rebalancing checks in an EP pool; 0 = off
    eplb_min_gain: float = Field(
        0.05, description="rebalance online when max/mean per-rank load would improve by more than this"
    )
    eplb_stage_budget: float = Field(
        0.1,
        description="online rebalancing: time staging new experts per step, as a fraction of the median step",
    )
    # attention-aware prefill chunking (engine/scheduler.py): the step budget also counts a chunk's
    # query-key pairs / prefill_attention_weight and prefill_context_weight per cached token
    prefill_attention_weight: float | None = None  # None = the budget counts tokens only
    prefill_context_weight: float = 0.0
    enable_overlap: bool = False  # two micro-batches per step in an EP pool (comm under compute)
    ep_backend: str = "auto"  # expert all-to-all of an EP pool: auto (DeepEP where usable), deepep, torch
    overlap_min_tokens: int = 64  # steps with fewer tokens on every rank run one micro-batch
    trace_dir: Path | None = None  # Chrome trace per rank (trace-rank{R}.json); None = off
    trace_flush_steps: int = 50  # steps between appends to the trace file (and at close)
    enforce_eager: bool = False  # never capture CUDA graphs (vLLM's name); graphs are CUDA-only anyway
    cuda_graph_max_bs: int | None = None  # largest captured decode batch; None = max_num_seqs

    @property
    def draft_schedule(self) -> tuple[tuple[int, int], ...]:
        """``speculative_steps_by_batch`` read: ((batch size, drafts), ...), increasing batch sizes."""
        return parse_steps_by_batch(self.speculative_steps_by_batch or "")

    def _check_steps_by_batch(self) -> None:
        schedule = self.draft_schedule
        if not schedule:
            return
        if not self.speculative_mtp:
            raise ValueError("speculative_steps_by_batch sets MTP's drafts a step: add --speculative-mtp")
        batches = [b for b, _ in schedule]
        if batches[0] < 2 or any(b <= a for a, b in itertools.pairwise(batches)):
            raise ValueError(f"speculative_steps_by_batch: batch sizes from 2 up, increasing; got {batches}")
        bad = [n for _, n in schedule if not 1 <= n <= self.speculative_num_steps]
        if bad:
            raise ValueError(
                f"speculative_steps_by_batch: drafts a step from 1 to speculative_num_steps "
                f"({self.speculative_num_steps}); got {bad}"
            )

    def indexer_format_for(self, device_type: str) -> IndexerFormat:
        """How the pool keeps V3.2's indexer keys on ``device_type`` (dsinfer/base/kv_spec.py)."""
        if self.indexer_cache_dtype == "auto":
            return "fp8" if device_type == "cuda" else "model"
        return "fp8" if self.indexer_cache_dtype == "fp8" else "model"

    def check_expert_parallel(self, draft_differs: bool) -> None:
        """What an expert-parallel pool refuses, before the model loads (``draft_differs``: the MTP
        layer would run in a dtype other than the model's)."""
        if self.speculative_num_steps > 1:
            raise ValueError(
                "speculative_num_steps > 1 is not supported in an expert-parallel pool (each chained "
                "draft would be one more collective MTP forward on every rank): use 1"
            )
        if draft_differs:
            raise ValueError(
                "speculative_draft_dtype other than the model's is not supported in an expert-parallel "
                "pool (its MTP layer's experts move between ranks in the model's dtype): use auto"
            )

    def decode_tokens_per_step(self) -> int:
        """The most tokens one rank's decode step carries: a token per sequence, two with an MTP
        draft, within the step's token budget (sizes DeepEP's low-latency buffer; steps with more
        tokens, such as a decode pool's recompute prefill, take the torch all-to-all)."""
        return min(self.max_num_seqs * (1 + self.num_drafts), self.max_num_batched_tokens)

    @property
    def num_drafts(self) -> int:
        """Draft tokens a sequence carries into a step: 0 without MTP."""
        return self.speculative_num_steps if self.speculative_mtp else 0

    def host_tier_bytes(self, host_free: int) -> tuple[int, str]:
        """Bytes of the host-memory tier and how they were chosen: ``kv_host_cache_size``, else
        HOST_TIER_FRACTION of the host's free memory at start-up (taken only as pages are evicted
        into it); 0 without a prefix cache."""
        if not self.enable_prefix_caching:
            return 0, "no prefix cache"
        if self.kv_host_cache_size is not None:
            return self.kv_host_cache_size, "--kv-host-cache-size"
        budget = int(max(host_free, 0) * HOST_TIER_FRACTION)
        return budget, f"{HOST_TIER_FRACTION:g} of free host memory ({host_free / 2**30:.1f} GiB at start-up)"

    def kv_fraction_for(self, device_type: str) -> float:
        """Fraction of free memory the latent KV cache may take when no size is given: 0.8 on a
        GPU (headroom for activations and the decode step's CUDA graphs, captured after the pool),
        0.02 on a CPU (a cap: there the pool is sized to what the sequences need, see
        :meth:`default_kv_budget`; the machine's memory stays for everything else)."""
        if self.kv_cache_memory_fraction is not None:
            return self.kv_cache_memory_fraction
        return 0.8 if device_type == "cuda" else 0.02

    def default_kv_budget(
        self, *, page_bytes: int, page_size: int, max_model_len: int, free: int, device_type: str
    ) -> tuple[int, str]:
        """Bytes of the KV pool when ``kv_cache_memory`` is not given, and how they were chosen.
        On a CPU: what ``max_num_seqs`` sequences of ``max_model_len`` tokens need (whole pages of
        ``page_bytes``), capped at ``kv_fraction_for`` of ``free`` memory. On a GPU: that fraction
        of free memory (the pool is the prefix cache too; the memory is the GPU's anyway)."""
        fraction = self.kv_fraction_for(device_type)
        cap = int(max(free, 0) * fraction)
        cap_note = f"{fraction:g} of free memory ({free / 2**30:.1f} GiB free at start-up)"
        if device_type == "cuda":
            return cap, cap_note
        need = self.max_num_seqs * -(-max_model_len // page_size) * page_bytes
        sequences = f"--max-num-seqs {self.max_num_seqs} x --max-model-len {max_model_len}"
        if need <= cap:
            return need, f"{sequences} (capped at {cap_note})"
        return cap, f"{cap_note}: less than {sequences} need ({need / 2**30:.2f} GiB)"

    @field_validator("kv_cache_memory", "kv_disk_cache_size", "kv_host_cache_size", mode="before")
    @classmethod
    def _size(cls, value: int | str | None) -> int | None:
        return None if value is None else parse_size(value)

    @model_validator(mode="after")
    def _check(self) -> EngineArgs:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}"
            )
        if self.indexer_cache_dtype not in INDEXER_CACHE_DTYPES:
            raise ValueError(
                f"indexer_cache_dtype must be one of {', '.join(INDEXER_CACHE_DTYPES)}, got {self.indexer_cache_dtype!r}"
            )
        parse_prefer(self.kernel_backends)  # an unknown name: ValueError listing the known ones
        for name in ("dtype", "speculative_draft_dtype"):
            if getattr(self, name) not in ("auto", "float32", "bfloat16", "float16"):
                raise ValueError(
                    f"{name} must be auto, float32, bfloat16 or float16, got {getattr(self, name)!r}"
                )
        if self.speculative_draft_dtype != "auto" and not self.speculative_mtp:
            raise ValueError("speculative_draft_dtype sets the MTP layer's dtype: add --speculative-mtp")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be positive")
        if self.eplb_interval < 0 or self.eplb_min_gain < 0 or self.eplb_stage_budget < 0:
            raise ValueError("eplb_interval, eplb_min_gain and eplb_stage_budget must be >= 0")
        if self.num_redundant_experts < 0:
            raise ValueError("num_redundant_experts must be >= 0")
        if self.overlap_min_tokens < 0:
            raise ValueError("overlap_min_tokens must be >= 0")
        if self.trace_flush_steps < 1:
            raise ValueError("trace_flush_steps must be at least 1")
        if self.prefill_attention_weight is not None and self.prefill_attention_weight <= 0:
            raise ValueError("prefill_attention_weight must be positive")
        if self.prefill_context_weight < 0:
            raise ValueError("prefill_context_weight must be >= 0")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError("cuda_graph_max_bs must be at least 1")
        if self.placement is not None and not self.placement.is_file():
            raise ValueError(f"placement {str(self.placement)!r} is not a file")
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1]")
        if self.speculative_num_steps < 1:
            raise ValueError("speculative_num_steps must be at least 1")
        if self.speculative_num_steps > 1 and not self.speculative_mtp:
            raise ValueError("speculative_num_steps > 1 drafts with the MTP layer: add --speculative-mtp")
        self._check_steps_by_batch()
        if self.ep_backend not in EP_BACKENDS:
            raise ValueError(f"ep_backend must be one of {', '.join(EP_BACKENDS)}, got {self.ep_backend!r}")
        return self
