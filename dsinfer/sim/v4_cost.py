"""Roofline cost of DeepSeek-V4's attention stages, per layer (its three kinds cost differently) and
rank; the MoE, shared expert, transfers and heads are V3's (dsinfer/sim/cost.py).

Per layer, a query attends over one shared K=V head (MQA, ``head_dim`` values that are both key
and value, in the model's dtype as the engine keeps them) to at most the ``sliding_window`` last
raw rows, and besides them, in a CSA layer to the ``index_topk`` compressed entries its indexer
picks among one per 4 tokens, in an HCA layer to every entry, one per 128 tokens. So decode's
attention work per request is bounded by the window and top-k, except HCA's one entry per 128
tokens and the CSA indexer's scan of one key per 4.

- ``A0`` decode: q down and up projections, the shared K=V projection, the compressors' kv and
  gate projections (CSA's at twice the width: its windows overlap), CSA's indexer (its query,
  head weights and compressor, then its logits over every compressed key at the FlashMLA
  roofline), norms, RoPE, the attention mHC's stream mixing.
- ``A1`` decode: the sparse attention core (FlashMLA roofline over the gathered rows), the grouped
  low-rank output projection (``o_groups`` blocks of ``o_lora``, then back to hidden), mHC, the
  router (BF16; none in the hash-routed layers).
- Prefill: one attention stage (``A1``), the same projections over the chunk's tokens and the core
  over each query's visible rows at FlashAttention-3 rates: nothing is decompressed.

Every function returns ``[layers, ranks]`` for ``layers``, each (attention kind, routed by the
router): :func:`main_layers` for the model's, :data:`MTP_LAYERS` for the release's MTP layer (a
sliding-window layer routed by its router).
"""

from __future__ import annotations

import numpy as np

from dsinfer.base.v4_config import CSA, HCA
from dsinfer.sim.kernels import Kernels
from dsinfer.sim.model_dims import ModelShape, V4Dims

SLIDING = "sliding_attention"
Layers = tuple[tuple[str, bool], ...]
MTP_LAYERS: Layers = ((SLIDING, True),)  # the release's MTP layer: its window only, routed MoE


def _dims(s: ModelShape) -> V4Dims:
    if s.v4 is None:
        raise ValueError("a V4 cost asked of a model without V4 dimensions")
    return s.v4


def _projections(k: Kernels, s: ModelShape, kind: str, tokens: np.ndarray) -> np.ndarray:
    v4 = _dims(s)
    d = v4.head_dim
    cost = (
        k.gemm(tokens, s.q_lora, s.hidden)
        + k.gemm(tokens, s.heads * d, s.q_lora)
        + k.gemm(tokens, d, s.hidden)
        + k.elementwise(tokens * _elementwise_a0(s), kernels=6)
    )
    if kind == HCA:
        cost = cost + k.gemm(tokens, 2 * d, s.hidden)
    if kind == CSA:
        cost = (
            cost
            + k.gemm(tokens, 4 * d, s.hidden)
            + k.gemm(tokens, 4 * s.index_dim, s.hidden)
            + k.gemm(tokens, s.index_heads * s.index_dim, s.q_lora)
            + k.gemm(tokens, s.index_heads, s.hidden, bf16=True)
        )
    return cost


def _output(k: Kernels, s: ModelShape, tokens: np.ndarray, routed: bool) -> np.ndarray:
    """The grouped output projection (each group's heads to its ``o_lora`` rows: as many MACs and
    weight bytes as one ``o_lora x heads * head_dim`` GEMM), the way back to hidden, the router."""
    v4 = _dims(s)
    cost = (
        k.gemm(tokens, v4.o_lora, s.heads * v4.head_dim)
        + k.gemm(tokens, s.hidden, v4.o_groups * v4.o_lora)
        + k.elementwise(tokens * _elementwise_a1(s), kernels=5)
    )
    return cost + k.gemm(tokens, s.experts, s.hidden, bf16=True) if routed else cost


