"""The paged online-softmax core of the CPU MLA decode kernels (numba): one sequence's query
rows attend over its latent cache pages, read in place (``dsinfer.ops.mla_cpu`` runs it per
sequence or per block of query rows, in parallel).

A page is streamed once per block of four query rows, whose queries and accumulators stay in L1
while the page comes from L2 (keeping every row's accumulator live instead spilled past four rows,
2-3.5x slower). Scores and value rows go in 4x4 blocks, so every loaded query or cached value
feeds four FMAs. Math is fp32; a bf16 cache is read as its raw bits, widened as it is loaded.
"""

from __future__ import annotations

import numba
import numpy as np

from dsinfer.ops.bf16_cpu import as_float
from dsinfer.ops.dot_block_cpu import dot_block
from dsinfer.ops.exp_cpu import exp32

__all__ = ["KEY_TILE", "attend_sequence"]

_FASTMATH = {"reassoc", "contract", "nsz"}  # let LLVM vectorize dot products; keep inf semantics

KEY_TILE = 4  # keys whose scores (and value rows) are combined per pass over the channels


@numba.njit(cache=True, fastmath=_FASTMATH, inline="always")
def _scores_block(qb, kv, t, r, dim, scale, scores):
    """Scores of keys t..t+3 for query rows r..r+3: a 4x4 block of dot products."""
    dot_block(qb, kv, r, t, dim, scores)
    for i in range(4):
        for j in range(4):
            scores[r + i, t + j] *= scale


@numba.njit(cache=True, fastmath=_FASTMATH, inline="always")
def _dot(qb, kv, t, r, dim):
    dot = np.float32(0.0)
    for d in range(dim):
        dot += qb[r, d] * as_float(kv[t, d])
    return dot


@numba.njit(cache=True, fastmath=_FASTMATH, inline="always")
def _accumulate_block(acc, kv, scores, t, r, dv):
    """acc[r..r+3] += scores[r..r+3, t..t+3] @ kv[t..t+3, :dv], accumulated in registers per channel."""
    p00, p01, p02, p03 = scores[r, t], scores[r, t + 1], scores[r, t + 2], scores[r, t + 3]
    p10, p11, p12, p13 = scores[r + 1, t], scores[r + 1, t + 1], scores[r + 1, t + 2], scores[r + 1, t + 3]
    p20, p21, p22, p23 = scores[r + 2, t], scores[r + 2, t + 1], scores[r + 2, t + 2], scores[r + 2, t + 3]
    p30, p31, p32, p33 = scores[r + 3, t], scores[r + 3, t + 1], scores[r + 3, t + 2], scores[r + 3, t + 3]
    for d in range(dv):
        k0, k1, k2, k3 = (
            as_float(kv[t, d]),
            as_float(kv[t + 1, d]),
            as_float(kv[t + 2, d]),
            as_float(kv[t + 3, d]),
        )
        acc[r, d] += p00 * k0 + p01 * k1 + p02 * k2 + p03 * k3
        acc[r + 1, d] += p10 * k0 + p11 * k1 + p12 * k2 + p13 * k3
        acc[r + 2, d] += p20 * k0 + p21 * k1 + p22 * k2 + p23 * k3
        acc[r + 3, d] += p30 * k0 + p31 * k1 + p32 * k2 + p33 * k3


