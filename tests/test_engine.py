"""The batched engine against transformers: continuous batching, chunked prefill, prefix-cache and
disk-tier hits, preemption, logprobs, seeded sampling, and bad input."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dsinfer import LLM, SamplingParams
from harness.checkpoints import BuiltCheckpoint
from harness.hf_reference import compare, compare_tokens, hf_greedy_steps, hf_logits

pytestmark = pytest.mark.system

GREEDY = SamplingParams(temperature=0, max_tokens=10)


def _prompts(count: int, seed: int, shared_prefix: int = 0) -> list[list[int]]:
    """Mixed lengths 3..150; the first half share a ``shared_prefix``-token prefix."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(2, 4096, (shared_prefix,), generator=g).tolist()
    prompts = []
    for i in range(count):
        n = int(torch.randint(3, 150, (1,), generator=g))
        body = torch.randint(2, 4096, (n,), generator=g).tolist()
        prompts.append(prefix + body if i < count // 2 else body)
    return prompts


def make_llm(ckpt: BuiltCheckpoint, **kwargs: object) -> LLM:
    """The offline engine on ``ckpt`` in float32 with a small KV cache and step budget (``kwargs`` on top)."""
    defaults: dict[str, object] = {
        "dtype": "float32",
        "kv_cache_memory": "16MiB",
        "max_num_batched_tokens": 48,
    }
    return LLM(str(ckpt.path), **{**defaults, **kwargs})


@pytest.fixture
def llm(tiny_ckpt: BuiltCheckpoint) -> Iterator[LLM]:
    engine = make_llm(tiny_ckpt)
    yield engine
    assert engine.engine.kv.num_available_pages() == engine.engine.kv.num_pages, "KV pages leaked"
    engine.engine.close()


def _page_bytes(ckpt: BuiltCheckpoint) -> int:
    config = ckpt.hf_model.config  # 64 tokens x (kv_lora_rank + rope) x fp32 x layers (no MTP layer loaded)
    return 64 * (config.kv_lora_rank + config.qk_rope_head_dim) * 4 * config.num_hidden_layers


def _check_greedy(ckpt: BuiltCheckpoint, prompts: list[list[int]], outputs: list, max_tokens: int) -> None:
    for prompt, out in zip(prompts, outputs, strict=True):
        ref, ref_logits = hf_greedy_steps(ckpt.hf_model, prompt, max_tokens, eos_ids=(1,))
        compare_tokens(ref, out.outputs[0].token_ids, ref_logits)


def test_greedy_batch_with_prefix_hits_and_disk_restart(tiny_ckpt: BuiltCheckpoint, tmp_path: Path) -> None:
    prompts = _prompts(32, seed=1, shared_prefix=140)
    disk = tmp_path / "kv-disk"
    first = make_llm(tiny_ckpt, kv_disk_cache_dir=disk)
    outputs = first.generate(prompts, GREEDY, use_tqdm=False)
    stats = first.engine.scheduler.stats
    assert first.engine.kv.stats.memory_hit_tokens > 0, "prompts sharing a prefix should hit the cache"
    assert stats.prompt_tokens_computed < stats.prompt_tokens_submitted
    _check_greedy(tiny_ckpt, prompts, outputs, 10)
    assert first.engine.kv.num_available_pages() == first.engine.kv.num_pages
    first.engine.close()  # flushes the disk writes

    restarted = make_llm(tiny_ckpt, kv_disk_cache_dir=disk)
    again = restarted.generate(prompts[:8], GREEDY, use_tqdm=False)
    kv = restarted.engine.kv.stats
    assert kv.disk_hit_tokens > 0, kv
    sched = restarted.engine.scheduler.stats
    assert sched.prompt_tokens_computed < sched.prompt_tokens_submitted
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs[:8]]
    restarted.engine.close()


