"""Faults through real processes, with two prefill pools and two decode pools (one rank each):
a client leaving mid-stream, a decode rank killed mid-stream, a prefill rank killed while it
prefills and writes KV. Every request ends (tokens or a clear error), the gateway stays up, the
dead pool leaves rotation, is restarted whole by its launcher and serves again, and every KV
page is freed on both sides."""

from __future__ import annotations

import http.client
import os
import re
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.fixtures.checkpoints import BuiltCheckpoint
from tests.fixtures.servers import Server, serve

FLAGS = [
    "--dtype", "float32",
    "--kv-cache-memory", "16MiB",
    "--max-num-batched-tokens", "64",
    "--prefill-pools", "2",
    "--decode-pools", "2",
]  # fmt: skip
LONG_PROMPT = " ".join(str(i) for i in range(100))  # ~290 tokens; the checkpoint holds 512


@pytest.fixture(scope="module")
def server(tiny_ckpt: BuiltCheckpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(["--model", str(tiny_ckpt.path), *FLAGS], tmp_path_factory.mktemp("faults")) as s:
        _wait_workers(s, {"prefill/0/0", "prefill/1/0", "decode/0/0", "decode/1/0"}, timeout=120)
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=60, max_retries=0)


def _metric(text: str, name: str) -> dict[str, float]:
    """worker label -> value of one per-worker series."""
    pattern = re.compile(rf'^{name}{{[^}}]*worker="([^"]+)"[^}}]*}} (\S+)$', re.MULTILINE)
    return {m.group(1): float(m.group(2)) for m in pattern.finditer(text)}


def _healthy_workers(server: Server) -> set[str]:
    return {w for w, v in _metric(server.metrics(), "dsinfer_worker_healthy").items() if v == 1.0}


def _wait_workers(server: Server, workers: set[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not workers <= _healthy_workers(server):
        assert time.monotonic() < deadline, f"workers {workers - _healthy_workers(server)} not healthy"
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


def _stream_all(client: openai.OpenAI, prompt: str, max_tokens: int, results: list[object]) -> None:
    """One streaming completion; appends 'ok' with its token count, or the error it ended with."""
    try:
        model = client.models.list().data[0].id
        chunks = list(
            client.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
            )
        )
        results.append(("ok", chunks[-1].choices[0].finish_reason))
    except openai.APIError as e:
        results.append(("error", str(e)))


def _concurrent(
    client: openai.OpenAI, prompt: str, count: int, max_tokens: int
) -> tuple[list[object], list[threading.Thread]]:
    results: list[object] = []
    threads = [
        threading.Thread(target=_stream_all, args=(client, prompt, max_tokens, results)) for _ in range(count)
    ]
    for t in threads:
        t.start()
    return results, threads


def _join(threads: list[threading.Thread], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic()))
        assert not t.is_alive(), "a request never ended"


def test_idle_keep_alive_connection_is_not_closed_under_the_client(server: Server) -> None:
    """A pooled connection idle for longer than uvicorn's 5 s default still serves: a client that
    sends on it must not race the server closing it ("disconnected without a response")."""
    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", "/health")
        first = conn.getresponse()
        first.read()
        sock = conn.sock
        time.sleep(6)
        conn.request("GET", "/health")
        second = conn.getresponse()
        second.read()
        assert (first.status, second.status) == (200, 200) and conn.sock is sock
    finally:
        conn.close()


def test_client_disconnect_frees_kv_on_both_sides(server: Server, client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    body = {"model": model, "prompt": LONG_PROMPT, "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
    _wait_kv_free(server)


def _kill_and_check(server: Server, client: openai.OpenAI, role: str, delay: float) -> None:
    before = server.rank_pids(role, pool=0)
    assert len(before) == 1
    results, threads = _concurrent(client, LONG_PROMPT, count=4, max_tokens=150)
    time.sleep(delay)
    os.kill(before[0], signal.SIGKILL)
    _join(threads)
    assert len(results) == 4
    errors = [r for r in results if r[0] == "error"]
    assert all(r[1] == "length" for r in results if r[0] == "ok")
    assert all(role in r[1] or "went down" in r[1] or "restarted" in r[1] for r in errors), errors
    # the gateway is up and routes around the dead pool
    assert httpx.get(f"{server.base_url}/ready", timeout=5).status_code == 200
    after_kill, threads = _concurrent(client, "hello", count=2, max_tokens=5)
    _join(threads)
    assert [r[0] for r in after_kill] == ["ok", "ok"], after_kill
    # the pool comes back whole and serves again
    _wait_workers(server, {f"{role}/0/0"}, timeout=120)
    assert server.rank_pids(role, pool=0) != before
    served = _metric(server.metrics(), "dsinfer_worker_prompt_tokens_total").get(f"{role}/0/0", 0.0)
    results, threads = _concurrent(client, "a b c d", count=4, max_tokens=4)
    _join(threads)
    assert [r[0] for r in results] == ["ok"] * 4, results
    deadline = time.monotonic() + 10
    while _metric(server.metrics(), "dsinfer_worker_prompt_tokens_total").get(f"{role}/0/0", 0.0) <= served:
        assert time.monotonic() < deadline, f"restarted {role} pool 0 got no request"
        time.sleep(0.5)
    _wait_kv_free(server)


def test_decode_rank_killed_mid_stream(server: Server, client: openai.OpenAI) -> None:
    _kill_and_check(server, client, "decode", delay=2.0)


def test_prefill_rank_killed_during_transfer(server: Server, client: openai.OpenAI) -> None:
    _kill_and_check(server, client, "prefill", delay=0.3)
