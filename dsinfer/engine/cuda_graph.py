"""CUDA graphs of the decode step, one per batch-size bucket, so that decode is not launch-bound.

What is captured: the whole decode-only forward (embedding, every decoder layer, final norm) and
the logits of every row, for ``B`` sequences of ``q`` new tokens each (``q`` = 1; with MTP also 2:
the verification step, last token and draft), through the graph-safe paths:
MLA's absorbed path with ``cache_seqlens`` read from a device buffer (V3.2: the indexer's logits
over the static block table, a top-k as wide as the table, sparse MLA over the picked slots; no
host read either), and the routed experts in the masked layout (``ForwardBatch.masked_moe``: device-side per-expert counts and ranks,
``grouped_gemm_masked``). Sampling and logprobs stay outside, eager; the MTP draft layer after a
two-token verification replays from its own graphs (dsinfer/engine/draft_graph.py).

Static buffers (allocated once, for the largest bucket): per token row the input id, position,
cache slot and a valid flag, per sequence its cached length (one int64 ``[5, max_bs * max q]``
tensor, one host-to-device copy per step) and the block table ``[max_bs, pages of max_seq_len]``. Each step's values are staged in host
buffers of the same shapes, pinned on CUDA so that both copies are asynchronous; the next step
waits on an event of the last copies before it overwrites the staging buffers. A step of ``n``
sequences is padded to the smallest bucket ``>= n``: padding sequences read token 0 at positions
0..q-1, write their latents (and indexer keys) to the pool's dummy page (``PagedKVPool.reserve_dummy_page``:
reserved for good, owned by no sequence)
and attend to it alone; they are masked out of the experts and of the expert-load counters. The
graph replays and the first ``n`` rows of its output are returned (views of the static outputs,
valid until the next replay).

Buckets: 1, 2, 4, 8, then every multiple of 8 up to 256 and of 16 beyond, up to ``max_batch_size``
(which is always one), for each ``q`` of ``tokens_per_seq``. Graphs are captured largest first
into one shared memory pool.

What stays eager, and why:

- prefill and mixed steps (their shapes vary with the prompts; the decompressed MLA path and the
  contiguous expert layout read lengths and counts on the host);
- MTP verification steps where some sequences carry no draft (their query lengths differ), and
  the draft layer after them;
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from tqdm import tqdm

from dsinfer.cache.kv_pool import PagedKVPool
from dsinfer.model.batch import ForwardBatch
from dsinfer.model.deepseek_v3 import DeepseekV3ForCausalLM

log = logging.getLogger("dsinfer.engine")

__all__ = ["CudaGraphRunner", "DecodeRows", "capture", "graph_batch_sizes", "graph_unsupported_reason"]

WARMUP_RUNS = 2  # eager runs per bucket before its capture (Triton compiles, cuBLAS workspaces)
Outputs = TypeVar("Outputs")
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


def capture(
    forward: Callable[[], Outputs], side: torch.cuda.Stream, pool: tuple[int, int] | None
) -> tuple[torch.cuda.CUDAGraph, Outputs]:
    """``forward`` run ``WARMUP_RUNS`` times on the ``side`` stream, then captured into a graph in
    the shared memory ``pool``: (the graph, its static outputs)."""
    device = side.device
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARMUP_RUNS):
            forward()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = forward()
    return graph, outputs


@dataclass(frozen=True)
class DecodeRows:
    """One decode-only step of ``q_len`` new tokens per sequence: the tokens it feeds (sequence
    after sequence), the position of each sequence's first one, and its pages (its block table row;
    the tokens' slots are derived from them)."""

    input_ids: list[int]
    positions: list[int]
    page_lists: list[list[int]]
    q_len: int = 1

    def __post_init__(self) -> None:
        if not len(self.positions) == len(self.page_lists) or len(self.input_ids) != self.q_len * len(
            self.positions
        ):
            raise ValueError("positions and page_lists need one entry per sequence, input_ids q_len")

    def __len__(self) -> int:
        """Sequences."""
        return len(self.positions)


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
        tokens_per_seq: tuple[int, ...] = (1,),
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
        self.tokens_per_seq = tokens_per_seq
        rows = self.max_batch_size * max(tokens_per_seq)
        self.page_size = pool.page_size
        self.max_pages = math.ceil(max_seq_len / self.page_size)
        self.dummy_page = pool.reserve_dummy_page()
        with torch.inference_mode():
            self._rows = torch.zeros(5, rows, dtype=torch.int64, device=self.device)
            self._tables = torch.full(
                (self.max_batch_size, self.max_pages), self.dummy_page, dtype=torch.int32, device=self.device
            )
        pinned = self.device.type == "cuda"
        self._rows_host = torch.zeros(5, rows, dtype=torch.int64, pin_memory=pinned)
        self._tables_host = torch.zeros(
            self.max_batch_size, self.max_pages, dtype=torch.int32, pin_memory=pinned
        )
        self._copied = torch.cuda.Event() if pinned else None  # the last step's copies have run
        self._graphs: dict[
            tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]
        ] = {}
        self.steps: Counter[int] = Counter()  # bucket -> steps run
        self.steps_by_q: Counter[int] = Counter()  # new tokens per sequence -> steps run
        # the last step run: (bucket, tokens per sequence, its whole hidden output), which the MTP
        # draft layer's graphs (dsinfer/engine/draft_graph.py) read
        self.last_run: tuple[int, int, torch.Tensor] | None = None
        self.memory_pool = torch.cuda.graph_pool_handle() if capture else None
        self.padding_rows = 0  # rows added to fill buckets, over all steps
        if capture:
            self._capture_all()

    # Per step ------------------------------------------------------------------------------------
    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket holding ``num_seqs`` rows, None when none does."""
        return next((b for b in self.batch_sizes if b >= num_seqs), None) if num_seqs > 0 else None

    def fits(self, rows: DecodeRows) -> bool:
        return (
            rows.q_len in self.tokens_per_seq
            and self.bucket_for(len(rows)) is not None
            and all(len(pages) <= self.max_pages for pages in rows.page_lists)
        )

    @torch.inference_mode()
    def run(self, rows: DecodeRows) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (final-normed hidden [n * q, H], logits fp32 [n * q, V]) of the step's ``n`` sequences
        of ``q`` tokens; the latents of their tokens are written to the pool. Views of static
        outputs: read them before the next ``run``."""
        bucket = self.bucket_for(len(rows))
        if bucket is None or not self.fits(rows):
            raise ValueError(
                f"{len(rows)} sequences (longest {max(map(len, rows.page_lists), default=0)} pages) do not "
                f"fit the captured buckets (up to {self.max_batch_size} rows of {self.max_pages} pages, "
                f"{', '.join(map(str, self.tokens_per_seq))} tokens each; these have {rows.q_len})"
            )
        q = rows.q_len
        self._load(rows, bucket)
        if self.capture:
            graph, (hidden, logits) = self._graphs[bucket, q]
            graph.replay()
        else:
            hidden, logits = self._forward(bucket, q)
        self.last_run = (bucket, q, hidden)
        self.steps[bucket] += 1
        self.steps_by_q[q] += 1
        self.padding_rows += bucket - len(rows)
        n = len(rows) * q
        return hidden[:n], logits[:n]

    def block_tables(self, bucket: int) -> torch.Tensor:
        """The static block tables of the last step's ``bucket`` sequences."""
        return self._tables[:bucket]

    def static_hidden(self, bucket: int, q: int) -> torch.Tensor:
        """The captured graph's hidden output for ``bucket`` sequences of ``q`` tokens."""
        return self._graphs[bucket, q][1][0]

    def _load(self, rows: DecodeRows, bucket: int) -> None:
        """Copy the step's rows into the static buffers; sequences n..bucket-1 become padding."""
        n, q, pad, ps, dummy = len(rows), rows.q_len, bucket - len(rows), self.page_size, self.dummy_page
        positions = [start + j for start in rows.positions for j in range(q)] + list(range(q)) * pad
        pages = [p for p in rows.page_lists for _ in range(q)]
        slots = [pg[p // ps] * ps + p % ps for pg, p in zip(pages, positions, strict=False)]
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the staging buffers
        tokens = bucket * q
        lengths = [start + q for start in rows.positions] + [q] * pad  # cached tokens after this step
        host = self._rows_host[:, :tokens]
        host.copy_(
            torch.tensor(
                [
                    rows.input_ids + [0] * (pad * q),
                    positions,
                    slots + [dummy * ps + j for j in range(q)] * pad,
                    lengths + [0] * (tokens - bucket),  # per sequence, in the first ``bucket`` entries
                    [1] * (n * q) + [0] * (pad * q),
                ],
                dtype=torch.int64,
            )
        )
        self._rows[:, :tokens].copy_(host, non_blocking=True)
        self._copy_tables(rows.page_lists, bucket)
        if self._copied is not None:
            self._copied.record()

    def load_tables(self, page_lists: list[list[int]], bucket: int) -> None:
        """Load the block tables alone (the MTP layer's chained drafts, dsinfer/engine/draft_graph.py):
        rows 0..n-1 those pages, the rest of ``bucket`` the dummy page."""
        if self._copied is not None:
            self._copied.synchronize()
        self._copy_tables(page_lists, bucket)
        if self._copied is not None:
            self._copied.record()

    def _copy_tables(self, page_lists: list[list[int]], bucket: int) -> None:
        dummy = self.dummy_page
        width = max((len(pages) for pages in page_lists), default=1)
        table = [pages + [dummy] * (width - len(pages)) for pages in page_lists]
        table += [[dummy] * width] * (bucket - len(page_lists))
        tables = self._tables_host[:bucket, :width]
        tables.copy_(torch.tensor(table, dtype=torch.int32))
        self._tables[:bucket, :width].copy_(tables, non_blocking=True)

    def _forward(self, bucket: int, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured callable: the model over the first ``bucket`` sequences of the static buffers."""
        rows = self._rows[:, : bucket * q]
        batch = ForwardBatch(
            positions=rows[_POS],
            slot_mapping=rows[_SLOT],
            block_tables=self._tables[:bucket],
            q_lens=[q] * bucket,
            kv_lens=[q] * bucket,  # placeholders: cache_seqlens (on the device) holds the lengths
            num_absorbed=bucket,
            cache_seqlens=self._rows[_LEN, :bucket].to(torch.int32),
            token_mask=rows[_VALID] != 0,
            masked_moe=True,
        )
        hidden = self.model(rows[_IDS], batch, self.pool.caches)
        return hidden, self.model.compute_logits(hidden)

    # Capture -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.monotonic()
        side = torch.cuda.Stream(self.device)
        shapes = [(b, q) for b in sorted(self.batch_sizes, reverse=True) for q in self.tokens_per_seq]
        for bucket, q in tqdm(shapes, desc="CUDA graphs", unit="graph"):
            self._load(DecodeRows([], [], [], q), bucket)  # all padding: only the dummy page is written
            self._graphs[bucket, q] = capture(
                lambda bucket=bucket, q=q: self._forward(bucket, q), side, self.memory_pool
            )
        torch.cuda.synchronize(self.device)
        log.info(
            "captured %d decode CUDA graphs (batch sizes %s; %s tokens per sequence) in %.1f s",
            len(self._graphs),
            ",".join(map(str, self.batch_sizes)),
            ",".join(map(str, self.tokens_per_seq)),
            time.monotonic() - start,
        )
