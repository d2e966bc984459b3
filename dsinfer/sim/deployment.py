"""What is simulated: pool specifications (from ``dsinfer serve`` profiles) and the assumptions
that are not properties of a pool."""

from __future__ import annotations

from dataclasses import dataclass

from dsinfer.base.kv_groups import HybridCacheSpec
from dsinfer.base.rank_shape import RankShape, expert_slots_per_rank
from dsinfer.base.v4_weights import V4ParameterCounts
from dsinfer.sim.cost import PoolModel
from dsinfer.sim.experts import ExpertModel, expert_model
from dsinfer.sim.hardware import H800, Hardware
from dsinfer.sim.kernels import DEEPEP_NORMAL_SMS, Kernels
from dsinfer.sim.model_dims import ModelShape

ROLES = ("prefill", "decode")
BF16_BYTES = 2
ACTIVATION_RESERVE = 0.10  # of HBM, for activations, communication buffers and CUDA graphs


@dataclass(frozen=True)
class PoolSpec:
    """One pool of a role: the ``dsinfer serve`` flags the cost depends on."""

    role: str
    pool_size: int
    nnodes: int
    num_redundant_experts: int = 0
    overlap: bool = False  # --enable-overlap
    mtp: bool = False  # --speculative-mtp
    kv_cache_bytes: float | None = None  # --kv-cache-memory per rank; None: what fits beside the weights
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    overlap_min_tokens: int = 64
    model: str = "deepseek-v3"
    # SMs DeepEP's normal kernels hold while they overlap prefill compute (Buffer.set_num_sms;
    # DeepEP's default is 20, DeepSeek's published prefill profile shows 24)
    comm_sms: int = DEEPEP_NORMAL_SMS
    # Attention-aware prefill chunking (dsinfer.engine.scheduler, ``attention_token_weight``): the
    # step budget counts a chunk's core attention and its cached-context decompression besides its
    # tokens (see dsinfer/sim/pools.py). None: the budget counts tokens only.
    attention_token_weight: float | None = None
    context_token_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.pool_size < 1 or self.nnodes < 1 or self.pool_size % self.nnodes:
            raise ValueError(
                f"pool-size {self.pool_size} must be a positive multiple of nnodes {self.nnodes}"
            )
        if self.num_redundant_experts < 0:
            raise ValueError("num-redundant-experts must be >= 0")
        if self.attention_token_weight is not None and self.attention_token_weight <= 0:
            raise ValueError("attention-token-weight must be positive")
        if self.context_token_weight < 0:
            raise ValueError("context-token-weight must be >= 0")

    @property
    def gpus_per_node(self) -> int:
        return self.pool_size // self.nnodes


@dataclass(frozen=True)
class Assumptions:
    """Everything the simulation assumes beyond the pools and the traffic (the report lists them)."""

    hardware: Hardware = H800
    mtp_acceptance: float = 0.85  # DeepSeek-V3 report: the second token is accepted 85-90% of the time
    expert_skew: float = 0.5  # lognormal sigma of per-layer expert popularity (see experts.py)
    expert_policy: str = "eplb"  # or "contiguous": no expert balancer
    balancer: str = "load"  # the gateway's balancers (dsinfer.balancers.make_balancer kind)
    kv_growth_headroom: float = 0.05  # decode admits while this fraction of its KV pages stays free
    seed: int = 0


def expert_key(spec: PoolSpec, a: Assumptions) -> tuple[str, int, int, int, str, float, int]:
    """What a pool's expert model depends on."""
    return (
        spec.model,
        spec.pool_size,
        spec.gpus_per_node,
        spec.num_redundant_experts,
        a.expert_policy,
        float(a.expert_skew),
        a.seed,
    )


def pool_model(spec: PoolSpec, a: Assumptions, experts: ExpertModel | None = None) -> PoolModel:
    """The cost model of one pool. ``experts``: its expert model when already built (it depends only
    on :func:`expert_key`); :class:`dsinfer.sim.cache.SimCache` keeps both for repeated use."""
    shape = ModelShape.preset(spec.model)
    if experts is None:
        experts = expert_model(
            shape,
            spec.pool_size,
            spec.gpus_per_node,
            spec.num_redundant_experts,
            a.expert_policy,
            a.expert_skew,
            a.seed,
        )
    return PoolModel(
        shape,
        Kernels(a.hardware),
        experts,
        overlap=spec.overlap,
        # decode drafts one token per request per step; prefill runs the MTP layer over the prompt
        # (decode's MTP layer attends over that layer's KV, which prefill sends with the rest)
        mtp=spec.mtp,
        overlap_min_tokens=spec.overlap_min_tokens,
        comm_sms=spec.comm_sms,
    )