def _elementwise_a0(s: ModelShape) -> float:
    """Bytes per token: the attention mHC (``hc_mult`` streams in, one out, its mixing GEMM's
    input), the input norm, the q/kv norms, RoPE on every head's rope slice and on k, the window
    row's write."""
    v4 = _dims(s)
    streams = v4.hc_mult * s.hidden * 2
    return (
        2 * streams + 3 * s.hidden + 5 * (s.q_lora + v4.head_dim) + 4 * s.heads * s.rope_dim + 2 * v4.head_dim
    )


def _elementwise_a1(s: ModelShape) -> float:
    """Inverse RoPE on the output's rope slices, the attention mHC's write back into the streams,
    the FFN mHC's mixing, the FFN norm."""
    v4 = _dims(s)
    streams = v4.hc_mult * s.hidden * 2
    return 4 * s.heads * s.rope_dim + 3 * streams + 3 * s.hidden


def _attention_flops_per_key(s: ModelShape) -> int:
    """One query and one visible row, every head: QK over ``head_dim``, PV over the same row."""
    return 2 * s.heads * 2 * _dims(s).head_dim


def decode_attention(
    k: Kernels, s: ModelShape, tokens: np.ndarray, kv_tokens: np.ndarray, q_per_req: int, layers: Layers
) -> tuple[np.ndarray, np.ndarray]:
    """(A0, A1) ``[layers, ranks]`` for ``tokens`` query tokens over ``kv_tokens`` cached tokens
    (summed over the rank's requests, ``q_per_req`` queries each)."""
    v4 = _dims(s)
    tokens = np.asarray(tokens, dtype=np.float64)
    kv_tokens = np.asarray(kv_tokens, dtype=np.float64)
    requests = tokens / q_per_req
    window = np.minimum(kv_tokens, requests * v4.window)
    row_bytes = 2 * v4.head_dim
    a0, a1 = [], []
    for kind, routed in layers:
        keys = window
        first = _projections(k, s, kind, tokens)
        if kind == CSA:
            entries = kv_tokens / v4.csa_rate
            keys = keys + np.minimum(entries, requests * v4.config.index_topk)
            index_bytes = entries * 2 * s.index_dim
            first = first + k.flash_mla(index_bytes, entries * q_per_req * 2 * s.index_heads * s.index_dim)
        elif kind == HCA:
            keys = keys + kv_tokens / v4.hca_rate
        core = k.flash_mla(keys * row_bytes, keys * q_per_req * _attention_flops_per_key(s))
        a0.append(first)
        a1.append(core + _output(k, s, tokens, routed))
    return np.stack(a0), np.stack(a1)


def prefill_attention(
    k: Kernels, s: ModelShape, tokens: np.ndarray, key_len: np.ndarray, layers: Layers
) -> np.ndarray:
    """A1 ``[layers, ranks]``: ``tokens`` new tokens whose queries see ``key_len`` earlier tokens on
    average (pair-weighted)."""
    v4 = _dims(s)
    tokens = np.asarray(tokens, dtype=np.float64)
    key_len = np.asarray(key_len, dtype=np.float64)
    window = np.minimum(key_len, v4.window)
    stages = []
    for kind, routed in layers:
        keys = window
        cost = _projections(k, s, kind, tokens)
        if kind == CSA:
            entries = key_len / v4.csa_rate
            keys = keys + np.minimum(entries, v4.config.index_topk)
            indexer = tokens * entries * 2 * s.index_heads * s.index_dim
            cost = cost + k.prefill_attention(indexer, np.maximum(entries, 1.0))
        elif kind == HCA:
            keys = keys + key_len / v4.hca_rate
        core = k.prefill_attention(tokens * keys * _attention_flops_per_key(s), np.maximum(keys, 1.0))
        stages.append(cost + core + _output(k, s, tokens, routed))
    return np.stack(stages)


def main_layers(s: ModelShape) -> Layers:
    v4 = _dims(s)
    return tuple((kind, layer >= v4.hash_layers) for layer, kind in enumerate(v4.kinds))
