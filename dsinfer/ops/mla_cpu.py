"""Fused MLA decode over the paged latent cache for CPUs (numba), with FlashMLA's semantics.

The torch reference gathers every sequence's pages into a padded batch and reads it twice; this
kernel reads the cached latent rows straight from their pages, with an online softmax across
pages (the core, a sequence's query rows over its pages: ``dsinfer.ops.mla_attend_cpu``). Every
query head (and query token) shares the single latent KV head. Sequences run in parallel, and when they do not fill the threads (batch 1) the absorbed kernel
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
from dsinfer.ops.mla_attend_cpu import attend_sequence

__all__ = [
    "compile_ahead",
    "mla_decode",
    "mla_decode_absorbed",
    "mla_decode_absorbed_in_groups",
    "row_groups",
]

_FASTMATH = {"reassoc", "contract", "nsz"}  # let LLVM vectorize dot products; keep inf semantics


@numba.njit(parallel=True, cache=True, fastmath=_FASTMATH, nogil=True)
def _decode(q, cache, bf16_bits, table, lens, dv, scale, causal, out, lse):  # numpy arrays, typed by numba
    """:func:`mla_decode`'s kernel: sequences in parallel (the cache as ``attend_sequence`` reads it)."""
    bsz, s_q, h_q, dim = q.shape
    rows = s_q * h_q
    for b in numba.prange(bsz):
        m = np.full(rows, -np.inf, dtype=np.float32)
        denom = np.zeros(rows, dtype=np.float32)
        acc = np.zeros((rows, dv), dtype=np.float32)
        attend_sequence(
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
        attend_sequence(
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
