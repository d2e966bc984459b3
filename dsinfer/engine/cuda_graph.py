"""CUDA graphs of the decode step, one per batch-size bucket, so that decode is not launch-bound.

What is captured: the whole decode-only forward (embedding, every decoder layer, final norm) and
the logits of every row, for ``B`` sequences of one new token each, through the graph-safe paths:
MLA's absorbed path with ``cache_seqlens`` read from a device buffer (V3.2: the indexer's logits
over the static block table, a top-k as wide as the table, sparse MLA over the picked slots; no
host read either), and the routed experts in the masked layout (``ForwardBatch.masked_moe``: device-side per-expert counts and ranks,
``grouped_gemm_masked``). Sampling, logprobs and the MTP layer stay outside, eager.

Static buffers (allocated once, for the largest bucket): per row the input id, position, cache
slot, cached length and a valid flag (one int64 ``[5, max_bs]`` tensor, one host-to-device copy per
step) and the block table ``[max_bs, pages of max_seq_len]``. Each step's values are staged in host
buffers of the same shapes, pinned on CUDA so that both copies are asynchronous; the next step
waits on an event of the last copies before it overwrites the staging buffers. A step of ``n``
sequences is padded to the smallest bucket ``>= n``: padding rows read token 0 at position 0, write
their latent (and indexer key) to the pool's dummy page (``PagedKVPool.reserve_dummy_page``:
reserved for good, owned by no sequence)
and attend to it alone; they are masked out of the experts and of the expert-load counters. The
graph replays and the first ``n`` rows of its output are returned (views of the static outputs,
valid until the next replay).

Buckets: 1, 2, 4, 8, then every multiple of 8 up to 256 and of 16 beyond, up to ``max_batch_size``
(which is always one). Graphs are captured largest first into one shared memory pool.

What stays eager, and why:

- prefill and mixed steps (their shapes vary with the prompts; the decompressed MLA path and the
  contiguous expert layout read lengths and counts on the host);
- MTP verification steps (two query tokens per sequence) and the MTP draft layer: they could be
  captured the same way with ``s_q = 2`` buckets, not done yet;
- steps with a per-layer callback (``after_layer``, the PD prefill side's KV push);
- expert parallelism: today's EP dispatch (pair rows over ``EPGroup.dispatch``: TorchEPGroup's
  all-to-all over gloo/NCCL, DeepEPGroup's pair-level path) reads row counts on the host, so an EP
  model never captures. DeepEP's low-latency dispatch delivers exactly the masked layout
  ``Experts.compute_masked`` consumes; once the MoE calls it at token level, EP decode can be
  captured too.

``capture=False`` runs the very same padded static-buffer callable eagerly (no
``torch.cuda.CUDAGraph``): how CPU tests hold this path. Graphs hold the addresses of weights and
caches: anything that replaces a parameter tensor (the EPLB applier, EP only) needs a recapture.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass

import torch
from tqdm import tqdm

from dsinfer.cache.kv_pool import PagedKVPool
from dsinfer.model.batch import ForwardBatch
from dsinfer.model.deepseek_v3 import DeepseekV3ForCausalLM

log = logging.getLogger("dsinfer.engine")

__all__ = ["CudaGraphRunner", "DecodeRows", "graph_batch_sizes", "graph_unsupported_reason"]

WARMUP_RUNS = 2  # eager runs per bucket before its capture (Triton compiles, cuBLAS workspaces)
_IDS, _POS, _SLOT, _LEN, _VALID = range(5)  # rows of the static per-row buffer


def graph_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, multiples of 8 up to 256, of 16 beyond; capped at (and ending with) max_batch_size."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = [1, 2, 4, 8, *range(16, 257, 8), *range(272, max_batch_size + 1, 16)]
    return tuple(sorted({s for s in sizes if s < max_batch_size} | {max_batch_size}))


def graph_unsupported_reason(model: DeepseekV3ForCausalLM) -> str | None:
    """Why this model's decode step cannot be captured, or None when it can."""
    if model.ep is not None:
        return (
            "expert parallelism: the EP dispatch (pair rows over the torch all-to-all or DeepEP's "
            "pair-level path) reads row counts on the host; decode steps run eagerly"
        )
    return None


@dataclass(frozen=True)
class DecodeRows:
    """One decode-only step, one row per sequence: the token it feeds, at which position, and the
    sequence's pages (its block table row; the token's slot is derived from them)."""

    input_ids: list[int]
    positions: list[int]
    page_lists: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.input_ids) == len(self.positions) == len(self.page_lists):
            raise ValueError("input_ids, positions and page_lists need one entry per sequence")

    def __len__(self) -> int:
        return len(self.input_ids)


