"""Roofline cost of one lockstep step of an expert-parallel pool, per layer stage.

Precision as DeepSeek serves (seeds/): FP8 GEMMs and FP8 dispatch, BF16 core MLA, BF16 latent
cache and BF16 combine. V3.2 (sparse attention) adds the lightning indexer: its projections, and
its logits over every cached key (FP8 keys, at the FlashMLA roofline) in decode and over every causal
pair in prefill; MLA then attends to at most ``index_topk`` keys per query (decode: per request,
estimated as min(context, requests x top-k) over a rank's requests). Per layer and micro-batch, for each rank (numpy arrays over ranks):

- ``A0`` decode: q_a+kv_a projection (2112 x 7168), q_b (24576 x 1536), the absorbed W_UK (BF16),
  norms, RoPE, cache write.
- ``A1`` decode: FlashMLA over the latent cache (s_q query tokens per request: 2 with an MTP
  draft), the absorbed W_UV (BF16), o_proj (7168 x 16384), residual + norm, the router (BF16).
  Prefill: one attention stage (``A1``, ``A0`` = 0): the projections, kv_b (32768 x 512) over every
  context token of the chunk (cached prefix included: the decompressed path), causal attention
  at FlashAttention-3 rates, o_proj, router.
- ``S`` shared expert; ``M`` routed experts as grouped GEMMs over each local slot's rows (masked
  layout in decode, contiguous in prefill), or the dense FFN of the first layers.
- ``D``/``C``: DeepEP dispatch (FP8 + scales) and combine (BF16). Decode (low-latency kernels):
  one copy per (token, expert) pair. Prefill (normal kernels): one copy per destination node
  (``ExpertModel.node_fanout``), the unit of DeepEP's measured bottleneck bandwidth. A transfer
  lasts the largest per-rank volume (sent or received) over the measured bandwidth.

Ranks run each stage in lockstep (every dispatch and combine is a pool-wide exchange), so a stage
lasts as long as its slowest rank. The two micro-batches split each rank's work in halves
(DeepSeek balances attention between them). With MTP, the step also runs the MTP layer (one more
MoE layer plus its 14336 -> 7168 projection) and its head. In prefill the MTP layer is one more
layer of the pipeline (its inputs, the next prompt tokens, are known). In decode it drafts from
the token the main model's head has just sampled and verified, so it runs after that head, as a
pipeline of its own (one layer, two micro-batches: its dispatch and combine have no other layer
to hide under), followed by its own head; each head runs once per step over every token (not per
micro-batch). While DeepEP's normal kernels run (prefill overlap) they hold ``comm_sms`` SMs
(DeepEP's default 20; DeepSeek's published prefill profile: 24 of 132), which slows compute by
132 / (132 - comm_sms). DeepSeek-V4's attention stages are dsinfer/sim/v4_cost.py's, per layer
(its layer kinds differ); the rest of its step is the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dsinfer.sim import v4_cost
from dsinfer.sim.experts import ExpertModel
from dsinfer.sim.kernels import DEEPEP_NORMAL_SMS, Kernels
from dsinfer.sim.model_dims import ModelShape
from dsinfer.sim.schedule import DECODE_ORDER, PREFILL_ORDER, SERIAL_ORDER, step_time


@dataclass(frozen=True)
class PoolModel:
    """What the cost of a step of one pool depends on besides its batch."""

    shape: ModelShape
    kernels: Kernels
    experts: ExpertModel
    overlap: bool = True  # two micro-batches, transfers under compute
    mtp: bool = True  # one MTP draft token per request per decode step
    overlap_min_tokens: int = 64  # below this many tokens on every rank a step runs one micro-batch
    comm_sms: int = DEEPEP_NORMAL_SMS  # SMs DeepEP's normal kernels hold (prefill overlap)

    @property
    def ranks(self) -> int:
        return self.experts.ranks


@dataclass
class StepCost:
    time: float
    attention_imbalance: float = 1.0  # max / mean over ranks of the attention stage
    expert_imbalance: float = 1.0  # max / mean over ranks of routed rows, mean over layers
    breakdown: dict[str, float] = field(default_factory=dict)  # summed stage time per kind (s)
    tail: float = 0.0  # time after the main layers' pipeline: heads, and in decode the MTP layer's pipeline


def _max(a: np.ndarray) -> float:
    return float(np.max(a)) if np.size(a) else 0.0


def _ratio(a: np.ndarray) -> float:
    a = a.sum(axis=0) if np.ndim(a) == 2 else a  # per layer and rank: each rank's whole
    mean = float(np.mean(a)) if np.size(a) else 0.0
    return float(np.max(a)) / mean if mean > 0 else 1.0


def _per_layer(a: np.ndarray | float, layers: int) -> np.ndarray:
    """A stage's time per layer: the slowest rank of each (``a`` per rank, the same every layer,
    or per layer and rank)."""
    if np.ndim(a) == 2:
        return np.asarray(a).max(axis=1)
    return np.full(layers, _max(np.asarray(a)))


def _decode_attention(
    k: Kernels, s: ModelShape, tokens: np.ndarray, kv_tokens: np.ndarray, q_per_req: int, mtp: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(A0, A1) of the model's layers (``mtp``: of its MTP layer): per rank, or for V4 per layer
    and rank."""
    if s.v4 is not None:
        layers = v4_cost.MTP_LAYERS if mtp else v4_cost.main_layers(s)
        return v4_cost.decode_attention(k, s, tokens, kv_tokens, q_per_req, layers)
    return decode_attention(k, s, tokens, kv_tokens, q_per_req)


