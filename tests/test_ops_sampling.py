"""Seeded, batch-invariant sampling: greedy, reproducibility, distribution, filters."""

from __future__ import annotations

import pytest
import torch

from dsinfer.base.sampling_params import SamplingParams
from dsinfer.ops import Ops, SamplingTensors, compute_logprobs, select_ops
from dsinfer.ops.sampling import hash_uniform, row_argmax, sample, sample_rows, unit_interval

M32 = 0xFFFFFFFF


@pytest.fixture
def ops() -> Ops:
    return select_ops(torch.device("cpu"), prefer="torch")


# -- an independent pure-python statement of the hash (pins the bits across torch versions) --


def _mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def _absorb(h: int, word: int) -> int:
    return _mix32(((h ^ (word & M32)) + 0x9E3779B9) & M32)


def _py_uniform(seed: int, choice: int, position: int, v: int, draw: int = 0) -> float:
    h = _absorb(0x243F6A88, seed & M32)
    h = _absorb(h, (seed >> 32) & M32)  # python >> on negatives is arithmetic, like torch's
    h = _absorb(h, choice)
    h = _absorb(h, position)
    h = _absorb(h, draw)
    bits = _mix32(_absorb(h, v) ^ 0x5851F42D)
    return ((bits >> 9) + 0.5) / (1 << 23)


def test_hash_matches_pure_python() -> None:
    keys = [(0, 0, 0), (1234, 1, 7), (-5, 3, 2**40 + 3), (2**62 + 17, 0, 99), (-(2**63), 2, 1)]
    seed, choice, position = (torch.tensor(col, dtype=torch.int64) for col in zip(*keys, strict=True))
    for draw in (0, 3):
        u = hash_uniform(seed, choice, position, 9, draw)
        ref = torch.tensor([[_py_uniform(*key, v, draw) for v in range(9)] for key in keys])
        torch.testing.assert_close(u, ref, rtol=0, atol=0)
        assert (u > 0).all() and (u < 1).all()


def test_uniforms_stay_inside_the_unit_interval() -> None:
    """The extreme words map strictly inside (0, 1), so the Gumbel noise is finite."""
    bits = torch.tensor([0, 1, 2**31, 2**32 - 2, 2**32 - 1], dtype=torch.int64)
    u = unit_interval(bits)
    assert (u > 0).all() and (u < 1).all()
    assert torch.isfinite(-torch.log(-torch.log(u))).all()


def test_a_masked_token_is_never_drawn(ops: Ops) -> None:
    """At (seed 7, position 63746) token 35's hash word is 0xFFFFFFxx, whose uniform rounded to
    exactly 1.0 when it was taken from 24 bits: infinite noise, NaN next to a -inf logit, and
    argmax drew the masked token 35 instead of the only allowed one (a grammar-forced tool call
    then ended without its call)."""
    logits = torch.full((1, 64), float("-inf"))
    logits[0, 3] = 0.4
    params = SamplingTensors.from_lists([1.0], seed=[7], position=[63746])
    assert int(ops.sample(logits, params)[0]) == 3
    logits = torch.zeros(1, 64)
    logits[0, 35] = -1e4  # finite but hopeless: the noise must not lift it
    assert int(ops.sample(logits, params)[0]) != 35


def test_greedy_is_argmax(ops: Ops) -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    tokens = ops.sample(logits, SamplingTensors.greedy(6))
    assert tokens.dtype == torch.int64
    assert tokens.tolist() == logits.argmax(-1).tolist()
    # temperature 0 rows are greedy even with filters and seeds set
    params = SamplingTensors.from_lists([0.0, 1.0], top_k=[3, 3], top_p=[0.5, 0.5], seed=[1, 1])
    assert int(ops.sample(logits[:2], params)[0]) == int(logits[0].argmax())


def _mixed_params(n: int) -> SamplingTensors:
    return SamplingTensors.from_lists(
        temperature=[0.0, 0.7, 1.0, 1.3, 0.9, 1.0, 2.0, 0.5][:n],
        top_k=[-1, 5, 0, -1, 20, 3, -1, 50][:n],
        top_p=[1.0, 1.0, 0.8, 0.95, 1.0, 0.5, 0.9, 1.0][:n],
        min_p=[0.0, 0.0, 0.0, 0.05, 0.1, 0.0, 0.0, 0.2][:n],
        seed=[11, 12, 13, 14, 15, 16, 17, 2**40][:n],
        choice=[0, 0, 1, 2, 0, 0, 3, 1][:n],
        position=[0, 5, 9, 100, 3, 3, 7, 1][:n],
    )


def test_same_token_alone_or_batched(ops: Ops) -> None:
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(1)) * 3
    params = _mixed_params(8)
    batched = ops.sample(logits, params)
    for b in range(8):
        alone = ops.sample(logits[b : b + 1], params.index(torch.tensor([b])))
        assert int(alone[0]) == int(batched[b])
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(2))
    assert ops.sample(logits[perm], params.index(perm)).tolist() == batched[perm].tolist()
    assert ops.sample(logits, params).tolist() == batched.tolist()  # and again


