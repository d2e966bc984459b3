"""Fused MLA decode over the paged latent cache for CPUs (numba), with FlashMLA's semantics.

The torch reference gathers every sequence's pages into a padded batch and reads it twice; this
kernel reads the cached latent rows straight from their pages, with an online softmax across
pages. Every query head (and query token) shares the single latent KV head: a page is streamed
once per block of four query rows, whose queries and accumulators stay in L1 while the page comes
from L2 (keeping every row's accumulator live instead spilled past four rows, 2-3.5x slower).
Sequences run in parallel, and when they do not fill the threads (batch 1) the absorbed kernel
splits a sequence's query rows over tasks too, in whole blocks of four (the same bits). Math is
fp32; a bf16 cache is read as its raw bits.
Semantics are those of :func:`dsinfer.ops.mla.mla_decode` (bottom-right causal mask, natural-log
lse, an empty row gives out 0 and lse +inf); only slots below ``cache_seqlens`` are ever read.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from dsinfer.ops.bf16_cpu import as_float
from dsinfer.ops.compile_ahead import c_array
from dsinfer.ops.exp_cpu import exp32

__all__ = [
    "compile_ahead",
    "mla_decode",
    "mla_decode_absorbed",
    "mla_decode_absorbed_in_groups",
    "row_groups",
]

_FASTMATH = {"reassoc", "contract", "nsz"}  # let LLVM vectorize dot products; keep inf semantics


KEY_TILE = 4  # keys whose scores (and value rows) are combined per pass over the channels


@numba.njit(cache=True, fastmath=_FASTMATH, inline="always")
def _scores_block(qb, kv, t, r, dim, scale, scores):
    """Scores of keys t..t+3 for query rows r..r+3: a 4x4 block of dot products, so every loaded
    query or cached value feeds four FMAs."""
    s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = np.float32(0.0)
    s20 = s21 = s22 = s23 = s30 = s31 = s32 = s33 = np.float32(0.0)
    for d in range(dim):
        k0, k1, k2, k3 = (
            as_float(kv[t, d]),
            as_float(kv[t + 1, d]),
            as_float(kv[t + 2, d]),
            as_float(kv[t + 3, d]),
        )
        q0, q1, q2, q3 = qb[r, d], qb[r + 1, d], qb[r + 2, d], qb[r + 3, d]
        s00 += q0 * k0
        s01 += q0 * k1
        s02 += q0 * k2
        s03 += q0 * k3
        s10 += q1 * k0
        s11 += q1 * k1
        s12 += q1 * k2
        s13 += q1 * k3
        s20 += q2 * k0
        s21 += q2 * k1
        s22 += q2 * k2
        s23 += q2 * k3
        s30 += q3 * k0
        s31 += q3 * k1
        s32 += q3 * k2
        s33 += q3 * k3
    scores[r, t], scores[r, t + 1], scores[r, t + 2], scores[r, t + 3] = s00, s01, s02, s03
    scores[r + 1, t], scores[r + 1, t + 1], scores[r + 1, t + 2], scores[r + 1, t + 3] = s10, s11, s12, s13
    scores[r + 2, t], scores[r + 2, t + 1], scores[r + 2, t + 2], scores[r + 2, t + 3] = s20, s21, s22, s23
    scores[r + 3, t], scores[r + 3, t + 1], scores[r + 3, t + 2], scores[r + 3, t + 3] = s30, s31, s32, s33
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
def _attend_sequence(qb, cache, bf16_bits, table, b, n, s_q, h_q, dv, scale, causal, m, denom, acc, row0):
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


@numba.njit(parallel=True, cache=True, fastmath=_FASTMATH, nogil=True)
def _decode(q, cache, bf16_bits, table, lens, dv, scale, causal, out, lse):  # numpy arrays, typed by numba
    """:func:`mla_decode`'s kernel: sequences in parallel (the cache as ``_attend_sequence`` reads it)."""
    bsz, s_q, h_q, dim = q.shape
    rows = s_q * h_q
    for b in numba.prange(bsz):
        m = np.full(rows, -np.inf, dtype=np.float32)
        denom = np.zeros(rows, dtype=np.float32)
        acc = np.zeros((rows, dv), dtype=np.float32)
        _attend_sequence(
            q[b].reshape(rows, dim),
            cache,
            bf16_bits,
            table,
            b,
            lens[b],
            s_q,
            h_q,
            dv,
            scale,
            causal,
            m,
            denom,
            acc,
            0,
        )
        for r in range(rows):
            s, h = r // h_q, r % h_q
            if denom[r] == 0.0:
                out[b, s, h, :] = 0.0
                lse[b, h, s] = np.inf
            else:
                for d in range(dv):
                    out[b, s, h, d] = acc[r, d] / denom[r]
                lse[b, h, s] = m[r] + np.log(denom[r])


