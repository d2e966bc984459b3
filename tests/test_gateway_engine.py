"""The gateway over a real engine (tests/fixtures/engine_backend.py) behind uvicorn, driven with the
official openai client: greedy and seeded outputs equal the offline LLM's token for token, n > 1,
array prompts, stop strings, logprobs, cached prompt tokens, R1 reasoning, 429 when the queue is
full, /metrics, and client disconnects that abort the request and free its KV pages."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from dsinfer import LLM, SamplingParams
from dsinfer.engine.args import EngineArgs
from dsinfer.engine.engine import LLMEngine
from dsinfer.engine.outputs import CompletionOutput
from dsinfer.gateway.app import build_app
from dsinfer.gateway.args import GatewayArgs
from tests.fixtures.engine_backend import EngineBackend, serve

ENGINE = {"model": "tiny", "load_format": "dummy", "dtype": "float32", "kv_cache_memory": "64MiB"}
PROMPTS = ["Hello world", "The quick brown fox jumps", "1 2 3 4"]
THINK_END = 5  # "</think>" in the tiny tokenizer


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    engine = LLMEngine(EngineArgs(**ENGINE))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def offline() -> Iterator[LLM]:
    llm = LLM(**ENGINE)
    yield llm
    llm.engine.close()


@pytest.fixture(scope="module")
def backend(engine: LLMEngine) -> EngineBackend:
    return EngineBackend(engine)


def _app(backend: EngineBackend, **args: Any) -> Any:
    engine = backend.engine
    return build_app(
        backend, engine.tokenizer, GatewayArgs(**{"model": "tiny", **args}), engine.config.vocab_size
    )


@pytest.fixture(scope="module")
def url(backend: EngineBackend) -> Iterator[str]:
    with serve(_app(backend, max_queued_requests=3)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def _generate(offline: LLM, prompts: list[Any], params: SamplingParams) -> list[list[CompletionOutput]]:
    return [out.outputs for out in offline.generate(prompts, params, use_tqdm=False)]


def _ids(tokens: list[str] | None) -> list[int]:
    assert tokens is not None
    return [int(t.removeprefix("token_id:")) for t in tokens]


IDS = {"return_tokens_as_token_ids": True}


def test_completions_equal_offline(client: openai.OpenAI, offline: LLM) -> None:
    reference = _generate(offline, PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    result = client.completions.create(
        model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0, logprobs=0, extra_body=IDS
    )
    assert len(result.choices) == len(PROMPTS)
    for choice, [ref] in zip(result.choices, reference, strict=True):
        assert choice.logprobs is not None
        assert _ids(choice.logprobs.tokens) == ref.token_ids
        assert choice.text == ref.text
        assert choice.finish_reason == ref.finish_reason
    assert result.usage is not None
    assert result.usage.completion_tokens == sum(len(ref.token_ids) for [ref] in reference)
    assert result.usage.prompt_tokens == sum(len(offline.get_tokenizer().encode(p)) for p in PROMPTS)

    for prompt, [ref] in zip(PROMPTS, reference, strict=True):
        stream = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True, logprobs=0, extra_body=IDS
        )
        chunks = [c.choices[0] for c in stream]
        assert "".join(c.text for c in chunks) == ref.text
        assert [t for c in chunks if c.logprobs for t in _ids(c.logprobs.tokens)] == ref.token_ids
        assert chunks[-1].finish_reason == ref.finish_reason


def test_chat_equals_offline(client: openai.OpenAI, offline: LLM) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is MLA?"}]
    tokenizer = offline.get_tokenizer()
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    [ref] = _generate(offline, [prompt], SamplingParams(temperature=0, max_tokens=10, logprobs=3))[0]
    response = client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=10, temperature=0, logprobs=True, top_logprobs=3,
        extra_body=IDS,
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.message.content == ref.text
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content] == ref.token_ids
    for entry, ref_logprobs in zip(choice.logprobs.content, ref.logprobs or [], strict=True):
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(max(ref_logprobs.values()), abs=1e-4)
    assert response.usage is not None and response.usage.prompt_tokens == len(prompt)

    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_seeded_sampling_with_n(client: openai.OpenAI, offline: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, top_k=50, seed=1234, max_tokens=8)
    reference = _generate(offline, [PROMPTS[1]], params)[0]
    result = client.completions.create(
        model="tiny", prompt=PROMPTS[1], n=3, temperature=1.0, seed=1234, max_tokens=8, logprobs=0,
        extra_body={"top_k": 50, **IDS},
    )  # fmt: skip
    got = sorted(result.choices, key=lambda c: c.index)
    assert [_ids(c.logprobs.tokens) for c in got if c.logprobs] == [r.token_ids for r in reference]
    assert [c.text for c in got] == [r.text for r in reference]
    assert len({tuple(r.token_ids) for r in reference}) > 1, "the choices should differ"

    stream = client.completions.create(
        model="tiny", prompt=PROMPTS[1], n=3, temperature=1.0, seed=1234, max_tokens=8, stream=True,
        extra_body={"top_k": 50},
    )  # fmt: skip
    texts = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [r.text for r in reference]


def test_array_of_token_prompts_with_n(client: openai.OpenAI, offline: LLM) -> None:
    tokenizer = offline.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS[:2]]
    reference = _generate(offline, prompts, SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=6))
    result = client.completions.create(
        model="tiny", prompt=prompts, n=2, temperature=0.8, seed=7, max_tokens=6
    )
    assert [c.text for c in sorted(result.choices, key=lambda c: c.index)] == [
        out.text for outs in reference for out in outs
    ]


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_equal_offline(client: openai.OpenAI, offline: LLM, include: bool) -> None:
    [free] = _generate(offline, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=16))[0]
    stop = free.text[12:15]
    [ref] = _generate(
        offline, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=16, stop=[stop, "@@@"])
    )[0]
    assert ref.finish_reason == "stop" and stop not in ref.text
    expected = ref.text + stop if include else ref.text
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0}
    kwargs |= {"stop": [stop, "@@@"], "extra_body": {"include_stop_str_in_output": include}}
    result = client.completions.create(**kwargs)
    assert (result.choices[0].text, result.choices[0].finish_reason) == (expected, "stop")
    pieces = [c.choices[0].text for c in client.completions.create(stream=True, **kwargs)]
    assert "".join(pieces) == expected


def test_prompt_logprobs_and_cached_tokens(client: openai.OpenAI, offline: LLM) -> None:
    prompt = list(range(100, 100 + 150))  # more than two 64-token pages
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None and second.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 128
    assert first.choices[0].text == second.choices[0].text

    ref = offline.generate([prompt[:8]], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    result = client.completions.create(
        model="tiny", prompt=prompt[:8], max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    got = result.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert got[0] is None and len(got) == 8
    for position, ref_position in zip(got[1:], ref.prompt_logprobs[1:], strict=True):  # type: ignore[index]
        assert {int(t): v["logprob"] for t, v in position.items()} == pytest.approx(ref_position, abs=1e-4)


def test_r1_reasoning_with_forced_think_end(backend: EngineBackend) -> None:
    """logit_bias makes the model emit "</think>" at every step: what follows the first one is content."""
    with serve(_app(backend, reasoning_parser="deepseek-r1")) as base:
        r1 = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        response = r1.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
            logit_bias={str(THINK_END): 100},
        )  # fmt: skip
        message = response.choices[0].message
        assert getattr(message, "reasoning_content", None) is None
        assert message.content == "</think></think>"  # the first one ended the (empty) thinking
        free = r1.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, logprobs=True,
            extra_body=IDS,
        )  # fmt: skip
        assert free.choices[0].message.content is None  # no "</think>" yet: all of it is thinking
        assert getattr(free.choices[0].message, "reasoning_content", None)


def test_queue_full_gets_429(url: str, client: openai.OpenAI, backend: EngineBackend) -> None:
    """The gateway allows 3 queued jobs (max_queued_requests=3), the backend 2 (its own cap)."""
    backend.pause()
    pool = ThreadPoolExecutor(4)
    try:
        waiting = [
            pool.submit(client.completions.create, model="tiny", prompt="hi", max_tokens=2) for _ in range(2)
        ]
        deadline = time.monotonic() + 10
        while backend.metrics_snapshot().queue_length < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        backend.max_queued = 2
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"})
        assert response.status_code == 429 and response.headers["retry-after"] == "2"
        assert response.json()["error"]["type"] == "rate_limit_error"
        backend.max_queued = 1024
        waiting.append(pool.submit(client.completions.create, model="tiny", prompt="hi", max_tokens=2))
        while backend.metrics_snapshot().queue_length < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError):  # the gateway's own bound: 3 already queued
            client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    finally:
        backend.max_queued = 1024
        backend.resume()
        results = [f.result(timeout=30) for f in waiting]
        pool.shutdown()
    assert all(len(r.choices) == 1 for r in results)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_and_frees_kv(
    url: str, backend: EngineBackend, engine: LLMEngine, stream: bool
) -> None:
    backend.wait_idle()
    free_pages = engine.kv.num_available_pages()
    aborted = len(backend.aborted)
    body = {
        "prompt": "Tell me a long story",
        "max_tokens": 3000,
        "ignore_eos": True,
        "n": 2,
        "stream": stream,
    }
    if stream:
        with httpx.stream("POST", f"{url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.5))
    deadline = time.monotonic() + 10
    while len(backend.aborted) < aborted + 2:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.01)
    backend.wait_idle()
    assert engine.kv.num_available_pages() == free_pages
    assert all(r.rsplit("/", 1)[1] in ("0", "1") for r in backend.aborted[aborted:])


def test_metrics(url: str, client: openai.OpenAI) -> None:
    client.completions.create(model="tiny", prompt="metrics", max_tokens=3)
    httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 0})
    text = httpx.get(f"{url}/metrics").text
    for series in (
        'dsinfer_requests_total{endpoint="completions",status="200"}',
        'dsinfer_requests_total{endpoint="completions",status="400"}',
        "dsinfer_time_to_first_token_seconds_bucket",
        "dsinfer_time_per_output_token_seconds_count",
        "dsinfer_e2e_request_latency_seconds_sum",
        "dsinfer_queue_length",
        "dsinfer_in_flight_requests",
        "dsinfer_http_requests_in_flight",
        'dsinfer_kv_cache_usage_ratio{role="colocated",worker="colocated/0/0"}',
        'dsinfer_kv_transfer_bytes_total{role="colocated",worker="colocated/0/0"}',
        'dsinfer_kv_transfer_seconds_total{role="colocated",worker="colocated/0/0"}',
        'dsinfer_prefix_cache_hit_tokens_total{role="colocated",tier="memory",worker="colocated/0/0"}',
        'dsinfer_prefix_cache_hit_tokens_total{role="colocated",tier="host",worker="colocated/0/0"}',
        'dsinfer_prefix_cache_hit_tokens_total{role="colocated",tier="disk",worker="colocated/0/0"}',
        'dsinfer_prefix_cache_hit_rate{role="colocated",worker="colocated/0/0"}',
        'dsinfer_kv_tier_pages_loaded_total{role="colocated",tier="host",worker="colocated/0/0"}',
        'dsinfer_kv_tier_load_seconds_total{role="colocated",tier="disk",worker="colocated/0/0"}',
        'dsinfer_kv_tier_evictions_total{role="colocated",tier="host",worker="colocated/0/0"}',
        'dsinfer_kv_tier_bytes{role="colocated",tier="host",worker="colocated/0/0"}',
        'dsinfer_spec_decode_draft_tokens_total{role="colocated",worker="colocated/0/0"}',
        'dsinfer_spec_decode_accepted_tokens_total{role="colocated",worker="colocated/0/0"}',
        'dsinfer_spec_decode_acceptance_rate{role="colocated",worker="colocated/0/0"}',
        'dsinfer_spec_decode_mean_accepted_length{role="colocated",worker="colocated/0/0"}',
        'dsinfer_eplb_swaps_total{role="colocated",worker="colocated/0/0"} 0.0',
        'dsinfer_choice_migrations_total{cause="rank_died",streaming="false"} 0.0',  # 0 from the start
        "dsinfer_worker_healthy",
    ):
        assert series in text, series
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
