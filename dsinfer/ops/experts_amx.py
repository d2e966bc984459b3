"""Routed experts in bf16 on Intel AMX (numba): the ``amx`` backend of the ``FusedExperts``
contract, for bf16 rows and weights on a CPU with AMX tiles (others go to the float32-math kernel
of :mod:`dsinfer.ops.experts_cpu`).

Each expert takes its rows sixteen at a time and computes the transposed products, so the
weights are read in place: ``gate_up^T = w13 @ x^T`` takes 16 x 32 blocks of ``w13`` rows straight
from the checkpoint's ``[2I, H]`` layout as the left tile, and the block's activations, packed in
pairs of channels per row (AMX's layout for the right tile: a few KB), as the right tile. The
SwiGLU runs in float32 on the products and is rounded once to bf16, as the torch reference rounds
its GEMM outputs; ``y^T = w2 @ h^T`` likewise. Products and sums are float32 (AMX).

A row's result depends only on that row: a block's other columns (rows of other tokens, or zeros
past the last) never meet it, and the channels are summed in the same order for any block. So
expert-parallel pools of any size give the same tokens, as with :mod:`dsinfer.ops.experts_cpu`
(whose float32 arithmetic gives other bits: a machine runs one of the two).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from dsinfer.ops import experts_cpu
from dsinfer.ops.amx_cpu import (
    TILE_BYTES,
    TILE_ROWS,
    amx_bf16_available,
    load_config,
    product_64,
    release,
    tile_config,
)
from dsinfer.ops.bf16_cpu import rounded_bf16
from dsinfer.ops.compile_ahead import c_array
from dsinfer.ops.exp_cpu import exp32

__all__ = ["CONFIG", "amx_bf16_available", "compile_ahead", "experts_amx", "fits", "fused_experts"]

_FASTMATH = {"reassoc", "contract", "nsz"}
TOKENS = TILE_ROWS  # rows of an expert per block: the columns of every product tile
OUTPUTS = 4 * TILE_ROWS  # output channels per pass of product_64
# tiles 0-3: float32 accumulators [16 outputs x 16 tokens]; 4: activations [16 channel pairs x
# 16 tokens]; 5, 6: weights [16 outputs x 32 channels]
CONFIG = tile_config({t: (TILE_ROWS, TILE_BYTES) for t in range(7)})


def fits(hidden: int, inter: int) -> bool:
    """Whether experts of these sizes fill whole tiles (else the float32 kernel runs)."""
    return hidden % OUTPUTS == 0 and (2 * inter) % OUTPUTS == 0  # whole tiles of channels too


@numba.njit(parallel=True, cache=True, nogil=True, fastmath=_FASTMATH)
def _experts(rows, slots, w13, w2, config, out):  # numpy arrays, typed by numba
    """rows [M, H/2] (bf16 pairs as uint32), w13 [S, 2I, H] and w2 [S, H, I] (bf16 bits), out [M, H]."""
    half_hidden = rows.shape[1]
    num_slots, two_inter, hidden = w13.shape
    inter = two_inter // 2
    starts, order = experts_cpu.rows_by_slot(slots, num_slots)
    for s in numba.prange(num_slots):
        if starts[s + 1] == starts[s]:
            continue
        load_config(config)
        x_pairs = np.empty((half_hidden, TOKENS), dtype=np.uint32)
        gate_up = np.empty((two_inter, TOKENS), dtype=np.float32)
        h_pairs = np.empty((inter // 2, TOKENS), dtype=np.uint32)
        y = np.empty((hidden, TOKENS), dtype=np.float32)
        h = np.empty((inter, TOKENS), dtype=np.float32)
        h_bits = h.view(np.uint32)
        for block in range(starts[s], starts[s + 1], TOKENS):
            count = min(TOKENS, starts[s + 1] - block)
            x_pairs[:, count:] = 0
            for i in range(count):
                x_pairs[:, i] = rows[order[block + i]]
            w13_at = s * two_inter * hidden * 2
            for f in range(0, two_inter, OUTPUTS):
                product_64(w13, w13_at + f * hidden * 2, hidden * 2, hidden, x_pairs, gate_up, f)
            for c in range(inter):
                for i in range(TOKENS):
                    g = gate_up[c, i]
                    h[c, i] = g / (np.float32(1.0) + exp32(-g)) * gate_up[inter + c, i]
            for c in range(0, inter, 2):
                for i in range(TOKENS):
                    low, high = (
                        np.uint32(rounded_bf16(h_bits[c, i])),
                        np.uint32(rounded_bf16(h_bits[c + 1, i])),
                    )
                    h_pairs[c // 2, i] = low | (high << np.uint32(16))
            w2_at = s * hidden * inter * 2
            for o in range(0, hidden, OUTPUTS):
                product_64(w2, w2_at + o * inter * 2, inter * 2, inter, h_pairs, y, o)
            for i in range(count):
                row = order[block + i]
                for o in range(hidden):
                    out[row, o] = y[o, i]
        release()


_EXPERTS_SIGNATURE = (
    c_array(numba.uint32, 2),  # rows: bf16 pairs
    c_array(numba.int64, 1),  # slots
    c_array(numba.uint16, 3),  # w13 bits
    c_array(numba.uint16, 3),  # w2 bits
    c_array(numba.uint8, 1),  # tile configuration
    c_array(numba.float32, 2),  # out
)


def compile_ahead() -> None:
    """Compile (or load from numba's cache) this kernel and the float32 one it leaves the rest to."""
    experts_cpu.compile_ahead()
    _experts.compile(_EXPERTS_SIGNATURE)


def experts_amx(
    rows: np.ndarray, slots: np.ndarray, w13: np.ndarray, w2: np.ndarray, out: np.ndarray
) -> None:
    """``out[r] = expert slots[r] (rows[r])``: rows as bf16 pairs (uint32 [M, H/2]), bf16 weights
    as their bits, out float32 [M, H]; call only where :func:`amx_bf16_available` and :func:`fits`."""
    _experts(rows, slots, w13, w2, CONFIG, out)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def fused_experts(
    rows: torch.Tensor,
    slots: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor | None,
    pairs_per_row: int = 1,
) -> torch.Tensor:
    """``FusedExperts`` (dsinfer/ops/signatures.py): bf16 rows and weights of sizes that
    :func:`fits` AMX tiles (a row repeated for each of its pairs), anything else through
    :func:`dsinfer.ops.experts_cpu.fused_experts`."""
    hidden, inter = w13.shape[2], w2.shape[2]
    bf16 = rows.dtype == w13.dtype == w2.dtype == torch.bfloat16
    if not (bf16 and rows.shape[0] > 0 and fits(hidden, inter) and amx_bf16_available()):
        return experts_cpu.fused_experts(rows, slots, w13, w13_scale_inv, w2, w2_scale_inv, pairs_per_row)
    if pairs_per_row > 1:
        rows = rows.repeat_interleave(pairs_per_row, dim=0)
    out = torch.empty(rows.shape[0], hidden, dtype=torch.float32)
    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))
    experts_amx(
        rows.detach().contiguous().view(torch.int32).numpy().view(np.uint32),
        slots.to(torch.int64).contiguous().numpy(),
        _bits(w13),
        _bits(w2),
        out.numpy(),
    )
    return out.to(torch.bfloat16)
