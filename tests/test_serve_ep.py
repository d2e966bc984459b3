"""Expert parallelism end to end through real processes: an all-in-one server whose prefill and
decode pools have two ranks each (one EP group per pool, gloo all-to-all in the MoE layers, two
redundant expert slots) answers the official OpenAI client with the offline engine's greedy
tokens, sent one by one and concurrently (every DP rank gets work). Killing one rank of the
decode pool mid-stream does not stop it (elastic EP): the other rank serves on without a 503,
every stream ends with the undisturbed tokens, the killed rank is restarted alone and rejoins,
a later burst runs on both ranks and every KV page is freed."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from dsinfer import LLM, SamplingParams
from harness.checkpoints import BuiltCheckpoint
from harness.metrics import healthy, metric_value, scrape, series, wait_kv_free, wait_workers
from harness.server import Server, serve
from harness.streams import join_streams, mixed_specs, offline_tokens, start_streams, wait_streaming

pytestmark = pytest.mark.system

ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-num-batched-tokens", "40"]
EP_FLAGS = ["--prefill-pool-size", "2", "--decode-pool-size", "2", "--num-redundant-experts", "2"]
WORKERS = {"prefill/0/0", "prefill/0/1", "decode/0/0", "decode/0/1"}
PROMPTS = [
    "Hello, DeepSeek",
    "The capital of France is",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "Experts of a mixture, spread over ranks,",
]
MAX_TOKENS = 10
LONG_PROMPT = " ".join(str(i) for i in range(30))
STREAMS, STREAM_TOKENS = 8, 48


@pytest.fixture(scope="module")
def server(tiny_ckpt: BuiltCheckpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ["--model", str(tiny_ckpt.path), *ENGINE_FLAGS, *EP_FLAGS]
    with serve(args, tmp_path_factory.mktemp("serve_ep")) as s:
        wait_workers(s.base_url, WORKERS, 120, s.log_tail)
        yield s


@pytest.fixture(scope="module")
def offline(tiny_ckpt: BuiltCheckpoint) -> LLM:
    return LLM(str(tiny_ckpt.path), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=40)


@pytest.fixture(scope="module")
def expected(offline: LLM) -> dict[str, list[int]]:
    outs = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return {p: o.outputs[0].token_ids for p, o in zip(PROMPTS, outs, strict=True)}


# Metrics and processes ---------------------------------------------------------------------------
def _wait_served(server: Server, before: dict[str, float], timeout: float = 10.0) -> None:
    """Every worker's admitted prompt tokens grew past ``before`` (load reports lag a heartbeat)."""
    deadline = time.monotonic() + timeout
    while True:
        now = series(scrape(server.base_url), "prompt_tokens")
        idle = {w for w in WORKERS if now.get(w, 0.0) <= before.get(w, 0.0)}
        if not idle:
            return
        assert time.monotonic() < deadline, f"workers that got no request: {idle}"
        time.sleep(0.25)


def _rank_of(pid: int) -> int:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return int(json.loads(argv[argv.index(b"--args-json") + 1])["rank"])


def _pids_by_rank(server: Server, role: str) -> dict[int, int]:
    return {_rank_of(pid): pid for pid in server.rank_pids(role, pool=0)}


# Requests ----------------------------------------------------------------------------------------
def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _token_ids(choice: object) -> list[int]:
    tokens = choice.logprobs.tokens  # type: ignore[attr-defined]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _greedy(client: openai.OpenAI, model: str, prompt: str, logprobs: int) -> list[int]:
    got = client.completions.create(
        model=model,
        prompt=prompt,
        temperature=0,
        max_tokens=MAX_TOKENS,
        logprobs=logprobs,
        extra_body={"return_tokens_as_token_ids": True},
    )
    assert got.choices[0].finish_reason == "length"
    return _token_ids(got.choices[0])


def _concurrent_equal(
    client: openai.OpenAI, model: str, prompts: list[str], expected: dict[str, list[int]]
) -> None:
    jobs = [(p, i % 2) for i, p in enumerate(prompts)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(_greedy, client, model, p, lp) for p, lp in jobs]
        got = [f.result(timeout=90) for f in futures]
    assert got == [expected[p] for p, _ in jobs]


# Tests (in this order: the kill test restarts the pools' ranks) -----------------------------------
def test_ep_completions_equal_offline(
    server: Server, client: openai.OpenAI, expected: dict[str, list[int]]
) -> None:
    model = _model(client)
    before = series(scrape(server.base_url), "prompt_tokens")
    for i, prompt in enumerate(PROMPTS):
        assert _greedy(client, model, prompt, logprobs=i % 2) == expected[prompt], prompt
    # concurrently, every prompt twice: both DP ranks of each pool get work
    _concurrent_equal(client, model, PROMPTS * 2, expected)
    _wait_served(server, before)
    wait_kv_free(server.base_url)


def test_decode_rank_killed_the_ep_pool_serves_on(
    server: Server, client: openai.OpenAI, offline: LLM, expected: dict[str, list[int]]
) -> None:
    """Elastic EP: decode rank 1 killed mid-stream. Rank 0 serves on alone (the dead rank's
    experts without a replica staged from the checkpoint): /health never says 503 and every
    stream (its own, and the dead rank's, moved to it as continuations) ends with the
    undisturbed tokens. The launcher restarts rank 1, it rejoins, and a burst runs on both."""
    before = _pids_by_rank(server, "decode")
    assert sorted(before) == [0, 1], before
    specs = mixed_specs(STREAMS, LONG_PROMPT, STREAM_TOKENS)
    want = offline_tokens(offline, specs)
    streams = start_streams(client, specs)
    wait_streaming(streams, timeout=120, context=lambda: server.log()[-3000:])

    os.kill(before[1], signal.SIGKILL)
    health = []
    while any(s.is_alive() for s in streams):
        health.append(httpx.get(f"{server.base_url}/ready", timeout=5).status_code)
        assert "decode/0/0" in healthy(scrape(server.base_url)), "the surviving rank left rotation"
        time.sleep(0.05)
    join_streams(streams, timeout=120)
    assert set(health) == {200}, health
    assert [s.result for s in streams] == [("ok", "length")] * STREAMS, [s.result for s in streams]
    for s, tokens in zip(streams, want, strict=True):
        assert s.tokens == tokens, s.spec
    metrics = server.metrics()
    assert 'dsinfer_pool_events_total{event="rank_died",pool="decode/0"} 1.0' in metrics
    assert metric_value(metrics, "dsinfer_choice_migrations_total", cause="rank_died", streaming="true") >= 1

    # rank 1 starts again alone and rejoins (rank 0 never restarted)
    deadline = time.monotonic() + 120
    while True:
        after = _pids_by_rank(server, "decode")
        rejoined = 'dsinfer_pool_events_total{event="rank_rejoined",pool="decode/0"} 1.0' in server.metrics()
        if rejoined and sorted(after) == [0, 1] and healthy(scrape(server.base_url)) >= WORKERS:
            break
        assert time.monotonic() < deadline, f"rank 1 did not rejoin: {after}\n{server.log()[-3000:]}"
        time.sleep(0.5)
    assert after[0] == before[0] and after[1] != before[1], (before, after)
    assert httpx.get(f"{server.base_url}/ready", timeout=5).status_code == 200

    # a later burst runs on both decode ranks, with the offline tokens
    model = _model(client)
    served = series(scrape(server.base_url), "prompt_tokens")
    _concurrent_equal(client, model, PROMPTS * 2, expected)
    _wait_served(server, served)
    wait_kv_free(server.base_url)