def _mtp_projection(k: Kernels, s: ModelShape, tokens: np.ndarray) -> np.ndarray:
    """The MTP layer's input projection: V3's [embedding; hidden] -> hidden; V4's embedding and
    each residual stream through their own hidden -> hidden projections."""
    if s.v4 is not None:
        return k.gemm(tokens * (1 + s.v4.hc_mult), s.hidden, s.hidden)
    return k.gemm(tokens, s.hidden, 2 * s.hidden)


# Stage costs (per rank) ----------------------------------------------------------------------
def _elementwise_a0(s: ModelShape) -> float:
    """Bytes per token of A0's small kernels: input norm + FP8 quant, the q/kv latent norms and
    quant, RoPE on the rope part of q (every head) and k, the cache write."""
    return 3 * s.hidden + 5 * (s.q_lora + s.latent_dim) + 4 * s.heads * s.rope_dim + 2 * s.latent_dim


def _elementwise_a1(s: ModelShape) -> float:
    """o_proj input quant, residual add + norm + quant."""
    return 3 * s.heads * s.v_dim + 7 * s.hidden


def _expert_row_bytes(s: ModelShape, prefill: bool) -> float:
    """SiLU-and-mul + quant per routed row; prefill also permutes rows into the contiguous layout
    and back."""
    return 5 * s.moe_inter + (4 * s.dispatch_bytes if prefill else 0)


def decode_attention(
    k: Kernels, s: ModelShape, tokens: np.ndarray, kv_tokens: np.ndarray, q_per_req: int
) -> tuple[np.ndarray, np.ndarray]:
    """(A0, A1) per rank for ``tokens`` query tokens attending over ``kv_tokens`` cached tokens
    (summed over the requests; each request has ``q_per_req`` query tokens)."""
    a0 = (
        k.gemm(tokens, s.q_lora + s.latent_dim, s.hidden)
        + k.gemm(tokens, s.heads * s.qk_head, s.q_lora)
        + k.gemm(tokens, s.heads * s.kv_lora, s.nope_dim, bf16=True)
        + k.elementwise(tokens * _elementwise_a0(s), kernels=5)
    )
    keys = kv_tokens
    if s.sparse:  # V3.2: the indexer over every cached key, MLA over at most index_topk per request
        a0 = a0 + _indexer_projections(k, s, tokens)
        keys = np.minimum(kv_tokens, tokens / q_per_req * s.index_topk)
        indexer = kv_tokens * q_per_req * s.indexer_flops_per_pair
        a0 = a0 + k.flash_mla(kv_tokens * s.indexer_bytes_per_key, indexer)
    flops = keys * q_per_req * s.mla_decode_flops_per_key
    a1 = (
        k.flash_mla(keys * 2 * s.latent_dim, flops)
        + k.gemm(tokens, s.heads * s.v_dim, s.kv_lora, bf16=True)
        + k.gemm(tokens, s.hidden, s.heads * s.v_dim)
        + k.gemm(tokens, s.experts, s.hidden, bf16=True)
        + k.elementwise(tokens * _elementwise_a1(s), kernels=4)
    )
    return a0, a1


