"""Penalties, sampler filters and logprobs against transformers' logits processors and plain formulas;
seeded sampling is the same alone or in a mixed batch of 64."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from dsinfer.base.sampling_params import SamplingParams
from dsinfer.ops.logprobs import PROMPT_CHUNK, prompt_logprobs, token_ranks, top_logprobs
from dsinfer.ops.penalties import apply_penalties, penalty_state, record_tokens
from dsinfer.ops.sampling import SamplingTensors, filter_logits, gumbel_noise, sample

VOCAB = 97


def _logits(rows: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def _token_lists(rows: int, seed: int, max_len: int = 30) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len, (rows,), generator=gen).tolist()
    # a small id range so that tokens repeat within a row
    return [torch.randint(0, VOCAB // 3, (n,), generator=gen).tolist() for n in lengths]


def _neutral(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(rows), torch.zeros(rows)


# -- penalties --


def test_repetition_matches_transformers() -> None:
    rows = 8
    logits = _logits(rows, 0)
    prompts, outputs = _token_lists(rows, 1), _token_lists(rows, 2)
    prompts[0], outputs[1] = [], []
    reps = [1.3, 0.7, 2.0, 1.0, 1.05, 5.0, 0.2, 1.5]
    counts, mask = penalty_state(prompts, outputs, VOCAB)
    presence, frequency = _neutral(rows)
    ours = apply_penalties(logits, counts, mask, presence, frequency, torch.tensor(reps))
    for b in range(rows):
        ids = torch.tensor([prompts[b] + outputs[b]], dtype=torch.int64)
        ref = RepetitionPenaltyLogitsProcessor(reps[b])(ids, logits[b : b + 1].clone())
        torch.testing.assert_close(ours[b : b + 1], ref, rtol=0, atol=0)


def test_presence_frequency_match_per_token_formula() -> None:
    rows = 8
    logits = _logits(rows, 3)
    prompts, outputs = _token_lists(rows, 4), _token_lists(rows, 5)
    presence = [0.5, -1.0, 0.0, 2.0, 1.2, 0.0, -2.0, 0.3]
    frequency = [0.0, 0.4, -0.7, 2.0, 0.1, 1.5, -2.0, 0.0]
    repetition = [1.0, 1.2, 1.0, 0.8, 1.1, 1.0, 1.4, 1.0]
    counts, mask = penalty_state(prompts, outputs, VOCAB)
    ours = apply_penalties(
        logits, counts, mask, torch.tensor(presence), torch.tensor(frequency), torch.tensor(repetition)
    )
    expected = torch.empty(rows, VOCAB, dtype=torch.float64)
    for b in range(rows):
        for v in range(VOCAB):
            x = float(logits[b, v])
            count = outputs[b].count(v)
            if v in prompts[b] or count:
                x = x * repetition[b] if x < 0 else x / repetition[b]
            x -= frequency[b] * count
            if count:
                x -= presence[b]
            expected[b, v] = x
    torch.testing.assert_close(ours.double(), expected, rtol=1e-6, atol=1e-5)


def test_neutral_rows_unchanged_bit_for_bit() -> None:
    rows = 6
    logits = _logits(rows, 6)
    logits[:, ::7] = float("-inf")  # e.g. masked-out vocabulary padding
    prompts, outputs = _token_lists(rows, 7), _token_lists(rows, 8)
    outputs[0] = list(range(0, VOCAB, 7))  # the -inf tokens occur in the output as well
    counts, mask = penalty_state(prompts, outputs, VOCAB)
    presence = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.5, 0.0])
    frequency = torch.tensor([0.0, 0.0, 0.0, 0.3, 0.5, 0.0])
    repetition = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.3, 1.2])
    ours = apply_penalties(logits, counts, mask, presence, frequency, repetition)
    for b in (0, 2):
        assert torch.equal(ours[b], logits[b])
    assert not torch.isnan(ours).any()
    # nothing active at all: the logits come back untouched
    zero, _ = _neutral(rows)
    assert torch.equal(apply_penalties(logits, counts, mask, zero, zero, torch.ones(rows)), logits)


def test_penalty_state_and_record_tokens() -> None:
    prompts = [[1, 1, 4], [], [0, 96]]
    outputs = [[2, 2, 2, 5], [7], []]
    counts, mask = penalty_state(prompts, outputs, VOCAB)
    assert counts.shape == mask.shape == (3, VOCAB)
    assert counts.dtype == torch.int32 and mask.dtype == torch.bool
    for b in range(3):
        assert counts[b].tolist() == [outputs[b].count(v) for v in range(VOCAB)]
        assert mask[b].tolist() == [v in prompts[b] for v in range(VOCAB)]
    record_tokens(counts, torch.tensor([2, 7, 96]))
    assert (int(counts[0, 2]), int(counts[1, 7]), int(counts[2, 96])) == (4, 2, 1)
    assert int(counts.sum()) == 5 + 3
    empty_counts, empty_mask = penalty_state([], [], VOCAB)
    assert empty_counts.shape == empty_mask.shape == (0, VOCAB)
    with pytest.raises(ValueError, match="token ids"):
        penalty_state([[VOCAB]], [[]], VOCAB)
    with pytest.raises(ValueError, match="prompts"):
        penalty_state([[1]], [], VOCAB)


# -- filters against transformers' warpers --

# (temperature, top_k, top_p, min_p); 0 / 1.0 / 0.0 = off
FILTER_CASES = [
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 1.0, 0.0),
    (1.5, 10, 1.0, 0.0),
    (1.0, 1, 1.0, 0.0),
    (0.8, 0, 0.9, 0.0),
    (1.0, 0, 0.3, 0.0),
    (1.2, 0, 1.0, 0.05),
    (0.5, 0, 1.0, 0.3),
    (1.0, 20, 0.8, 0.0),
    (0.9, 30, 0.95, 0.02),
    (2.0, 5, 0.5, 0.1),
    (1.0, VOCAB + 5, 1.0, 0.0),
]


def _transformers_filter(logits: torch.Tensor, t: float, k: int, p: float, m: float) -> torch.Tensor:
    chain = LogitsProcessorList([TemperatureLogitsWarper(t)])
    if k > 0:
        chain.append(TopKLogitsWarper(k))
    if p < 1.0:
        chain.append(TopPLogitsWarper(p))
    if m > 0.0:
        chain.append(MinPLogitsWarper(m))
    return chain(torch.zeros(1, 1, dtype=torch.int64), logits[None].clone())[0]


def test_filters_match_transformers_warpers() -> None:
    logits = _logits(len(FILTER_CASES), 9)
    t, k, p, m = (list(col) for col in zip(*FILTER_CASES, strict=True))
    params = SamplingTensors.from_lists(t, top_k=k, top_p=p, min_p=m, seed=range(len(t)))
    ours = filter_logits(logits, params)
    for b, case in enumerate(FILTER_CASES):
        ref = _transformers_filter(logits[b], *case)
        assert torch.equal(torch.isinf(ours[b]), torch.isinf(ref)), case
        torch.testing.assert_close(torch.softmax(ours[b], -1), torch.softmax(ref, -1), rtol=0, atol=1e-6)


def test_greedy_rows_are_a_point_mass() -> None:
    logits = _logits(3, 10)
    params = SamplingTensors.from_lists([0.0, 1.0, 0.0], top_k=[5, 5, -1], seed=[1, 2, 3])
    probs = torch.softmax(filter_logits(logits, params), -1)
    for b in (0, 2):
        assert torch.equal(probs[b], torch.nn.functional.one_hot(logits[b].argmax(), VOCAB).float())
    assert int(torch.isfinite(probs[1].log()).sum()) == 5


def test_sample_draws_from_filter_logits() -> None:
    rows = 64
    logits = _logits(rows, 11)
    cases = [FILTER_CASES[i % len(FILTER_CASES)] for i in range(rows)]
    t, k, p, m = (list(col) for col in zip(*cases, strict=True))
    params = SamplingTensors.from_lists(t, top_k=k, top_p=p, min_p=m, seed=range(rows), position=[3] * rows)
    noise = gumbel_noise(params.seed, params.choice, params.position, VOCAB)
    expected = (filter_logits(logits, params) + noise).argmax(-1)
    assert sample(logits, params).tolist() == expected.tolist()


# -- logprobs --


def test_top_logprobs_match_log_softmax() -> None:
    logits = _logits(5, 12)
    sampled = torch.tensor([0, 5, 96, 40, 3])
    ref = torch.log_softmax(logits, -1)
    out = top_logprobs(logits, sampled, 4)
    torch.testing.assert_close(out.token_logprob, ref.gather(1, sampled[:, None]).squeeze(1))
    values, ids = ref.topk(4, -1)
    assert torch.equal(out.top_ids, ids) and out.top_ids.dtype == torch.int64
    torch.testing.assert_close(out.top_logprobs, values)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()  # best first
    token_logprob, top_ids, top_lp = top_logprobs(logits, sampled, 0)  # k = 0
    assert top_ids.shape == (5, 0) and top_lp.shape == (5, 0)
    torch.testing.assert_close(token_logprob, out.token_logprob)
    assert top_logprobs(logits, sampled, VOCAB + 10).top_ids.shape == (5, VOCAB)  # capped
    with pytest.raises(ValueError):
        top_logprobs(logits, sampled, -1)


def test_top_logprobs_fp32_from_any_dtype() -> None:
    logits = _logits(2, 13).double()
    out = top_logprobs(logits, torch.tensor([1, 2]), 2)
    assert out.token_logprob.dtype == out.top_logprobs.dtype == torch.float32
    torch.testing.assert_close(out.top_logprobs, torch.log_softmax(logits.float(), -1).topk(2).values)


def test_prompt_logprobs_chunked() -> None:
    length = PROMPT_CHUNK * 2 + 37
    logits = torch.randn(length, VOCAB, generator=torch.Generator().manual_seed(14)) * 2
    prompt = torch.randint(0, VOCAB, (length + 1,), generator=torch.Generator().manual_seed(15))
    out = prompt_logprobs(logits, prompt[1:], 3)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.token_logprob, ref.gather(1, prompt[1:, None]).squeeze(1))
    torch.testing.assert_close(out.top_logprobs, ref.topk(3, -1).values)
    assert torch.equal(out.top_ids, ref.topk(3, -1).indices)
    empty = prompt_logprobs(logits[:0], prompt[:0], 2)
    assert empty.token_logprob.shape == (0,) and empty.top_ids.shape == (0, 2)


def test_token_ranks() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0], [5.0, 5.0, 1.0, 0.0]])
    assert token_ranks(logits, torch.tensor([3, 0])).tolist() == [2, 1]
    assert token_ranks(logits, torch.tensor([2, 3])).tolist() == [4, 4]


# -- seeded sampling: alone == inside a mixed batch of 64 --


def _mixed_batch(rows: int) -> tuple[list[SamplingParams], list[int], list[int], list[int]]:
    gen = torch.Generator().manual_seed(16)
    params, seeds, choices, positions = [], [], [], []
    for i in range(rows):
        u = torch.rand(6, generator=gen).tolist()
        params.append(
            SamplingParams(
                temperature=0.0 if i % 9 == 0 else 0.3 + 1.5 * u[0],
                top_k=[-1, 0, 5, 40][i % 4],
                top_p=1.0 if i % 3 else 0.5 + 0.5 * u[1],
                min_p=0.0 if i % 5 else 0.2 * u[2],
                presence_penalty=0.0 if i % 2 else 2 * u[3] - 1,
                frequency_penalty=0.0 if i % 4 else u[4],
                repetition_penalty=1.0 if i % 6 else 0.5 + u[5],
            )
        )
        seeds.append(1000 + i // 4)  # groups of four rows share a seed ...
        choices.append(i % 4)  # ... as the n = 4 choices of one request
        positions.append(i % 7)
    return params, seeds, choices, positions


def _penalised_sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompts: list[list[int]],
    outputs: list[list[int]],
    seeds: list[int],
    choices: list[int],
    positions: list[int],
) -> torch.Tensor:
    counts, mask = penalty_state(prompts, outputs, logits.shape[1])
    x = apply_penalties(
        logits,
        counts,
        mask,
        torch.tensor([p.presence_penalty for p in params]),
        torch.tensor([p.frequency_penalty for p in params]),
        torch.tensor([p.repetition_penalty for p in params]),
    )
    return sample(x, SamplingTensors.from_params(params, seeds, choices, positions))


def test_seeded_token_same_alone_and_in_batch_of_64() -> None:
    rows = 64
    logits = _logits(rows, 17, scale=2.0)
    params, seeds, choices, positions = _mixed_batch(rows)
    prompts, outputs = _token_lists(rows, 18), _token_lists(rows, 19)
    batched = _penalised_sample(logits, params, prompts, outputs, seeds, choices, positions)
    for b in range(rows):
        alone = _penalised_sample(
            logits[b : b + 1], params[b : b + 1], prompts[b : b + 1], outputs[b : b + 1],
            seeds[b : b + 1], choices[b : b + 1], positions[b : b + 1],
        )  # fmt: skip
        assert int(alone[0]) == int(batched[b]), b
    # the same key with the same logits gives the same token in any row of a batch
    same = _penalised_sample(
        logits[5:6].expand(rows, -1), [params[5]] * rows, [prompts[5]] * rows, [outputs[5]] * rows,
        [seeds[5]] * rows, [choices[5]] * rows, [positions[5]] * rows,
    )  # fmt: skip
    assert set(same.tolist()) == {int(batched[5])}
    # and a different choice or position of the same seed is an independent draw
    flat = torch.zeros(rows, 1000)
    hot = SamplingParams(temperature=1.0)
    by_choice = _penalised_sample(
        flat, [hot] * rows, [[]] * rows, [[]] * rows, [7] * rows, list(range(rows)), [0] * rows
    )
    assert len(set(by_choice.tolist())) > 55
