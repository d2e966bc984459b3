"""Token sampling: per-row temperature / top-k / top-p / min-p with a counter-based generator.

Reproducibility: the random numbers are not drawn from a stateful generator but computed by an
integer hash of ``(seed, choice, position, draw, vocab index)``, so a row gets the same token
whether it is sampled alone or in any batch, on a prefill or a decode rank, in any process. The
hash works on 32-bit words held in int64 tensors and never overflows (multiplications are split
into 16-bit halves), so the bits are identical on every device and torch version. A uniform
``u`` per vocab entry becomes Gumbel noise ``-log(-log(u))`` and the token is
``argmax(filtered logits / T + noise)`` (the Gumbel-max trick draws exactly from
``softmax(filtered logits / T)``). The only cross-device difference possible is the last-ulp
rounding of ``log`` between CPU and GPU math libraries.

Filters, applied to the temperature-scaled logits in this order: top-k (``<= 0`` off), top-p
(nucleus: keep the smallest prefix of the sorted distribution whose cumulative probability reaches
``top_p``; at least one token; ``>= 1`` off), min-p (keep tokens with ``p >= min_p * p_max``;
``0`` off). Rows with ``temperature < 1e-5`` are greedy (argmax of the logits given).
:func:`filter_logits` exposes the distribution a row is drawn from (the scaled, filtered logits).

Penalties (presence / frequency / repetition) are not part of this module: the engine applies
:func:`dsinfer.ops.penalties.apply_penalties` to the logits before calling :func:`sample`, and
reports logprobs (:mod:`dsinfer.ops.logprobs`) from the raw logits before both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch

from dsinfer.base.sampling_params import GREEDY_TEMPERATURE, SamplingParams

__all__ = [
    "GREEDY_TEMPERATURE",
    "SamplingTensors",
    "compute_logprobs",
    "filter_logits",
    "gumbel_noise",
    "hash_uniform",
    "sample",
    "sample_rows",
]

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters of one batch (all tensors ``[B]`` on the logits' device)."""

    temperature: torch.Tensor  # f32; < 1e-5 (e.g. 0) = greedy
    top_k: torch.Tensor  # int32; <= 0 = off
    top_p: torch.Tensor  # f32; >= 1 = off
    min_p: torch.Tensor  # f32; 0 = off
    seed: torch.Tensor  # int64
    choice: torch.Tensor  # int64; index among the n choices of a request
    position: torch.Tensor  # int64; output position of the token being drawn

    @classmethod
    def from_lists(
        cls,
        temperature: Sequence[float],
        top_k: Sequence[int] | None = None,
        top_p: Sequence[float] | None = None,
        min_p: Sequence[float] | None = None,
        seed: Sequence[int] | None = None,
        choice: Sequence[int] | None = None,
        position: Sequence[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingTensors:
        """Build from python lists (one entry per row); omitted lists take the "off"/zero default."""
        n = len(temperature)

        def col(
            values: Sequence[float] | Sequence[int] | None, default: float, dtype: torch.dtype
        ) -> torch.Tensor:
            vals = [default] * n if values is None else list(values)
            if len(vals) != n:
                raise ValueError(f"sampling parameter lists differ in length: {len(vals)} != {n}")
            return torch.tensor(vals, dtype=dtype, device=device)

        return cls(
            temperature=col(temperature, 0.0, torch.float32),
            top_k=col(top_k, -1, torch.int32),
            top_p=col(top_p, 1.0, torch.float32),
            min_p=col(min_p, 0.0, torch.float32),
            seed=col(seed, 0, torch.int64),
            choice=col(choice, 0, torch.int64),
            position=col(position, 0, torch.int64),
        )

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        seed: Sequence[int],
        choice: Sequence[int],
        position: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> SamplingTensors:
        """One row per entry of ``params``; ``seed`` is the request's resolved seed (the engine
        draws one at admission for ``seed=None``), ``choice`` its index among ``n``, ``position``
        the output position being drawn."""
        return cls.from_lists(
            temperature=[p.temperature for p in params],
            top_k=[p.top_k for p in params],
            top_p=[p.top_p for p in params],
            min_p=[p.min_p for p in params],
            seed=seed,
            choice=choice,
            position=position,
            device=device,
        )

    @classmethod
    def greedy(cls, batch_size: int, device: torch.device | str = "cpu") -> SamplingTensors:
        return cls.from_lists([0.0] * batch_size, device=device)

    def __len__(self) -> int:
        return self.temperature.shape[0]

    def to(self, device: torch.device | str) -> SamplingTensors:
        return type(self)(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def index(self, rows: torch.Tensor) -> SamplingTensors:
        """The parameters of a subset of rows."""
        return type(self)(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2^32`` for ``x`` in ``[0, 2^32)`` without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche permutation (xorshift-multiply, "lowbias32" constants)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _absorb(h: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
    return _mix32(((h ^ (word & _M32)) + _GOLDEN) & _M32)


def _row_key(seed: torch.Tensor, choice: torch.Tensor, position: torch.Tensor, draw: int) -> torch.Tensor:
    seed = seed.long()
    h = _absorb(torch.full_like(seed, 0x243F6A88), seed)
    h = _absorb(h, (seed >> 32) & _M32)
    h = _absorb(h, choice.long())
    h = _absorb(h, position.long())
    return _absorb(h, torch.full_like(h, draw))


def unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """32-bit words -> fp32 uniforms strictly inside (0, 1): the top 23 bits plus a half, over 2^23.

    Every value ``k + 0.5`` with ``k < 2^23`` is exact in fp32, so ``u`` lies in [2^-24, 1 - 2^-24].
    (With 24 bits, ``2^24 - 0.5`` rounds to ``2^24`` and ``u`` is exactly 1: its Gumbel noise is
    +inf, which wins the argmax over every finite logit, and next to a -inf (filtered or
    grammar-masked) logit makes NaN, which argmax also picks: with a 129K vocabulary that drew a
    disallowed token in about 1 of 130 sampled positions.)"""
    return ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))


def hash_uniform(
    seed: torch.Tensor, choice: torch.Tensor, position: torch.Tensor, vocab_size: int, draw: int = 0
) -> torch.Tensor:
    """Uniforms in (0, 1), fp32 ``[B, vocab_size]``, a pure function of (seed, choice, position, draw, v)."""
    key = _row_key(seed, choice, position, draw)  # [B]
    vocab = torch.arange(vocab_size, dtype=torch.int64, device=key.device)
    return unit_interval(_mix32(_absorb(key[:, None], vocab[None, :]) ^ 0x5851F42D))


def gumbel_noise(
    seed: torch.Tensor, choice: torch.Tensor, position: torch.Tensor, vocab_size: int, draw: int = 0
) -> torch.Tensor:
    """Finite Gumbel noise (at most about 16.6): a disallowed token's -inf logit stays -inf."""
    return -torch.log(-torch.log(hash_uniform(seed, choice, position, vocab_size, draw)))


def _filter(x: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Mask (-inf) what top-k, top-p and min-p remove from the scaled logits ``x [B, V]``."""
    vocab = x.shape[1]
    top_k, top_p = params.top_k.long(), params.top_p.float()
    k_on = (top_k > 0) & (top_k < vocab)
    p_on = top_p < 1.0
    if bool((k_on | p_on).any()):
        sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab, device=x.device)[None, :]
        keep = rank < torch.where(k_on, top_k, vocab)[:, None]
        sorted_x = sorted_x.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # probability mass ranked above each token
        keep &= (before < top_p[:, None]) | ~p_on[:, None]
        keep[:, 0] = True
        keep = torch.zeros_like(keep).scatter_(1, order, keep)
        x = x.masked_fill(~keep, float("-inf"))
    min_p = params.min_p.float()
    if bool((min_p > 0).any()):
        # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p); log(0) = -inf keeps everything.
        threshold = x.max(dim=-1, keepdim=True).values + torch.log(min_p.clamp_min(0.0))[:, None]
        x = x.masked_fill(x < threshold, float("-inf"))
    return x


def _scaled_filtered(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """``logits / T`` with filtered tokens at -inf, for rows that all have ``T >= 1e-5``."""
    return _filter(logits / params.temperature.float()[:, None], params)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D tensor. On CPU through ``max(dim=-1)``, which returns the same
    index (the first maximal one, a NaN counting as maximal) in a third of the time at [64, 4096]."""
    return x.max(dim=-1).indices if x.is_cpu else x.argmax(dim=-1)


def filter_logits(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """The logits whose softmax is the distribution :func:`sample` draws each row from.

    Sampled rows: ``logits / T`` after top-k, top-p and min-p, removed tokens at ``-inf``. Greedy
    rows: the argmax keeps its logit and every other token is ``-inf`` (a point mass).
    """
    logits = logits.float()
    sampled = params.temperature.float() >= GREEDY_TEMPERATURE
    greedy = row_argmax(logits)[:, None]
    out = torch.full_like(logits, float("-inf")).scatter_(1, greedy, logits.gather(1, greedy))
    if logits.shape[0] == 0 or not bool(sampled.any()):
        return out
    rows = sampled.nonzero().squeeze(1)
    return out.index_copy(0, rows, _scaled_filtered(logits[rows], params.index(rows)))


def sample(logits: torch.Tensor, params: SamplingTensors, draw: int = 0) -> torch.Tensor:
    """Draw one token per row of ``logits`` (fp32 ``[B, V]``) -> int64 ``[B]``.

    ``draw`` numbers independent draws at the same (seed, choice, position), e.g. for speculative
    decoding; ordinary decoding leaves it 0.
    """
    logits = logits.float()
    tokens = row_argmax(logits)
    temperature = params.temperature.float()
    sampled = temperature >= GREEDY_TEMPERATURE
    if logits.shape[0] == 0 or not bool(sampled.any()):
        return tokens
    rows = sampled.nonzero().squeeze(1)
    sub = params.index(rows)
    x = _scaled_filtered(logits[rows], sub)
    noise = gumbel_noise(sub.seed, sub.choice, sub.position, logits.shape[1], draw)
    return tokens.index_copy(0, rows, row_argmax(x + noise))


def sample_rows(
    sample: Callable[[torch.Tensor, SamplingTensors], torch.Tensor],
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seed: Sequence[int],
    choice: Sequence[int],
    position: Sequence[int],
) -> torch.Tensor:
    """``sample`` (an ``Ops`` backend's) over one row of ``logits`` per entry of ``params``, with
    the parameters :meth:`SamplingTensors.from_params` takes. When every row is greedy the rows
    take their argmax, as every backend draws them, without building the parameter tensors."""
    if all(p.is_greedy for p in params):
        return row_argmax(logits.float())
    tensors = SamplingTensors.from_params(
        params, seed=seed, choice=choice, position=position, device=logits.device
    )
    return sample(logits, tensors)


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the vocabulary, fp32."""
    return torch.log_softmax(logits.float(), dim=-1)