@numba.njit(cache=True, fastmath=_FASTMATH)  # not inlined: halves the compile, same code
def _attend_page(qb, kv, count, start, n, s_q, h_q, dv, scale, causal, m, denom, acc, scores, row0):
    """Online-softmax update of every query row with keys start..start+count-1 held in kv.
    ``kv`` has at least ``count`` rounded up to KEY_TILE rows and the rows past ``count`` are finite
    (their probabilities are zero). Query rows and keys go in 4x4 blocks (a loaded value feeds four
    FMAs), the page once per block of rows; leftover query rows one at a time. ``qb``'s row r is
    the sequence's query row ``row0 + r`` (token ``(row0 + r) // h_q``, for the causal mask)."""
    rows, dim = qb.shape
    blocked = rows - rows % 4
    padded = -(-count // KEY_TILE) * KEY_TILE
    for r in range(0, blocked, 4):
        for t in range(0, padded, KEY_TILE):
            _scores_block(qb, kv, t, r, dim, scale, scores)
    for r in range(blocked, rows):
        for t in range(0, padded, KEY_TILE):
            for j in range(KEY_TILE):
                scores[r, t + j] = _dot(qb, kv, t + j, r, dim) * scale
    for r in range(rows):
        seen = n - s_q + (row0 + r) // h_q + 1 if causal else n  # keys this row attends to
        visible = min(count, seen - start)  # keys [start, start + visible)
        if visible <= 0:
            for t in range(padded):
                scores[r, t] = 0.0
            continue
        new_max = max(m[r], scores[r, :visible].max())
        correction = np.exp(m[r] - new_max)
        denom[r] *= correction
        for d in range(dv):
            acc[r, d] *= correction
        total = np.float32(0.0)
        for t in range(visible):
            scores[r, t] = exp32(scores[r, t] - new_max)
            total += scores[r, t]
        scores[r, visible:padded] = 0.0
        denom[r] += total
        m[r] = new_max
    for r in range(0, blocked, 4):
        for t in range(0, padded, KEY_TILE):
            _accumulate_block(acc, kv, scores, t, r, dv)
    for t in range(0, padded, KEY_TILE):
        for r in range(blocked, rows):
            for j in range(KEY_TILE):
                p = scores[r, t + j]
                for d in range(dv):
                    acc[r, d] += p * as_float(kv[t + j, d])


@numba.njit(cache=True, fastmath=_FASTMATH)  # not inlined: both entry kernels share it
def attend_sequence(qb, cache, bf16_bits, table, b, n, s_q, h_q, dv, scale, causal, m, denom, acc, row0):
    """Online softmax of ``qb``'s rows (sequence ``b``'s queries) over its ``n`` cached keys into
    ``m``, ``denom`` and ``acc``. ``cache`` is float32 [P, page, D] (``bf16_bits`` unused) or, when
    ``cache`` has no rows, ``bf16_bits`` holds the cache as uint16 (bf16, widened as it is read).
    ``qb`` holds the sequence's query rows from ``row0`` on. A page's keys are read in place in
    whole tiles of KEY_TILE; the last page's few keys past its last whole tile go through a
    zero-padded scratch tile, so that slots past the sequence's length are never read."""
    rows, dim = qb.shape
    bf16 = bf16_bits.shape[0] > 0
    page_size = bf16_bits.shape[1] if bf16 else cache.shape[1]
    scores = np.empty((rows, -(-page_size // KEY_TILE) * KEY_TILE), dtype=np.float32)
    tile = np.zeros((KEY_TILE, dim), dtype=np.float32)
    tile_bits = tile.view(np.uint32)
    for start in range(0, n, page_size):
        count = min(page_size, n - start)
        block = table[b, start // page_size]
        whole = count - count % KEY_TILE
        tail = count - whole
        if whole > 0 and bf16:
            _attend_page(qb, bf16_bits[block], whole, start, n, s_q, h_q, dv, scale, causal, m, denom, acc, scores, row0)  # fmt: skip
        elif whole > 0:
            _attend_page(qb, cache[block], whole, start, n, s_q, h_q, dv, scale, causal, m, denom, acc, scores, row0)  # fmt: skip
        if tail == 0:
            continue
        for t in range(tail):
            for d in range(dim):
                if bf16:
                    tile_bits[t, d] = np.uint32(bf16_bits[block, whole + t, d]) << np.uint32(16)
                else:
                    tile[t, d] = cache[block, whole + t, d]
        tile[tail:] = 0.0
        _attend_page(qb, tile, tail, start + whole, n, s_q, h_q, dv, scale, causal, m, denom, acc, scores, row0)  # fmt: skip
