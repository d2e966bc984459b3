"""End to end through real processes: `dsinfer serve` (gateway + prefill pool + decode pool, KV
over NIXL) answers the official OpenAI client with exactly the offline engine's tokens."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from dsinfer import LLM, SamplingParams
from dsinfer.base.config import ModelConfig
from dsinfer.base.expert_load import read_expert_load
from dsinfer.parallel.placement import ExpertPlacement, moe_layer_ids
from harness.checkpoints import BuiltCheckpoint
from harness.server import Server, serve

pytestmark = pytest.mark.system

ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-num-batched-tokens", "40"]
PROMPTS = [
    "Hello, DeepSeek",
    "The capital of France is",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
]


@pytest.fixture(scope="module")
def server(tiny_ckpt: BuiltCheckpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(["--model", str(tiny_ckpt.path), *ENGINE_FLAGS], tmp_path_factory.mktemp("serve")) as s:
        yield s


@pytest.fixture(scope="module")
def offline(tiny_ckpt: BuiltCheckpoint) -> LLM:
    return LLM(str(tiny_ckpt.path), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=40)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _token_ids(choice: object) -> list[int]:
    tokens = choice.logprobs.tokens  # type: ignore[attr-defined]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_completions_equal_offline(client: openai.OpenAI, offline: LLM) -> None:
    """Token ids (returned as "token_id:N" with the logprobs) and top-2 alternatives, greedy and
    seeded with n = 2."""
    model = _model(client)
    cases = [
        ({"temperature": 0, "max_tokens": 12}, SamplingParams(temperature=0, max_tokens=12, logprobs=2)),
        (
            {"temperature": 0.8, "top_p": 0.9, "seed": 11, "max_tokens": 10, "n": 2},
            SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=10, n=2, logprobs=2),
        ),
    ]
    for kwargs, params in cases:
        expected = offline.generate(PROMPTS, params, use_tqdm=False)
        for prompt, want in zip(PROMPTS, expected, strict=True):
            got = client.completions.create(
                model=model,
                prompt=prompt,
                logprobs=2,
                extra_body={"return_tokens_as_token_ids": True},
                **kwargs,
            )
            choices = sorted(got.choices, key=lambda c: c.index)
            assert [_token_ids(c) for c in choices] == [o.token_ids for o in want.outputs]
            assert [c.text for c in choices] == [o.text for o in want.outputs]
            for c, o in zip(choices, want.outputs, strict=True):
                for got_top, want_top in zip(c.logprobs.top_logprobs, o.logprobs, strict=True):
                    ids = {int(t.removeprefix("token_id:")): v for t, v in got_top.items()}
                    assert ids.keys() == want_top.keys()
                    assert all(abs(ids[t] - want_top[t]) < 1e-4 for t in ids)


def test_stop_strings_and_streaming_equal_offline(client: openai.OpenAI, offline: LLM) -> None:
    model = _model(client)
    probe = offline.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    stop = probe.outputs[0].text[4:7]
    params = SamplingParams(temperature=0, max_tokens=16, stop=[stop])
    want = offline.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0]
    got = client.completions.create(model=model, prompt=PROMPTS[1], temperature=0, max_tokens=16, stop=[stop])
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model=model,
        prompt=PROMPTS[2],
        temperature=0,
        max_tokens=14,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    want = offline.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=14), use_tqdm=False)[0]
    assert text == want.outputs[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 14


def test_chat_and_metrics(server: Server, client: openai.OpenAI, offline: LLM) -> None:
    model = _model(client)
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], temperature=0, max_tokens=6
    )
    assert reply.choices[0].message.content is not None
    assert reply.usage.completion_tokens == 6
    metrics = server.metrics()
    for series in (
        "dsinfer_kv_transfer_bytes",
        "dsinfer_time_to_first_token_seconds",
        "dsinfer_kv_cache_usage",
    ):
        assert series in metrics, series


def test_bad_request_is_4xx(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=_model(client), prompt="x", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)


def test_expert_load_statistics_export(
    server: Server, client: openai.OpenAI, tiny_ckpt: BuiltCheckpoint, tmp_path: Path
) -> None:
    """Ranks report the tokens routed to each expert; /expert_load is the EPLB input file."""
    client.completions.create(model=_model(client), prompt=PROMPTS[2], max_tokens=4, temperature=0)
    deadline = time.monotonic() + 15
    while True:
        doc = httpx.get(f"{server.base_url}/expert_load", timeout=10).json()
        roles = doc.get("roles", {})
        if all(sum(sum(c) for c in roles.get(r, {}).values()) > 0 for r in ("prefill", "decode")):
            break
        assert time.monotonic() < deadline, doc
        time.sleep(0.5)
    path = tmp_path / "expert_load.json"
    path.write_text(json.dumps(doc))
    load = read_expert_load(path, "decode")
    config = ModelConfig.from_file(tiny_ckpt.path / "config.json")
    assert sorted(load) == moe_layer_ids(config)
    assert all(len(counts) == config.n_routed_experts for counts in load.values())
    placement = ExpertPlacement.default(sorted(load), config.n_routed_experts, 2, 2, load=load)
    assert placement.num_physical == config.n_routed_experts + 2