def _indexer_projections(k: Kernels, s: ModelShape, tokens: np.ndarray) -> np.ndarray:
    """V3.2's indexer query (wq_b over the q LoRA), key (wk) and head weights (BF16)."""
    return (
        k.gemm(tokens, s.index_heads * s.index_dim, s.q_lora)
        + k.gemm(tokens, s.index_dim, s.hidden)
        + k.gemm(tokens, s.index_heads, s.hidden, bf16=True)
    )


def prefill_attention(
    k: Kernels,
    s: ModelShape,
    tokens: np.ndarray,
    ctx_tokens: np.ndarray,
    pairs: np.ndarray,
    key_len: np.ndarray,
) -> np.ndarray:
    """A1 per rank: ``tokens`` new tokens, ``ctx_tokens`` tokens whose K/V are decompressed,
    ``pairs`` causal (query, key) pairs, ``key_len`` their pair-weighted mean key length. V3.2 adds
    the indexer over every pair and attends to at most ``index_topk`` keys per query."""
    sparse = np.zeros_like(np.asarray(tokens, dtype=np.float64))
    if s.sparse:
        sparse = _indexer_projections(k, s, tokens) + k.prefill_attention(
            pairs * s.indexer_flops_per_pair, key_len
        )
        pairs = np.minimum(pairs, tokens * s.index_topk)
        key_len = np.minimum(key_len, s.index_topk)
    return (
        sparse
        + k.gemm(tokens, s.q_lora + s.latent_dim, s.hidden)
        + k.gemm(tokens, s.heads * s.qk_head, s.q_lora)
        + k.gemm(ctx_tokens, s.heads * (s.nope_dim + s.v_dim), s.kv_lora)
        + k.prefill_attention(pairs * s.attention_flops_per_pair, key_len)
        + k.gemm(tokens, s.hidden, s.heads * s.v_dim)
        + k.gemm(tokens, s.experts, s.hidden, bf16=True)
        + k.elementwise(tokens * (_elementwise_a0(s) + _elementwise_a1(s)), kernels=9)
    )


def shared_expert(k: Kernels, s: ModelShape, tokens: np.ndarray) -> np.ndarray:
    inter = s.moe_inter * s.shared_experts
    return (
        k.gemm(tokens, 2 * inter, s.hidden)
        + k.gemm(tokens, s.hidden, inter)
        + k.elementwise(tokens * 5 * inter, kernels=1)
    )


def dense_ffn(k: Kernels, s: ModelShape, tokens: np.ndarray) -> np.ndarray:
    return (
        k.gemm(tokens, 2 * s.inter, s.hidden)
        + k.gemm(tokens, s.hidden, s.inter)
        + k.elementwise(tokens * 5 * s.inter, kernels=1)
    )


def routed_experts(k: Kernels, s: ModelShape, e: ExpertModel, rows: np.ndarray, prefill: bool) -> np.ndarray:
    """[layers, ranks] time of the grouped expert GEMMs for ``rows`` [layers, slots]."""
    layout = "contiguous" if prefill else "masked"
    per_slot = k.grouped_gemm(rows, 2 * s.moe_inter, s.hidden, layout) + k.grouped_gemm(
        rows, s.hidden, s.moe_inter, layout
    )
    per_rank = per_slot.reshape(rows.shape[0], e.ranks, e.slots_per_rank).sum(axis=-1)
    rank_rows = e.rank_rows(rows)
    return per_rank + k.elementwise(rank_rows * _expert_row_bytes(s, prefill), kernels=3 if prefill else 1)


def transfers(
    pm: PoolModel, sent_units: np.ndarray, rank_rows: np.ndarray, prefill: bool
) -> tuple[np.ndarray, np.ndarray]:
    """(dispatch, combine) time per layer. ``sent_units``: per rank, copies it dispatches (token x
    fan-out); ``rank_rows`` [layers, ranks]: routed rows each rank receives."""
    s, k = pm.shape, pm.kernels
    bw_d, bw_c = k.ep_bandwidth(pm.ranks, "normal" if prefill else "low_latency")
    total_rows = rank_rows.sum(axis=1, keepdims=True)
    total_sent = float(np.sum(sent_units))
    received = np.where(total_rows > 0, rank_rows / np.maximum(total_rows, 1e-9), 0.0) * total_sent
    units = np.maximum(received.max(axis=1), _max(sent_units))
    return units * s.dispatch_bytes / bw_d, units * s.combine_bytes / bw_c


