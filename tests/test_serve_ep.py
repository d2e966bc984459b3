"""Expert parallelism end to end through real processes: an all-in-one server whose prefill and
decode pools have two ranks each (one EP group per pool, gloo all-to-all in the MoE layers, two
redundant expert slots) answers the official OpenAI client with the offline engine's greedy
tokens, sent one by one and concurrently (every DP rank gets work). Killing one rank of the
decode pool mid-stream takes the whole pool down: the gateway notices at once, every in-flight
request ends (tokens or a clear error), the launcher restarts both ranks, the pool serves the
offline tokens again and every KV page is freed."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from dsinfer import LLM, SamplingParams
from tests.fixtures.checkpoints import BuiltCheckpoint
from tests.fixtures.servers import Server, serve

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
LONG_PROMPT = " ".join(str(i) for i in range(30))  # with 300 new tokens: well inside 512 positions
STREAM_TOKENS = 300


@pytest.fixture(scope="module")
def server(tiny_ckpt: BuiltCheckpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ["--model", str(tiny_ckpt.path), *ENGINE_FLAGS, *EP_FLAGS]
    with serve(args, tmp_path_factory.mktemp("serve_ep")) as s:
        _wait_workers(s, WORKERS, timeout=120)
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_ckpt: BuiltCheckpoint) -> LLM:
    return LLM(str(tiny_ckpt.path), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=40)


@pytest.fixture(scope="module")
def expected(offline: LLM) -> dict[str, list[int]]:
    outs = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return {p: o.outputs[0].token_ids for p, o in zip(PROMPTS, outs, strict=True)}


# Metrics and processes ---------------------------------------------------------------------------
def _metric(text: str, name: str) -> dict[str, float]:
    """worker label -> value of one per-worker series."""
    pattern = re.compile(rf'^{name}{{[^}}]*worker="([^"]+)"[^}}]*}} (\S+)$', re.MULTILINE)
    return {m.group(1): float(m.group(2)) for m in pattern.finditer(text)}


def _healthy_workers(server: Server) -> set[str]:
    return {w for w, v in _metric(server.metrics(), "dsinfer_worker_healthy").items() if v == 1.0}


def _wait_workers(server: Server, workers: set[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not workers <= _healthy_workers(server):
        assert time.monotonic() < deadline, (
            f"workers {workers - _healthy_workers(server)} not healthy:\n{server.log()[-4000:]}"
        )
        time.sleep(0.5)


def _wait_kv_free(server: Server, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        text = server.metrics()
        used = {w: v for w, v in _metric(text, "dsinfer_kv_cache_usage_ratio").items() if v > 0}
        in_flight = re.search(r"^dsinfer_in_flight_requests (\S+)$", text, re.MULTILINE)
        if not used and in_flight is not None and float(in_flight.group(1)) == 0:
            return
        assert time.monotonic() < deadline, (
            f"KV still held: {used}, in flight {in_flight and in_flight.group(1)}"
        )
        time.sleep(0.5)


def _prompt_tokens(server: Server) -> dict[str, float]:
    return _metric(server.metrics(), "dsinfer_worker_prompt_tokens_total")


def _wait_served(server: Server, before: dict[str, float], timeout: float = 10.0) -> None:
    """Every worker's admitted prompt tokens grew past ``before`` (load reports lag a heartbeat)."""
    deadline = time.monotonic() + timeout
    while True:
        now = _prompt_tokens(server)
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


class _Stream(threading.Thread):
    """One streaming greedy completion; ``started`` once a chunk arrived; ``result`` is
    ("ok", finish_reason) or ("error", message)."""

    def __init__(self, client: openai.OpenAI, model: str) -> None:
        super().__init__(daemon=True)
        self.client, self.model = client, model
        self.started = threading.Event()
        self.result: tuple[str, str | None] | None = None

    def run(self) -> None:
        finish = None
        try:
            stream = self.client.completions.create(
                model=self.model, prompt=LONG_PROMPT, max_tokens=STREAM_TOKENS, temperature=0, stream=True
            )
            for chunk in stream:
                self.started.set()
                if chunk.choices and chunk.choices[0].finish_reason is not None:
                    finish = chunk.choices[0].finish_reason
            self.result = ("ok", finish)
        except openai.APIError as e:
            self.result = ("error", str(e))
        finally:
            self.started.set()


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
    before = _prompt_tokens(server)
    for i, prompt in enumerate(PROMPTS):
        assert _greedy(client, model, prompt, logprobs=i % 2) == expected[prompt], prompt
    # concurrently, every prompt twice: both DP ranks of each pool get work
    _concurrent_equal(client, model, PROMPTS * 2, expected)
    _wait_served(server, before)
    _wait_kv_free(server)


def test_decode_rank_killed_restarts_the_ep_pool(
    server: Server, client: openai.OpenAI, expected: dict[str, list[int]]
) -> None:
    model = _model(client)
    before = _pids_by_rank(server, "decode")
    assert sorted(before) == [0, 1], before
    streams = [_Stream(client, model) for _ in range(4)]
    for s in streams:
        s.start()
    deadline = time.monotonic() + 60
    for s in streams:
        assert s.started.wait(max(0.1, deadline - time.monotonic())), "a stream never started"
    assert all(s.result is None for s in streams), "streams ended before the kill: make them longer"

    os.kill(before[1], signal.SIGKILL)
    killed_at = time.monotonic()
    # the gateway takes the decode pool out of rotation within 10 s (it restarts only after a
    # back-off and a model load, so the unhealthy window is seconds long; poll fast)
    down = {"decode/0/0", "decode/0/1"}
    while True:
        health = httpx.get(f"{server.base_url}/ready", timeout=5).status_code
        if health == 503 or not down & _healthy_workers(server):
            break
        assert time.monotonic() - killed_at < 10, "decode workers still healthy 10 s after the kill"
        time.sleep(0.05)

    # every in-flight request ends: tokens, or an error naming the pool or worker
    deadline = time.monotonic() + 60
    for s in streams:
        s.join(max(0.1, deadline - time.monotonic()))
        assert not s.is_alive(), "a request never ended"
    results = [s.result for s in streams]
    assert all(r is not None for r in results)
    assert all(r[1] == "length" for r in results if r[0] == "ok"), results
    errors = [str(r[1]) for r in results if r[0] == "error"]
    assert errors, f"no request was cut by the kill: {results}"
    assert all("decode pool 0" in e or "decode/0/" in e for e in errors), errors

    # the launcher restarts the pool whole: new pids for both ranks, registered and healthy
    _wait_workers(server, WORKERS, timeout=90)
    deadline = time.monotonic() + 30
    while True:
        after = _pids_by_rank(server, "decode")
        if sorted(after) == [0, 1]:
            break
        assert time.monotonic() < deadline, f"decode ranks after restart: {after}"
        time.sleep(0.5)
    assert not set(after.values()) & set(before.values()), (before, after)
    assert httpx.get(f"{server.base_url}/ready", timeout=5).status_code == 200

    # and serves the offline tokens again, on both DP ranks
    served = _prompt_tokens(server)
    assert _greedy(client, model, PROMPTS[0], logprobs=1) == expected[PROMPTS[0]]
    _concurrent_equal(client, model, PROMPTS, expected)
    _wait_served(server, served)
    _wait_kv_free(server)