class CudaGraphRunner:
    """Decode steps of up to ``max_batch_size`` sequences over static buffers, replayed from CUDA
    graphs (``capture=True``, CUDA only) or run eagerly through the same callable (``capture=False``)."""

    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        pool: PagedKVPool,
        *,
        max_batch_size: int,
        max_seq_len: int,
        capture: bool = True,
        batch_sizes: tuple[int, ...] | None = None,
    ) -> None:
        reason = graph_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"cannot run the decode step as a graph: {reason}")
        self.device = pool.device
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the KV pool is on {self.device}")
        self.model, self.pool, self.capture = model, pool, capture
        self.batch_sizes = batch_sizes or graph_batch_sizes(max_batch_size)
        self.max_batch_size = max(self.batch_sizes)
        self.page_size = pool.page_size
        self.max_pages = math.ceil(max_seq_len / self.page_size)
        self.dummy_page = pool.reserve_dummy_page()
        with torch.inference_mode():
            self._rows = torch.zeros(5, self.max_batch_size, dtype=torch.int64, device=self.device)
            self._tables = torch.full(
                (self.max_batch_size, self.max_pages), self.dummy_page, dtype=torch.int32, device=self.device
            )
        pinned = self.device.type == "cuda"
        self._rows_host = torch.zeros(5, self.max_batch_size, dtype=torch.int64, pin_memory=pinned)
        self._tables_host = torch.zeros(
            self.max_batch_size, self.max_pages, dtype=torch.int32, pin_memory=pinned
        )
        self._copied = torch.cuda.Event() if pinned else None  # the last step's copies have run
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.steps: Counter[int] = Counter()  # bucket -> steps run
        self.padding_rows = 0  # rows added to fill buckets, over all steps
        if capture:
            self._capture_all()

    # Per step ------------------------------------------------------------------------------------
    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket holding ``num_seqs`` rows, None when none does."""
        return next((b for b in self.batch_sizes if b >= num_seqs), None) if num_seqs > 0 else None

    def fits(self, rows: DecodeRows) -> bool:
        return self.bucket_for(len(rows)) is not None and all(
            len(pages) <= self.max_pages for pages in rows.page_lists
        )

    @torch.inference_mode()
    def run(self, rows: DecodeRows) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (final-normed hidden [n, H], logits fp32 [n, V]) of the step's ``n`` sequences; the
        latents of their tokens are written to the pool. Views of static outputs: read them before
        the next ``run``."""
        bucket = self.bucket_for(len(rows))
        if bucket is None or not self.fits(rows):
            raise ValueError(
                f"{len(rows)} sequences (longest {max(map(len, rows.page_lists), default=0)} pages) do not "
                f"fit the captured buckets (up to {self.max_batch_size} rows of {self.max_pages} pages)"
            )
        self._load(rows, bucket)
        if self.capture:
            graph, (hidden, logits) = self._graphs[bucket]
            graph.replay()
        else:
            hidden, logits = self._forward(bucket)
        self.steps[bucket] += 1
        self.padding_rows += bucket - len(rows)
        n = len(rows)
        return hidden[:n], logits[:n]

    def _load(self, rows: DecodeRows, bucket: int) -> None:
        """Copy the step's rows into the static buffers; rows n..bucket-1 become padding."""
        n, pad, ps, dummy = len(rows), bucket - len(rows), self.page_size, self.dummy_page
        slots = [
            pages[p // ps] * ps + p % ps for pages, p in zip(rows.page_lists, rows.positions, strict=True)
        ]
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the staging buffers
        host = self._rows_host[:, :bucket]
        host.copy_(
            torch.tensor(
                [
                    rows.input_ids + [0] * pad,
                    rows.positions + [0] * pad,
                    slots + [dummy * ps] * pad,
                    [p + 1 for p in rows.positions] + [1] * pad,  # cached tokens after this step
                    [1] * n + [0] * pad,
                ],
                dtype=torch.int64,
            )
        )
        self._rows[:, :bucket].copy_(host, non_blocking=True)
        width = max((len(pages) for pages in rows.page_lists), default=1)
        table = [pages + [dummy] * (width - len(pages)) for pages in rows.page_lists]
        table += [[dummy] * width] * pad
        tables = self._tables_host[:bucket, :width]
        tables.copy_(torch.tensor(table, dtype=torch.int32))
        self._tables[:bucket, :width].copy_(tables, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _forward(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured callable: the model over the first ``bucket`` rows of the static buffers."""
        rows = self._rows[:, :bucket]
        batch = ForwardBatch(
            positions=rows[_POS],
            slot_mapping=rows[_SLOT],
            block_tables=self._tables[:bucket],
            q_lens=[1] * bucket,
            kv_lens=[1] * bucket,  # placeholders: cache_seqlens (on the device) holds the lengths
            num_absorbed=bucket,
            cache_seqlens=rows[_LEN].to(torch.int32),
            token_mask=rows[_VALID] != 0,
            masked_moe=True,
        )
        hidden = self.model(rows[_IDS], batch, self.pool.caches)
        return hidden, self.model.compute_logits(hidden)

    # Capture -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.monotonic()
        memory_pool = torch.cuda.graph_pool_handle()
        empty = DecodeRows([], [], [])
        side = torch.cuda.Stream(self.device)
        for bucket in tqdm(sorted(self.batch_sizes, reverse=True), desc="CUDA graphs", unit="graph"):
            self._load(empty, bucket)  # all padding: only the dummy page is written
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    self._forward(bucket)
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory_pool):
                outputs = self._forward(bucket)
            self._graphs[bucket] = (graph, outputs)
        torch.cuda.synchronize(self.device)
        log.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.1f s",
            len(self._graphs),
            ",".join(map(str, self.batch_sizes)),
            time.monotonic() - start,
        )
