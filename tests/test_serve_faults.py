"""Faults through real processes, with two prefill pools and two decode pools (one rank each):
a client leaving mid-stream, a decode rank killed mid-stream, a prefill rank killed while it
prefills and writes KV. Every one of 20 streams (half greedy, half seeded at temperature 0.8)
completes with exactly the tokens of an undisturbed run (the choices the dead rank held move to
other ranks, those that had streamed as continuations), the gateway stays up, the dead pool
leaves rotation, is restarted whole by its launcher and serves again, and every KV page is
freed on both sides."""

from __future__ import annotations

import http.client
import os
import re
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from dsinfer import LLM
from harness.checkpoints import BuiltCheckpoint
from harness.metrics import healthy, scrape, series, wait_kv_free, wait_workers
from harness.server import Server, serve
from harness.streams import (
    TokenStream,
    join_streams,
    mixed_specs,
    offline_tokens,
    start_streams,
    wait_before_kill,
    wait_streaming,
)

pytestmark = pytest.mark.system

FLAGS = [
    "--dtype", "float32",
    "--kv-cache-memory", "16MiB",
    "--max-num-batched-tokens", "64",
    "--prefill-pools", "2",
    "--decode-pools", "2",
]  # fmt: skip
LONG_PROMPT = " ".join(str(i) for i in range(100))  # ~290 tokens; the checkpoint holds 512
PROMPT = " ".join(str(i) for i in range(12))
STREAMS, STREAM_TOKENS = 20, 48


@pytest.fixture(scope="module")
def server(tiny_ckpt: BuiltCheckpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(["--model", str(tiny_ckpt.path), *FLAGS], tmp_path_factory.mktemp("faults")) as s:
        wait_workers(s.base_url, {"prefill/0/0", "prefill/1/0", "decode/0/0", "decode/1/0"}, 120, s.log_tail)
        yield s


@pytest.fixture(scope="module")
def offline(tiny_ckpt: BuiltCheckpoint) -> LLM:
    return LLM(str(tiny_ckpt.path), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=64)


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
    wait_kv_free(server.base_url)


def _kill_and_check(
    server: Server, client: openai.OpenAI, offline: LLM, role: str, *, when_streaming: bool
) -> None:
    """20 streams (half greedy, half seeded at temperature 0.8) while ``role`` pool 0's rank is
    killed (``when_streaming``: once every stream delivered tokens; else while the prefills and
    their KV writes run): every one completes with the undisturbed run's tokens."""
    before = server.rank_pids(role, pool=0)
    assert len(before) == 1
    specs = mixed_specs(STREAMS, PROMPT if when_streaming else LONG_PROMPT, STREAM_TOKENS)
    expected = offline_tokens(offline, specs)
    moved_before = _migrations(server, streaming=when_streaming)
    streams = start_streams(client, specs)
    if when_streaming:
        wait_streaming(streams, timeout=120, context=lambda: _log_tail(server))
    else:
        _wait_dispatched(server, streams, timeout=120)
    os.kill(before[0], signal.SIGKILL)
    join_streams(streams, timeout=180)
    assert [s.result for s in streams] == [("ok", "length")] * STREAMS, [s.result for s in streams]
    for s, want in zip(streams, expected, strict=True):
        assert s.tokens == want, s.spec
    assert _migrations(server, streaming=when_streaming) > moved_before, (
        "no choice moved: the kill cut nothing"
    )
    # the gateway is up and routes around the dead pool
    assert httpx.get(f"{server.base_url}/ready", timeout=5).status_code == 200
    # the pool comes back whole and serves again
    wait_workers(server.base_url, {f"{role}/0/0"}, 120, server.log_tail)
    assert server.rank_pids(role, pool=0) != before
    served = series(scrape(server.base_url), "prompt_tokens").get(f"{role}/0/0", 0.0)
    streams = start_streams(client, mixed_specs(4, "a b c d", 4))
    join_streams(streams, timeout=90)
    assert [s.result for s in streams] == [("ok", "length")] * 4
    deadline = time.monotonic() + 10
    while series(scrape(server.base_url), "prompt_tokens").get(f"{role}/0/0", 0.0) <= served:
        assert time.monotonic() < deadline, f"restarted {role} pool 0 got no request"
        time.sleep(0.5)
    wait_kv_free(server.base_url)


def _wait_dispatched(server: Server, streams: list[TokenStream], timeout: float) -> None:
    """``wait_before_kill`` until every stream reached the pools (the prefills and their KV writes
    under way): each in flight at the gateway or already ended well, one at least in flight."""

    def dispatched() -> bool:
        in_flight = _in_flight(server)
        return in_flight > 0 and in_flight + sum(s.result is not None for s in streams) >= len(streams)

    def context() -> str:
        workers = sorted(healthy(scrape(server.base_url)))
        return f"{_in_flight(server):.0f} in flight at the gateway; healthy workers {workers}\n{_log_tail(server)}"

    wait_before_kill(streams, dispatched, timeout, context)


def _log_tail(server: Server, lines: int = 40) -> str:
    return "server log, last lines:\n" + "\n".join(server.log().splitlines()[-lines:])


def _in_flight(server: Server) -> float:
    """Worker requests the gateway dispatched and has not seen end."""
    found = re.search(r"^dsinfer_in_flight_requests (\S+)$", server.metrics(), re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _migrations(server: Server, *, streaming: bool) -> float:
    """Choices moved so far (``streaming``: only those that had streamed tokens: continuations)."""
    label = 'streaming="true"' if streaming else ""
    pattern = re.compile(rf"^dsinfer_choice_migrations_total{{[^}}]*{label}[^}}]*}} (\S+)$", re.MULTILINE)
    return sum(float(m.group(1)) for m in pattern.finditer(server.metrics()))


def test_decode_rank_killed_mid_stream(server: Server, client: openai.OpenAI, offline: LLM) -> None:
    _kill_and_check(server, client, offline, "decode", when_streaming=True)


def test_prefill_rank_killed_during_transfer(server: Server, client: openai.OpenAI, offline: LLM) -> None:
    _kill_and_check(server, client, offline, "prefill", when_streaming=False)