# Steps -----------------------------------------------------------------------------------------
def _micro_batches(pm: PoolModel, tokens: np.ndarray) -> int:
    return 2 if pm.overlap and _max(tokens) >= pm.overlap_min_tokens else 1


def _stages(
    pm: PoolModel, per_layer: dict[str, np.ndarray], mbs: int, prefill: bool
) -> dict[str, np.ndarray]:
    if prefill and pm.overlap and mbs == 2:
        slow = pm.kernels.comm_sm_slowdown(pm.comm_sms)
        return {n: v * slow if n in ("A0", "A1", "S", "M") else v for n, v in per_layer.items()}
    return per_layer


def _pipeline(pm: PoolModel, stages: dict[str, np.ndarray], mbs: int, prefill: bool) -> float:
    order = SERIAL_ORDER if mbs == 1 else (PREFILL_ORDER if prefill else DECODE_ORDER)
    return step_time(stages, order, serial=not pm.overlap)


def _main_stages(
    pm: PoolModel,
    a0: np.ndarray | float,
    a1: np.ndarray | float,
    shared: float,
    dense: float,
    moe: np.ndarray,
    d: np.ndarray,
    c: np.ndarray,
) -> dict[str, np.ndarray]:
    """``a0``/``a1`` per rank or per layer and rank (see :func:`_per_layer`)."""
    s = pm.shape
    n_dense = s.dense_layers
    return {
        "A0": _per_layer(a0, s.layers),
        "A1": _per_layer(a1, s.layers),
        "S": np.concatenate([np.zeros(n_dense), np.full(s.moe_layers, shared)]),
        "M": np.concatenate([np.full(n_dense, dense), moe]),
        "D": np.concatenate([np.zeros(n_dense), d]),
        "C": np.concatenate([np.zeros(n_dense), c]),
    }


def _mtp_stages(mtp: tuple[float, float, float, float, float, float]) -> dict[str, np.ndarray]:
    return {
        name: np.array([value]) for name, value in zip(("A0", "A1", "S", "M", "D", "C"), mtp, strict=True)
    }


def _breakdown(mbs: int, *parts: dict[str, np.ndarray]) -> dict[str, float]:
    return {
        name: sum(float(np.sum(p[name])) for p in parts) * mbs for name in ("A0", "A1", "S", "M", "D", "C")
    }


def decode_step(
    pm: PoolModel, requests: np.ndarray, kv_tokens: np.ndarray, rng: np.random.Generator | None = None
) -> StepCost:
    """One decode step: ``requests`` running per rank, ``kv_tokens`` their summed context per rank."""
    s, k, e = pm.shape, pm.kernels, pm.experts
    requests = np.asarray(requests, dtype=np.float64)
    kv_tokens = np.asarray(kv_tokens, dtype=np.float64)
    if not np.any(requests > 0):
        return StepCost(0.0)
    q = 2 if pm.mtp else 1
    tokens = requests * q
    mbs = _micro_batches(pm, tokens)
    t_mb, kv_mb = tokens / mbs, kv_tokens / mbs
    a0, a1 = _decode_attention(k, s, t_mb, kv_mb, q)
    shared = shared_expert(k, s, t_mb)
    rows = e.rows(float(t_mb.sum()) * s.topk, rng)
    rank_rows = e.rank_rows(rows)
    moe = routed_experts(k, s, e, rows, prefill=False).max(axis=1)
    d, c = transfers(pm, t_mb * s.topk, rank_rows, prefill=False)
    main = _main_stages(pm, a0, a1, _max(shared), _max(dense_ffn(k, s, t_mb)), moe, d, c)
    main = _stages(pm, main, mbs, prefill=False)
    parts = [main]

    def head(rows: np.ndarray) -> float:  # LM head (BF16) + final norm, sampling
        return _max(k.gemm(rows, s.vocab, s.hidden, bf16=True)) + _max(
            k.elementwise(rows * 4 * s.hidden, kernels=4)
        )

    # the main model's head verifies the draft and samples, over every token of the step
    heads = head(tokens)
    t_main = _pipeline(pm, main, mbs, prefill=False)
    t = t_main + heads
    if pm.mtp:
        # then the MTP layer drafts from the sampled token (one query per request): its own
        # pipeline and head after the main model's
        r_mb = requests / mbs
        m0, m1 = _decode_attention(k, s, r_mb, kv_mb, 1, mtp=True)
        m0 = m0 + _mtp_projection(k, s, r_mb)
        mrows = e.mean_share[None, :] * float(r_mb.sum()) * s.topk
        md, mc = transfers(pm, r_mb * s.topk, e.rank_rows(mrows), prefill=False)
        mtp = _mtp_stages(
            (
                _max(m0),
                _max(m1),
                _max(shared_expert(k, s, r_mb)),
                _max(routed_experts(k, s, e, mrows, prefill=False)),
                float(md[0]),
                float(mc[0]),
            )
        )
        parts.append(mtp)
        mtp_head = head(requests)
        t += _pipeline(pm, mtp, mbs, prefill=False) + mtp_head
        heads += mtp_head
    breakdown = _breakdown(mbs, *parts)
    breakdown["head"] = heads
    return StepCost(
        t,
        attention_imbalance=_ratio(a1),
        expert_imbalance=float(np.mean(rank_rows.max(axis=1) / np.maximum(rank_rows.mean(axis=1), 1e-9))),
        breakdown=breakdown,
        tail=t - t_main,
    )