def test_different_positions_seeds_and_choices_differ(ops: Ops) -> None:
    logits = torch.zeros(64, 1000)  # uniform distribution
    base = dict(temperature=[1.0] * 64)
    by_position = ops.sample(logits, SamplingTensors.from_lists(**base, seed=[7] * 64, position=range(64)))
    by_seed = ops.sample(logits, SamplingTensors.from_lists(**base, seed=range(64)))
    by_choice = ops.sample(logits, SamplingTensors.from_lists(**base, seed=[7] * 64, choice=range(64)))
    for draws in (by_position, by_seed, by_choice):
        assert len(set(draws.tolist())) > 55  # 64 draws from 1000: collisions are rare


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.shape[0]).double()
    expected = probs.double() * tokens.shape[0]
    keep = expected > 0
    assert (counts[~keep] == 0).all()
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_distribution_matches_softmax(ops: Ops) -> None:
    draws = 20000
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5])
    temperature = 0.7
    params = SamplingTensors.from_lists([temperature] * draws, seed=[42] * draws, position=range(draws))
    tokens = ops.sample(logits.expand(draws, -1), params)
    # 5 degrees of freedom: P(chi2 > 30) ~ 1.5e-5. Sampling at T = 1 instead gives chi2 in the thousands.
    assert _chi_square(tokens, torch.softmax(logits / temperature, -1)) < 30
    assert _chi_square(tokens, torch.softmax(logits, -1)) > 200


def test_filtered_distribution(ops: Ops) -> None:
    draws = 20000
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5, 1.5, -0.2])
    params = SamplingTensors.from_lists(
        [1.0] * draws, top_k=[4] * draws, seed=[3] * draws, position=range(draws)
    )
    tokens = ops.sample(logits.expand(draws, -1), params)
    kept = logits.topk(4).indices
    probs = torch.zeros_like(logits)
    probs[kept] = torch.softmax(logits[kept], -1)
    assert _chi_square(tokens, probs) < 30


def _nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    order = probs.argsort(descending=True).tolist()
    kept, total = [], 0.0
    for v in order:
        kept.append(v)
        total += float(probs[v])
        if total >= top_p:
            break
    return set(kept)


def test_filters_never_pick_filtered_tokens(ops: Ops) -> None:
    gen = torch.Generator().manual_seed(4)
    rows, vocab = 400, 60
    logits = torch.randn(rows, vocab, generator=gen) * 2
    temperature = 0.8
    for kind in ("top_k", "top_p", "min_p", "all"):
        params = SamplingTensors.from_lists(
            [temperature] * rows,
            top_k=[5 if kind in ("top_k", "all") else -1] * rows,
            top_p=[0.6 if kind in ("top_p", "all") else 1.0] * rows,
            min_p=[0.2 if kind in ("min_p", "all") else 0.0] * rows,
            seed=range(rows),
        )
        tokens = ops.sample(logits, params)
        probs = torch.softmax(logits / temperature, -1)
        for r in range(rows):
            t, p = int(tokens[r]), probs[r]
            allowed = set(range(vocab))
            if kind in ("top_k", "all"):
                allowed &= set(p.topk(5).indices.tolist())
            if kind in ("top_p", "all"):
                q = torch.zeros_like(p)
                idx = torch.tensor(sorted(allowed))
                q[idx] = p[idx] / p[idx].sum()
                allowed &= _nucleus(q, 0.6)
            if kind in ("min_p", "all"):
                allowed &= {v for v in allowed if p[v] >= 0.2 * p.max() * (1 - 1e-6)}
            assert t in allowed, (kind, r)


def test_top_p_zero_keeps_the_best_token(ops: Ops) -> None:
    logits = torch.randn(10, 30, generator=torch.Generator().manual_seed(5))
    params = SamplingTensors.from_lists([1.0] * 10, top_p=[0.0] * 10, seed=range(10))
    assert ops.sample(logits, params).tolist() == logits.argmax(-1).tolist()


def test_sampling_tensors_helpers() -> None:
    p = SamplingTensors.from_lists([0.5, 1.0], top_k=[3, -1], seed=[1, 2])
    assert len(p) == 2 and p.top_k.dtype == torch.int32 and p.seed.dtype == torch.int64
    assert p.top_p.tolist() == [1.0, 1.0] and p.min_p.tolist() == [0.0, 0.0]
    assert p.position.dtype == torch.int64 and p.choice.dtype == torch.int64
    g = SamplingTensors.greedy(3)
    assert g.temperature.tolist() == [0.0] * 3 and g.top_k.tolist() == [-1] * 3
    assert len(SamplingTensors.greedy(0)) == 0
    with pytest.raises(ValueError):
        SamplingTensors.from_lists([1.0, 1.0], top_k=[1])


def test_empty_batch_and_logprobs(ops: Ops) -> None:
    assert ops.sample(torch.empty(0, 10), SamplingTensors.greedy(0)).shape == (0,)
    logits = torch.randn(3, 7, dtype=torch.float64)
    lp = compute_logprobs(logits)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(3))


def test_sample_rows_takes_greedy_rows_argmax_and_samples_the_others_with_their_parameters() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 50, generator=gen)
    greedy = [SamplingParams(temperature=0.0)] * 3

    def refuse(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        raise AssertionError("greedy rows need no sampler")

    rows = sample_rows(refuse, logits, greedy, seed=[0] * 3, choice=[0] * 3, position=[0] * 3)
    assert rows.tolist() == logits.argmax(dim=-1).tolist()

    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=5), greedy[0]]
    args = {"seed": [1, 2, 3], "choice": [0, 1, 0], "position": [4, 5, 6]}
    drawn = sample_rows(sample, logits, mixed, **args)
    assert drawn.tolist() == sample(logits, SamplingTensors.from_params(mixed, **args)).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_is_argmax_with_ties_nan_and_inf(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        rows, width = (
            int(torch.randint(0, 70, (1,), generator=g)),
            int(torch.randint(1, 5000, (1,), generator=g)),
        )
        x = torch.randint(-3, 4, (rows, width), generator=g).float()  # many ties
        u = torch.rand(rows, width, generator=g)
        x[u < 0.01] = float("nan")
        x[(u > 0.5) & (u < 0.51)] = float("inf")
        x[(u > 0.6) & (u < 0.7)] = float("-inf")
        x = x.to(dtype)
        assert torch.equal(row_argmax(x), x.argmax(dim=-1))
