"""CUDA graphs of the MTP draft layer, replayed right after a verification step replayed from the
decode graphs (dsinfer/engine/cuda_graph.py), one per batch-size bucket and verification width.

A verification step feeds each sequence ``W = 1 + k`` tokens, its last one and ``k`` drafts. The
draft layer then runs over the positions the step made valid: the last token's, and the drafts'
up to the first rejected one. Eagerly (dsinfer/engine/mtp.py) those are 1 to ``W`` rows per
sequence; here every sequence has ``W`` rows, and the rows past its valid ones are padding rows:
their latents go to the pool's dummy page and nothing reads them. Each sequence's last valid row
(``W i + valid - 1``, a device index) is the one attention and the FFN run for, over the absorbed
path with the sequence's cached length after the step from a device buffer: no host read in the
graph.

With ``k`` > 1 each further draft runs the layer again over one row per sequence (a chained
draft: the last draft and the layer's own normed output). Those runs replay from chain graphs,
one per bucket: the sequences' block tables are loaded again (the drafting sequences may be a
subset of the step's, and their drafts lie past the step's tokens), the normed states are copied
into a static input, and the graph returns the layer's normed output and the draft logits.

The graph reads the verification graph's hidden states where they lie (its static output of the
same bucket); it shares that runner's block tables, already loaded for the step's sequences, and
its memory pool. Logits and sampling of the drafts stay outside, as for the decode graphs.
``capture=False`` runs the same callable eagerly (the CPU tests).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

import torch

from dsinfer.engine.cuda_graph import CudaGraphRunner, capture
from dsinfer.model.batch import ForwardBatch

log = logging.getLogger("dsinfer.engine")

__all__ = ["DraftGraphs", "DraftRows"]

_IDS, _POS, _SLOT, _VALID, _LEN, _LAST = range(6)  # per row, per row, per row, per row, per seq, per seq


@dataclass(frozen=True)
class DraftRows:
    """The draft layer's step, ``width`` rows per sequence (the verification's tokens per
    sequence): the tokens after its last token and after each draft (those past the valid rows
    ignored), the last token's position, how many of the ``width`` positions are valid (1 plus the
    drafts accepted), and the sequence's pages."""

    next_tokens: list[int]
    positions: list[int]
    valid: list[int]
    page_lists: list[list[int]]
    width: int = 2

    def __post_init__(self) -> None:
        n = len(self.positions)
        if len(self.valid) != n or len(self.page_lists) != n or len(self.next_tokens) != self.width * n:
            raise ValueError(
                f"valid, positions and page_lists need one entry per sequence, next_tokens {self.width}"
            )
        if any(not 1 <= v <= self.width for v in self.valid):
            raise ValueError(f"a sequence has 1 to {self.width} valid positions, got {self.valid}")

    def __len__(self) -> int:
        return len(self.positions)


