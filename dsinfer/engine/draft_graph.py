"""CUDA graphs of the MTP draft layer, replayed right after a verification step replayed from the
decode graphs (dsinfer/engine/cuda_graph.py), one per batch-size bucket.

A verification step feeds each sequence two tokens, its last one and the draft. The draft layer
then runs over the positions the step made valid: the last token's, and the draft's when it was
accepted. Eagerly (dsinfer/engine/mtp.py) those are one or two rows per sequence; here every
sequence has two rows, and a rejected draft's row is a padding row: its latent goes to the pool's
dummy page and nothing reads it. Each sequence's last valid row (``2 i + valid - 1``, a device
index) is the one attention and the FFN run for, over the absorbed path with the sequence's
cached length after the step from a device buffer: no host read in the graph.

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
    """The draft layer's step, two rows per sequence: the tokens after its last token and after
    the draft (the second ignored when ``valid`` is 1), the last token's position, how many of the
    two positions are valid (1, or 2 when the draft was accepted), and the sequence's pages."""

    next_tokens: list[int]
    positions: list[int]
    valid: list[int]
    page_lists: list[list[int]]

    def __post_init__(self) -> None:
        n = len(self.positions)
        if len(self.valid) != n or len(self.page_lists) != n or len(self.next_tokens) != 2 * n:
            raise ValueError("valid, positions and page_lists need one entry per sequence, next_tokens two")
        if any(v not in (1, 2) for v in self.valid):
            raise ValueError(f"a sequence has 1 or 2 valid positions, got {self.valid}")

    def __len__(self) -> int:
        return len(self.positions)


class DraftGraphs:
    def __init__(self, decode: CudaGraphRunner, *, capture: bool = True) -> None:
        if 2 not in decode.tokens_per_seq:
            raise ValueError("the draft layer's graphs follow two-token verification graphs")
        self.decode, self.model, self.capture = decode, decode.model, capture
        self.device = decode.device
        rows = 2 * decode.max_batch_size
        with torch.inference_mode():
            self._rows = torch.zeros(6, rows, dtype=torch.int64, device=self.device)
        self._rows_host = torch.zeros(6, rows, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.steps: Counter[int] = Counter()  # bucket -> draft steps run
        if capture:
            self._capture_all()

    @torch.inference_mode()
    def run(self, rows: DraftRows) -> torch.Tensor:
        """-> the draft layer's hidden states [n, H] at each sequence's last valid position; every
        valid position's latent is written to the MTP layer's cache. Call it right after the
        decode runner's two-token ``run`` of the same sequences (whose hidden states it reads)."""
        bucket = self.decode.bucket_for(len(rows))
        last = self.decode.last_run
        if bucket is None or last is None or last[:2] != (bucket, 2):
            raise ValueError(
                f"no two-token verification of {len(rows)} sequences was just run from the graphs"
            )
        self._load(rows, bucket)
        if self.capture:
            graph, out = self._graphs[bucket]
            graph.replay()
        else:
            out = self._forward(bucket, last[2])
        self.steps[bucket] += 1
        return out[: len(rows)]

    def _load(self, rows: DraftRows, bucket: int) -> None:
        n, pad, ps = len(rows), bucket - len(rows), self.decode.page_size
        dummy = self.decode.dummy_page * ps
        positions, slots, valid = [], [], []
        for start, v, pages in zip(rows.positions, rows.valid, rows.page_lists, strict=True):
            for j in range(2):
                p = start + j
                positions.append(p)
                slots.append(pages[p // ps] * ps + p % ps if j < v else dummy + j)
                valid.append(int(j < v))
        if self._copied is not None:
            self._copied.synchronize()
        seq_rows = [[start + v for start, v in zip(rows.positions, rows.valid, strict=True)] + [1] * pad,
                    [2 * i + v - 1 for i, v in enumerate(rows.valid)] + [2 * i for i in range(n, bucket)]]  # fmt: skip
        host = self._rows_host[:, : 2 * bucket]
        host.copy_(
            torch.tensor(
                [
                    rows.next_tokens + [0] * (2 * pad),
                    positions + [0, 1] * pad,
                    slots + [dummy, dummy + 1] * pad,
                    valid + [0] * (2 * pad),
                    *(r + [0] * bucket for r in seq_rows),  # per sequence: the first ``bucket`` entries
                ],
                dtype=torch.int64,
            )
        )
        self._rows[:, : 2 * bucket].copy_(host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _forward(self, bucket: int, hidden: torch.Tensor) -> torch.Tensor:
        """The captured callable: the draft layer over the static rows of ``bucket`` sequences,
        reading the verification's ``hidden`` [2 * bucket, H]."""
        rows, tables = self._rows[:, : 2 * bucket], self.decode.block_tables(bucket)
        lengths = self._rows[_LEN, :bucket].to(torch.int32)
        last = self._rows[_LAST, :bucket]
        valid = rows[_VALID] != 0
        batch = ForwardBatch(
            positions=rows[_POS], slot_mapping=rows[_SLOT], block_tables=tables, q_lens=[2] * bucket,
            kv_lens=[2] * bucket, num_absorbed=bucket, cache_seqlens=lengths, token_mask=valid, masked_moe=True,
        )  # fmt: skip
        tail = ForwardBatch(
            positions=rows[_POS][last], slot_mapping=rows[_SLOT][last], block_tables=tables, q_lens=[1] * bucket,
            kv_lens=[1] * bucket, num_absorbed=bucket, cache_seqlens=lengths, token_mask=valid[last], masked_moe=True,
        )  # fmt: skip
        return self.model.forward_mtp(
            hidden, rows[_IDS], batch, self.decode.pool.caches, last_only=True, last=(last, tail)
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.monotonic()
        side = torch.cuda.Stream(self.device)
        for bucket in sorted(self.decode.batch_sizes, reverse=True):
            hidden = self.decode.static_hidden(bucket, 2)
            self._load(DraftRows([], [], [], []), bucket)  # all padding: only the dummy page is written
            self._graphs[bucket] = capture(
                lambda bucket=bucket, hidden=hidden: self._forward(bucket, hidden),
                side,
                self.decode.memory_pool,
            )
        torch.cuda.synchronize(self.device)
        log.info("captured %d MTP draft CUDA graphs in %.1f s", len(self._graphs), time.monotonic() - start)