def test_preemption_gives_the_same_tokens(tiny_ckpt: BuiltCheckpoint) -> None:
    prompts = _prompts(12, seed=2)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = make_llm(tiny_ckpt, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = make_llm(tiny_ckpt, kv_cache_memory=6 * _page_bytes(tiny_ckpt), enable_prefix_caching=False)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.scheduler.stats.preemptions > 0
    assert got == expected
    assert tight.engine.kv.num_available_pages() == tight.engine.kv.num_pages


def test_attention_aware_chunking_gives_the_same_tokens(tiny_ckpt: BuiltCheckpoint) -> None:
    """Chunks sized by attention cost (long cached contexts get short chunks) change only how
    prompts are split over steps, never the tokens."""
    prompts = _prompts(8, seed=4, shared_prefix=140)
    plain = make_llm(tiny_ckpt)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    chunked = make_llm(tiny_ckpt, prefill_attention_weight=64.0, prefill_context_weight=0.05)
    got = [o.outputs[0].token_ids for o in chunked.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected
    # the same prompt tokens took more steps: chunks were cut by their attention cost
    assert chunked.engine.scheduler.stats.steps > plain.engine.scheduler.stats.steps
    assert chunked.engine.kv.num_available_pages() == chunked.engine.kv.num_pages


def test_logprobs_match_transformers(llm: LLM, tiny_ckpt: BuiltCheckpoint) -> None:
    prompt = _prompts(1, seed=3)[0][:30]
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=4, prompt_logprobs=3)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    full = prompt + out.outputs[0].token_ids
    reference = torch.log_softmax(hf_logits(tiny_ckpt.hf_model, full), dim=-1)
    for step, (token, entry) in enumerate(
        zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True)
    ):
        ref = reference[len(prompt) - 1 + step]
        assert token in entry and len(entry) in (4, 5)
        ids = torch.tensor(list(entry))
        compare(ref[ids], torch.tensor(list(entry.values())).unsqueeze(0).squeeze(0))
        assert set(torch.topk(ref, 4).indices.tolist()) <= set(entry)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert prompt[pos] in entry
        compare(reference[pos - 1][prompt[pos]].reshape(1), torch.tensor([entry[prompt[pos]]]))


def test_seeded_sampling_is_batch_invariant(llm: LLM) -> None:
    prompts = _prompts(64, seed=4)
    target = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=8)
    alone = llm.generate([prompts[5]], target, use_tqdm=False)[0].outputs[0].token_ids
    mixed = [SamplingParams(temperature=0.7, seed=i, max_tokens=6, min_p=0.05) for i in range(64)]
    mixed[5] = target
    batched = llm.generate(prompts, mixed, use_tqdm=False)[5].outputs[0].token_ids
    assert alone == batched


def test_n_choices_stop_strings_and_token_ids(llm: LLM) -> None:
    prompt = _prompts(1, seed=5)[0]
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6), use_tqdm=False)[
        0
    ]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # choices draw independently
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    stop_id = greedy.token_ids[3]
    cut = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id]), use_tqdm=False
    )
    assert cut[0].outputs[0].token_ids == greedy.token_ids[: greedy.token_ids.index(stop_id) + 1]
    assert cut[0].outputs[0].finish_reason == "stop"
    text = greedy.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        stopped = llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=8, stop=[stop]), use_tqdm=False
        )
        assert stopped[0].outputs[0].text == text[: text.index(stop)]
        assert stopped[0].outputs[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "prompt 1 is empty"),
        ("", SamplingParams(), "prompt 1 is empty"),
        (list(range(2, 600)), SamplingParams(), "max_model_len"),
        ([5, 99999], SamplingParams(), "token ids must be in"),
    ],
)
def test_bad_input_names_the_problem(
    llm: LLM, prompt: list[int] | str, params: SamplingParams, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate([[3, 4], prompt], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_request_larger_than_the_whole_pool_is_refused(tiny_ckpt: BuiltCheckpoint) -> None:
    small = make_llm(tiny_ckpt, kv_cache_memory=4 * _page_bytes(tiny_ckpt))
    assert small.engine.kv.num_pages == 4
    with pytest.raises(ValueError, match="whole KV cache has 4 pages"):
        small.generate([[5, 6]], SamplingParams(max_tokens=400), use_tqdm=False)
    assert small.generate([[5, 6]], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids
    assert small.engine.kv.num_available_pages() == 4


@pytest.mark.parametrize(
    ("field", "value"), [("max_tokens", 0), ("top_p", 0.0), ("top_p", 1.5), ("n", 0), ("temperature", -1.0)]
)
def test_bad_sampling_params(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_abort_frees_everything(llm: LLM) -> None:
    engine = llm.engine
    prompts = _prompts(6, seed=6)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.kv.num_available_pages() < engine.kv.num_pages
    engine.abort_request("r1")
    engine.abort_request("r4")
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step()
    assert sorted(o.request_id for o in finished) == ["r0", "r2", "r3", "r5"]
    # the llm fixture asserts that every page is back