class DraftGraphs:
    def __init__(self, decode: CudaGraphRunner, *, capture: bool = True, chained: bool = False) -> None:
        """Graphs of the draft layer after each multi-token width of ``decode``; ``chained``: also
        the chain graphs of further drafts (``run_chain``)."""
        self.widths = tuple(q for q in decode.tokens_per_seq if q > 1)
        if not self.widths:
            raise ValueError("the draft layer's graphs follow multi-token verification graphs")
        self.decode, self.model, self.capture = decode, decode.model, capture
        self.device = decode.device
        rows = max(self.widths) * decode.max_batch_size
        cuda = self.device.type == "cuda"
        embed = self.model.model.embed_tokens.weight  # the activations' dtype
        with torch.inference_mode():
            self._rows = torch.zeros(6, rows, dtype=torch.int64, device=self.device)
            self._chain_in = (
                torch.zeros(decode.max_batch_size, embed.shape[1], dtype=embed.dtype, device=self.device)
                if chained
                else None
            )
        self._rows_host = torch.zeros(6, rows, dtype=torch.int64, pin_memory=cuda)
        self._copied = torch.cuda.Event() if cuda else None
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._chains: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.steps: Counter[int] = Counter()  # bucket -> draft steps run
        self.chain_steps: Counter[int] = Counter()  # bucket -> chained drafts run
        if capture:
            self._capture_all()

    @property
    def chained(self) -> bool:
        return self._chain_in is not None

    @torch.inference_mode()
    def run(self, rows: DraftRows) -> torch.Tensor:
        """-> the draft layer's hidden states [n, H] at each sequence's last valid position; every
        valid position's latent is written to the MTP layer's cache. Call it right after the
        decode runner's ``run`` of the same sequences' verification, ``rows.width`` tokens each
        (whose hidden states it reads)."""
        bucket, width = self.decode.bucket_for(len(rows)), rows.width
        last = self.decode.last_run
        if bucket is None or last is None or last[:2] != (bucket, width):
            raise ValueError(
                f"no verification of {len(rows)} sequences of {width} tokens was just run from the graphs"
            )
        self._load(rows, bucket)
        if self.capture:
            graph, out = self._graphs[bucket, width]
            graph.replay()
        else:
            out = self._forward(bucket, width, last[2])
        self.steps[bucket] += 1
        return out[: len(rows)]

    def fits_chain(self, page_lists: list[list[int]]) -> bool:
        return (
            self.chained
            and self.decode.bucket_for(len(page_lists)) is not None
            and all(len(pages) <= self.decode.max_pages for pages in page_lists)
        )

    @torch.inference_mode()
    def run_chain(
        self, tokens: list[int], positions: list[int], page_lists: list[list[int]], normed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A chained draft: the draft layer at ``positions`` (each sequence's last draft, ``tokens``)
        over the layer's last ``normed`` output [n, H] -> (its normed output [n, H], draft logits fp32
        [n, V]), views of static outputs: read them before the next run. Its latents are written at
        those positions."""
        n = len(tokens)
        bucket = self.decode.bucket_for(n)
        if bucket is None or not self.fits_chain(page_lists) or self._chain_in is None:
            raise ValueError(f"{n} chained drafts do not fit the captured chain graphs")
        self.decode.load_tables(page_lists, bucket)
        ps, dummy = self.decode.page_size, self.decode.dummy_page * self.decode.page_size
        slots = [pages[p // ps] * ps + p % ps for p, pages in zip(positions, page_lists, strict=True)]
        pad = bucket - n
        self._stage(
            [tokens + [0] * pad, positions + [0] * pad, slots + [dummy] * pad,
             [1] * n + [0] * pad, [p + 1 for p in positions] + [1] * pad],
            bucket,
        )  # fmt: skip
        self._chain_in[:n].copy_(normed)
        if self.capture:
            graph, (out, logits) = self._chains[bucket]
            graph.replay()
        else:
            out, logits = self._chain_forward(bucket)
        self.chain_steps[bucket] += 1
        return out[:n], logits[:n]

    def _load(self, rows: DraftRows, bucket: int) -> None:
        n, pad, ps, width = len(rows), bucket - len(rows), self.decode.page_size, rows.width
        dummy = self.decode.dummy_page * ps
        positions, slots, valid = [], [], []
        for start, v, pages in zip(rows.positions, rows.valid, rows.page_lists, strict=True):
            for j in range(width):
                p = start + j
                positions.append(p)
                slots.append(pages[p // ps] * ps + p % ps if j < v else dummy + j)
                valid.append(int(j < v))
        lengths = [start + v for start, v in zip(rows.positions, rows.valid, strict=True)] + [1] * pad
        last = [width * i + v - 1 for i, v in enumerate(rows.valid)] + [width * i for i in range(n, bucket)]
        per_seq = [r + [0] * (width - 1) * bucket for r in (lengths, last)]  # in the first ``bucket`` entries
        self._stage(
            [
                rows.next_tokens + [0] * (width * pad),
                positions + list(range(width)) * pad,
                slots + [dummy + j for j in range(width)] * pad,
                valid + [0] * (width * pad),
                *per_seq,
            ],
            bucket * width,
        )

    def _stage(self, rows: list[list[int]], count: int) -> None:
        """Copy ``rows`` (each ``count`` long) into the first rows of the static buffer."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous run's copy has read the staging buffer
        host = self._rows_host[: len(rows), :count]
        host.copy_(torch.tensor(rows, dtype=torch.int64))
        self._rows[: len(rows), :count].copy_(host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _forward(self, bucket: int, width: int, hidden: torch.Tensor) -> torch.Tensor:
        """The captured callable: the draft layer over the static rows of ``bucket`` sequences,
        reading the verification's ``hidden`` [width * bucket, H]."""
        rows, tables = self._rows[:, : width * bucket], self.decode.block_tables(bucket)
        lengths = self._rows[_LEN, :bucket].to(torch.int32)
        last = self._rows[_LAST, :bucket]
        valid = rows[_VALID] != 0
        batch = ForwardBatch(
            positions=rows[_POS], slot_mapping=rows[_SLOT], block_tables=tables, q_lens=[width] * bucket,
            kv_lens=[width] * bucket, num_absorbed=bucket, cache_seqlens=lengths, token_mask=valid, masked_moe=True,
        )  # fmt: skip
        tail = ForwardBatch(
            positions=rows[_POS][last], slot_mapping=rows[_SLOT][last], block_tables=tables, q_lens=[1] * bucket,
            kv_lens=[1] * bucket, num_absorbed=bucket, cache_seqlens=lengths, token_mask=valid[last], masked_moe=True,
        )  # fmt: skip
        return self.model.forward_mtp(
            hidden, rows[_IDS], batch, self.decode.pool.caches, last_only=True, last=(last, tail)
        )

    def _chain_forward(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured callable of a chained draft: one row per sequence, every one a last row."""
        assert self._chain_in is not None
        rows = self._rows[:5, :bucket]
        batch = ForwardBatch(
            positions=rows[_POS], slot_mapping=rows[_SLOT], block_tables=self.decode.block_tables(bucket),
            q_lens=[1] * bucket, kv_lens=[1] * bucket, num_absorbed=bucket,
            cache_seqlens=rows[_LEN].to(torch.int32), token_mask=rows[_VALID] != 0, masked_moe=True,
        )  # fmt: skip
        out = self.model.forward_mtp(
            self._chain_in[:bucket], rows[_IDS], batch, self.decode.pool.caches, last_only=True
        )
        return self.model.mtp_head(out)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.monotonic()
        side = torch.cuda.Stream(self.device)
        for bucket in sorted(self.decode.batch_sizes, reverse=True):
            for width in self.widths:
                hidden = self.decode.static_hidden(bucket, width)
                self._load(DraftRows([], [], [], [], width), bucket)  # all padding: the dummy page only
                self._graphs[bucket, width] = capture(
                    lambda bucket=bucket, width=width, hidden=hidden: self._forward(bucket, width, hidden),
                    side,
                    self.decode.memory_pool,
                )
            if self.chained:
                self.decode.load_tables([], bucket)
                self._stage([[0] * bucket, [0] * bucket, [self.decode.dummy_page * self.decode.page_size] * bucket,
                             [0] * bucket, [1] * bucket], bucket)  # fmt: skip
                self._chains[bucket] = capture(
                    lambda bucket=bucket: self._chain_forward(bucket), side, self.decode.memory_pool
                )
        torch.cuda.synchronize(self.device)
        log.info(
            "captured %d MTP draft and %d chained-draft CUDA graphs in %.1f s",
            len(self._graphs),
            len(self._chains),
            time.monotonic() - start,
        )