@numba.njit(cache=True, fastmath=_FASTMATH, inline="always")
def _fold_in(x, w, out):
    """out[:n] += x @ w for x [k], w [k, n] (float32 or bf16 bits): four rows of w per pass over out."""
    k_dim, n = w.shape
    blocked = k_dim - k_dim % 4
    for k in range(0, blocked, 4):
        x0, x1, x2, x3 = x[k], x[k + 1], x[k + 2], x[k + 3]
        for c in range(n):
            out[c] += (
                x0 * as_float(w[k, c])
                + x1 * as_float(w[k + 1, c])
                + x2 * as_float(w[k + 2, c])
                + x3 * as_float(w[k + 3, c])
            )
    for k in range(blocked, k_dim):
        for c in range(n):
            out[c] += x[k] * as_float(w[k, c])


@numba.njit(cache=True, fastmath=_FASTMATH, inline="always")
def _unfold(x, w, out):
    """out[c] = x . w[c] for x [k], w [n, k] (float32 or bf16 bits): four output channels per pass
    over x, their sums in registers (a latent row of 512 unfolds into a few dozen channels: adding
    into ``out`` row by row of w^T chained every step through memory, 1.5-2.6x slower)."""
    n, k_dim = w.shape
    blocked = n - n % 4
    for c in range(0, blocked, 4):
        s0 = s1 = s2 = s3 = np.float32(0.0)
        for k in range(k_dim):
            xk = x[k]
            s0 += xk * as_float(w[c, k])
            s1 += xk * as_float(w[c + 1, k])
            s2 += xk * as_float(w[c + 2, k])
            s3 += xk * as_float(w[c + 3, k])
        out[c], out[c + 1], out[c + 2], out[c + 3] = s0, s1, s2, s3
    for c in range(blocked, n):
        total = np.float32(0.0)
        for k in range(k_dim):
            total += x[k] * as_float(w[c, k])
        out[c] = total


@numba.njit(parallel=True, cache=True, fastmath=_FASTMATH, nogil=True)
def _decode_absorbed(q_nope, q_pe, w_uk, w_uv, cache, bf16_bits, table, lens, scale, causal, groups, out):
    """:func:`mla_decode_absorbed`'s kernel: each query row is folded into the latent
    (``q_nope . w_uk``, fp32; ``w_uk`` [H, nope, C] and ``w_uv`` [H, v, C] float32 or bf16 bits),
    attends over the cache as ``_decode`` does, and its latent output is unfolded by ``w_uv``
    (``out[v] = o . w_uv[h, v]``). A sequence's rows go to
    ``groups`` tasks, in whole blocks of four (the tasks run in parallel; each streams the
    sequence's pages once), so a row's arithmetic is the same for any ``groups``."""
    bsz, s_q, h_q = q_nope.shape[0], q_nope.shape[1], q_nope.shape[2]
    rope, latent = q_pe.shape[3], w_uk.shape[2]
    rows = s_q * h_q
    blocks = (rows + 3) // 4
    blocks_per_group = (blocks + groups - 1) // groups
    for task in numba.prange(bsz * groups):
        b, g = task // groups, task % groups
        row0 = min(rows, g * blocks_per_group * 4)
        count = min(rows, (g + 1) * blocks_per_group * 4) - row0
        if count <= 0:
            continue
        qb = np.zeros((count, latent + rope), dtype=np.float32)
        for i in range(count):
            s, h = (row0 + i) // h_q, (row0 + i) % h_q
            _fold_in(q_nope[b, s, h], w_uk[h], qb[i])
            for c in range(rope):
                qb[i, latent + c] = q_pe[b, s, h, c]
        m = np.full(count, -np.inf, dtype=np.float32)
        denom = np.zeros(count, dtype=np.float32)
        acc = np.zeros((count, latent), dtype=np.float32)
        _attend_sequence(
            qb, cache, bf16_bits, table, b, lens[b], s_q, h_q, latent, scale, causal, m, denom, acc, row0
        )
        for i in range(count):
            s, h = (row0 + i) // h_q, (row0 + i) % h_q
            if denom[i] == 0.0:
                out[b, s, h, :] = 0.0
                continue
            inverse = np.float32(1.0) / denom[i]
            for c in range(latent):
                acc[i, c] *= inverse
            _unfold(acc[i], w_uv[h], out[b, s, h])


# the one signature :func:`mla_decode` calls the kernel with, whatever the cache dtype
_DECODE_SIGNATURE = (
    c_array(numba.float32, 4),  # q
    c_array(numba.float32, 3),  # float32 cache (empty for bf16)
    c_array(numba.uint16, 3),  # bf16 cache bits (empty for float32)
    c_array(numba.int32, 2),  # block table
    c_array(numba.int32, 1),  # cache_seqlens
    numba.int64,  # head_dim_v
    numba.float32,  # softmax scale
    numba.boolean,  # causal
    c_array(numba.float32, 4),  # out
    c_array(numba.float32, 3),  # lse
)