def chunking_weights(shape: ModelShape) -> tuple[float, float]:
    """(``attention_token_weight``, ``context_token_weight``) of attention-aware chunking for this
    model, from FLOPs at the datasheet's rate ratio (BF16 attention at half the FP8 GEMM rate): the
    causal query-key pairs whose core attention costs as much as one new token's attention-stage
    GEMMs (q/kv down-projections, q_b, kv_b, o_proj, the router in BF16), and one cached token's
    kv_b decompression relative to the same (DeepSeek-V3: about 2,330 pairs and 0.088). The engine
    takes the same two numbers (dsinfer.engine.scheduler.Scheduler). DeepSeek-V4 decompresses
    nothing and a query's rows are bounded, so chunking by attention cost does not apply to it."""
    if shape.v4 is not None:
        raise ValueError("attention-aware chunking models MLA's cost; DeepSeek-V4 chunks by tokens")
    kv_b = shape.kv_lora * shape.heads * (shape.nope_dim + shape.v_dim)
    per_token = (
        shape.hidden * (shape.q_lora + shape.latent_dim)
        + shape.q_lora * shape.heads * shape.qk_head
        + kv_b
        + shape.heads * shape.v_dim * shape.hidden
        + 2 * shape.hidden * shape.experts
    )
    # one pair: QK^T over qk_head and PV over v_dim per head, in MACs; BF16 at half the FP8 rate
    per_pair = 2 * shape.heads * (shape.qk_head + shape.v_dim)
    return per_token / per_pair, kv_b / per_token


def rank_shape(shape: ModelShape, spec: PoolSpec) -> RankShape:
    """One rank of the pool as the memory plan counts it: FP8 weights with BF16 embedding, head and
    absorbed kv_b copy, a BF16 latent cache (V3.2: and FP8 indexer keys), its routed slots, the MTP
    layer with --speculative-mtp."""
    mtp = shape.mtp_layers if spec.mtp else 0
    return RankShape(
        shape.config,
        BF16_BYTES,
        True,
        spec.pool_size,
        spec.num_redundant_experts,
        mtp,
        cache_bytes_per_token=shape.cache_bytes_per_layer,
    )


def kv_capacity_tokens(spec: PoolSpec, hw: Hardware) -> int:
    """Tokens one rank's KV pages hold, a whole number of pages (``ModelShape.page_tokens``)."""
    shape = ModelShape.preset(spec.model)
    if shape.v4 is not None:
        return v4_capacity_tokens(shape, spec, hw)
    rank = rank_shape(shape, spec)
    budget = spec.kv_cache_bytes
    if budget is None:
        budget = hw.hbm_bytes * (1 - ACTIVATION_RESERVE) - rank.weights().total
    per_token = rank.kv_bytes_per_token
    return max(0, int(budget // per_token) // shape.page_tokens * shape.page_tokens)


def v4_capacity_tokens(shape: ModelShape, spec: PoolSpec, hw: Hardware) -> int:
    """DeepSeek-V4 as the engine charges it (dsinfer/cache/v4_pool.py): FP8 linear layers and
    packed MXFP4 experts (the release's) on a GPU, the rank's expert slots; from the budget,
    ``max_num_seqs`` sequences' windows and compressor state and as many resume points are set
    aside (and, from what fits beside the weights, a PD rank's as many handoff slots, each at most
    a sequence's bounded part); the rest is pages of compressed entries and indexer keys."""
    v4 = shape.v4
    assert v4 is not None
    config = v4.config
    slots = expert_slots_per_rank(config.n_routed_experts, spec.num_redundant_experts, spec.pool_size)
    mtp = config.num_nextn_predict_layers if spec.mtp else 0
    counts = V4ParameterCounts.of(config, mtp)
    weights = counts.on_rank(BF16_BYTES, True, config.expert_dtype == "fp4", slots / config.n_routed_experts)
    cache = HybridCacheSpec.for_v4(config, "bfloat16", mtp_layers=mtp)
    budget = spec.kv_cache_bytes
    if budget is None:  # the handoff slots lie outside the KV budget
        budget = (
            hw.hbm_bytes * (1 - ACTIVATION_RESERVE) - weights.total - spec.max_num_seqs * cache.sequence_bytes
        )
    pages = int((budget - cache.reserve_bytes(spec.max_num_seqs)) // cache.charged_page_bytes)
    return max(0, pages) * cache.page_tokens