def prefill_step(
    pm: PoolModel,
    tokens: np.ndarray,
    ctx_tokens: np.ndarray,
    pairs: np.ndarray,
    key_len: np.ndarray,
    finishing: np.ndarray,
    rng: np.random.Generator | None = None,
) -> StepCost:
    """One prefill step: per rank, ``tokens`` new tokens, ``ctx_tokens`` tokens whose K/V the
    chunks decompress, ``pairs`` causal attention pairs (pair-weighted key length ``key_len``),
    ``finishing`` requests whose last chunk this is (they need logits)."""
    s, k, e = pm.shape, pm.kernels, pm.experts
    tokens = np.asarray(tokens, dtype=np.float64)
    if not np.any(tokens > 0):
        return StepCost(0.0)
    mbs = _micro_batches(pm, tokens)
    t_mb = tokens / mbs
    if s.v4 is not None:  # nothing is decompressed; each query's rows are bounded by the window and top-k
        a1 = v4_cost.prefill_attention(k, s, t_mb, key_len, v4_cost.main_layers(s))
        mtp_a1 = v4_cost.prefill_attention(k, s, t_mb, key_len, v4_cost.MTP_LAYERS)
    else:
        a1 = prefill_attention(k, s, t_mb, np.asarray(ctx_tokens) / mbs, np.asarray(pairs) / mbs, key_len)
        mtp_a1 = a1
    shared = shared_expert(k, s, t_mb)
    rows = e.rows(float(t_mb.sum()) * s.topk, rng)
    rank_rows = e.rank_rows(rows)
    moe = routed_experts(k, s, e, rows, prefill=True).max(axis=1)
    d, c = transfers(pm, t_mb * e.node_fanout, rank_rows, prefill=True)
    stages = _main_stages(pm, 0.0, a1, _max(shared), _max(dense_ffn(k, s, t_mb)), moe, d, c)
    if pm.mtp:
        # the MTP layer over the prompt: one more layer of the pipeline (its KV goes to decode)
        mrows = e.mean_share[None, :] * float(t_mb.sum()) * s.topk
        md, mc = transfers(pm, t_mb * e.node_fanout, e.rank_rows(mrows), prefill=True)
        mtp = _mtp_stages(
            (
                _max(_mtp_projection(k, s, t_mb)),
                _max(mtp_a1),
                _max(shared),
                _max(routed_experts(k, s, e, mrows, prefill=True)),
                float(md[0]),
                float(mc[0]),
            )
        )
        stages = {name: np.concatenate([v, mtp[name]]) for name, v in stages.items()}
    stages = _stages(pm, stages, mbs, True)
    t = _pipeline(pm, stages, mbs, prefill=True)
    breakdown = _breakdown(mbs, stages)
    heads = 2 if pm.mtp else 1
    tail = _max(k.gemm(np.asarray(finishing, dtype=np.float64), s.vocab, s.hidden, bf16=True)) * heads
    breakdown["head"] = tail
    return StepCost(
        t + tail,
        attention_imbalance=_ratio(a1),
        expert_imbalance=float(np.mean(rank_rows.max(axis=1) / np.maximum(rank_rows.mean(axis=1), 1e-9))),
        breakdown=breakdown,
        tail=tail,
    )