def _absorbed_signature(weights: numba.types.Number) -> tuple[numba.types.Type, ...]:
    """What :func:`mla_decode_absorbed` calls its kernel with, for float32 or bf16 (bits) weights."""
    return (
        c_array(numba.float32, 4),  # q_nope
        c_array(numba.float32, 4),  # q_pe
        c_array(weights, 3),  # w_uk
        c_array(weights, 3),  # w_uv
        *_DECODE_SIGNATURE[1:5],  # the cache (float32 or bits), block table, cache_seqlens
        numba.float32,  # softmax scale
        numba.boolean,  # causal
        numba.int64,  # groups: tasks per sequence
        c_array(numba.float32, 4),  # out
    )


def compile_ahead() -> None:
    """Compile (or load from numba's cache) the kernels for the signatures every call uses."""
    _decode.compile(_DECODE_SIGNATURE)
    for weights in (numba.float32, numba.uint16):
        _decode_absorbed.compile(_absorbed_signature(weights))


def _cache_arrays(k_cache: torch.Tensor, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(float32 cache, bf16 cache bits) as the kernels take them: one of them empty."""
    if k_cache.shape[2] != 1 or k_cache.shape[3] != dim:
        raise ValueError(f"mla_decode expects k_cache [blocks, page, 1, {dim}], got {tuple(k_cache.shape)}")
    if k_cache.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"mla_decode on CPU takes a float32 or bfloat16 cache, got {k_cache.dtype}")
    cache = k_cache.reshape(k_cache.shape[0], k_cache.shape[1], dim)  # a view: numba sees C layout
    if k_cache.dtype == torch.bfloat16:
        return np.empty((0, 1, dim), dtype=np.float32), cache.view(torch.int16).numpy().view(np.uint16)
    return cache.numpy(), np.empty((0, 1, dim), dtype=np.uint16)


def _weight_array(w: torch.Tensor) -> np.ndarray:
    w = w.detach().contiguous()
    if w.dtype == torch.bfloat16:
        return w.view(torch.int16).numpy().view(np.uint16)
    return w.float().numpy()


def _use_torch_threads() -> int:
    """One thread budget: the kernels use as many threads as torch does in this process."""
    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(threads)
    return threads


def row_groups(bsz: int, rows: int, threads: int) -> int:
    """Tasks per sequence of the absorbed kernel: one when the sequences alone fill the threads,
    else enough whole blocks of four query rows (of ``rows`` per sequence) to fill them."""
    if bsz >= threads:
        return 1
    return max(1, min(-(-rows // 4), -(-threads // bsz)))


def mla_decode_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv_t: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float,
    causal: bool,
) -> torch.Tensor:
    """``MlaDecodeAbsorbed`` (dsinfer/ops/signatures.py) on CPU tensors, the folds fused (fp32).
    The kernel reads ``w_uv_t [H, C, v]`` as ``w_uv [H, v, C]``: no copy when ``w_uv_t`` is the
    transposed view of a contiguous ``w_uv`` (as the model keeps it), a copy per call otherwise."""
    return mla_decode_absorbed_in_groups(
        q_nope, q_pe, w_uk, w_uv_t, k_cache, block_table, cache_seqlens, softmax_scale, causal, None
    )


def mla_decode_absorbed_in_groups(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv_t: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    groups: int | None,
) -> torch.Tensor:
    """:func:`mla_decode_absorbed` with ``groups`` tasks per sequence (None: :func:`row_groups` of
    the thread budget); any value gives the same bits."""
    bsz, s_q, heads, _ = q_nope.shape
    latent = w_uk.shape[2]
    cache_np, bits_np = _cache_arrays(k_cache, latent + q_pe.shape[3])
    out = torch.empty(bsz, s_q, heads, w_uv_t.shape[2], dtype=torch.float32)
    threads = _use_torch_threads()
    groups = row_groups(bsz, s_q * heads, threads) if groups is None else groups
    _decode_absorbed(
        q_nope.detach().float().contiguous().numpy(),
        q_pe.detach().float().contiguous().numpy(),
        _weight_array(w_uk),
        _weight_array(w_uv_t.transpose(1, 2)),
        cache_np,
        bits_np,
        block_table.to(torch.int32).contiguous().numpy(),
        cache_seqlens.to(torch.int32).contiguous().numpy(),
        np.float32(softmax_scale),
        causal,
        groups,
        out.numpy(),
    )
    return out.to(q_nope.dtype)


def mla_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``MlaDecode`` (dsinfer/ops/signatures.py) on CPU tensors."""
    bsz, s_q, h_q, dim = q.shape
    cache_np, bits_np = _cache_arrays(k_cache, dim)
    if not 0 < head_dim_v <= dim:
        raise ValueError(f"head_dim_v must be in (0, {dim}], got {head_dim_v}")
    out = torch.empty(bsz, s_q, h_q, head_dim_v, dtype=torch.float32)
    lse = torch.empty(bsz, h_q, s_q, dtype=torch.float32)
    _use_torch_threads()
    _decode(
        q.detach().float().contiguous().numpy(),
        cache_np,
        bits_np,
        block_table.to(torch.int32).contiguous().numpy(),
        cache_seqlens.to(torch.int32).contiguous().numpy(),
        head_dim_v,
        np.float32(softmax_scale),
        causal,
        out.numpy(),
        lse.numpy(),
    )
    return out.to(q.dtype), lse
