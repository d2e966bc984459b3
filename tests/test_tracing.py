"""Distributed tracing through real processes: the all-in-one PD server (the built-in model, one
prefill and two decode pools) with --otlp-traces-endpoint sends its spans over OTLP/HTTP to a
receiver here. A streamed chat request with the client's W3C traceparent becomes one trace, in
the client's trace id, whose spans come from the gateway, the prefill rank and the decode rank,
each parented under the right span; the same for a request whose decode rank is killed while it
streams (its choice moves: a second attempt, on the other decode pool). And the tracing code
itself: a rank's stages, and nothing recorded when tracing is off."""

from __future__ import annotations

import itertools
import os
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dsinfer.base.stages import RequestStages
from dsinfer.base.tracing import Tracer
from harness.metrics import scrape, series, wait_kv_free
from harness.otlp import ReceivedSpan, TraceReceiver, trace_receiver
from harness.server import Server, serve

SERVICES = {"dsinfer-gateway", "dsinfer-prefill", "dsinfer-decode"}
CHAT = {"model": "tiny-chat", "messages": [{"role": "user", "content": "What is 17 + 25?"}], "stream": True}


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _one(spans: list[ReceivedSpan], **match: str) -> ReceivedSpan:
    found = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, f"{match}: {len(found)} spans in {[(s.service, s.name) for s in spans]}"
    return found[0]


def _children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> set[str]:
    return {s.name for s in spans if s.parent_span_id == parent.span_id}


@pytest.fixture(scope="module")
def receiver() -> Iterator[TraceReceiver]:
    with trace_receiver() as r:
        yield r


@pytest.fixture(scope="module")
def server(receiver: TraceReceiver, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ["--decode-pools", "2", "--otlp-traces-endpoint", receiver.endpoint]
    with serve(args, tmp_path_factory.mktemp("tracing")) as s:
        yield s


@pytest.mark.system
def test_one_trace_across_gateway_prefill_and_decode(server: Server, receiver: TraceReceiver) -> None:
    header, trace_id, client_span = _traceparent()
    with httpx.stream(
        "POST",
        f"{server.base_url}/v1/chat/completions",
        json={**CHAT, "max_tokens": 8, "temperature": 0},
        headers={"traceparent": header},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        r.read()
    ends = frozenset({"POST /v1/chat/completions", "attempt", "prefill", "decode"})
    spans = receiver.wait_for(trace_id, SERVICES, timeout=30, names=ends)
    assert {s.service for s in spans} == SERVICES, [(s.service, s.name) for s in spans]
    root = _one(spans, service="dsinfer-gateway", name="POST /v1/chat/completions")
    assert root.parent_span_id == client_span  # under the client's span
    assert root.attributes["dsinfer.outcome"] == "ok"
    assert _children(spans, root) == {"prepare", "attempt"}
    attempt = _one(spans, name="attempt")
    assert {"kv_destination", "first_token"} <= set(attempt.events)
    prefill = _one(spans, service="dsinfer-prefill", name="prefill")
    decode = _one(spans, service="dsinfer-decode", name="decode")
    assert prefill.parent_span_id == decode.parent_span_id == attempt.span_id
    assert attempt.attributes["dsinfer.prefill_worker"] == prefill.attributes["dsinfer.worker"]
    assert attempt.attributes["dsinfer.decode_worker"] == decode.attributes["dsinfer.worker"]
    assert {"prefill.queue", "prefill.forward", "kv_flush", "kv_transfer"} <= _children(spans, prefill)
    assert _children(spans, decode) == {"decode.queue", "kv_wait", "generate"}
    assert decode.attributes["dsinfer.finish"] in ("stop", "length")
    ids = {s.span_id for s in spans}
    assert all(s.parent_span_id in ids for s in spans if s is not root)
    assert not any(s.error for s in spans)
    slack = 0.05  # seconds: the processes share one clock, stamped at different instants
    assert root.start - slack <= attempt.start <= prefill.start + slack
    assert prefill.start <= decode.end <= root.end + slack


@pytest.mark.system
def test_a_migrated_request_stays_one_trace(server: Server, receiver: TraceReceiver) -> None:
    header, trace_id, _ = _traceparent()
    body = {**CHAT, "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
    tokens, outcome = [0], {}

    def stream() -> None:
        with httpx.stream(
            "POST",
            f"{server.base_url}/v1/chat/completions",
            json=body,
            headers={"traceparent": header},
            timeout=120,
        ) as r:
            for line in r.iter_lines():
                tokens[0] += line.startswith("data: {")
                outcome["last"] = line or outcome.get("last", "")

    client = threading.Thread(target=stream, daemon=True)
    client.start()
    deadline = time.monotonic() + 60
    while tokens[0] < 5:
        assert time.monotonic() < deadline and client.is_alive(), "the stream never started"
        time.sleep(0.05)
    running: dict[str, float] = {}
    while not running:  # the ranks' load reports say which decode rank holds it
        assert time.monotonic() < deadline and client.is_alive(), "no decode rank reported the stream"
        reported = series(scrape(server.base_url), "running").items()
        running = {w: v for w, v in reported if v and w.startswith("decode/")}
        time.sleep(0.1)
    assert len(running) == 1, running
    pool = int(next(iter(running)).split("/")[1])
    os.kill(server.rank_pids("decode", pool=pool)[0], signal.SIGKILL)
    client.join(timeout=120)
    assert not client.is_alive() and outcome["last"] == "data: [DONE]"
    spans = receiver.wait_for(trace_id, SERVICES, timeout=30)
    time.sleep(1.0)  # the second attempt's prefill may report after its decode
    spans = receiver.trace(trace_id)
    root = _one(spans, service="dsinfer-gateway", name="POST /v1/chat/completions")
    attempts = sorted(
        (s for s in spans if s.name == "attempt"), key=lambda s: s.attributes["dsinfer.attempt"]
    )
    assert [a.attributes["dsinfer.attempt"] for a in attempts] == [0, 1]
    assert all(a.parent_span_id == root.span_id for a in attempts)
    first, second = attempts
    assert first.error and "migrated" in first.events
    # "parked": at the kill the other ranks had missed a heartbeat (a loaded machine), so no pool
    # was ready and the choice waited for one; it moves on as the same trace either way
    assert second.attributes["dsinfer.migration_cause"] in ("rank_died", "parked") and not second.error
    under_second = {(s.service, s.name) for s in spans if s.parent_span_id == second.span_id}
    assert {("dsinfer-prefill", "prefill"), ("dsinfer-decode", "decode")} <= under_second
    survivor = _one(spans, service="dsinfer-decode", name="decode")  # the killed rank exported none
    assert survivor.attributes["dsinfer.worker"] != f"decode/{pool}/0"
    assert survivor.attributes["dsinfer.worker"] == second.attributes["dsinfer.decode_worker"]
    assert root.attributes["dsinfer.outcome"] == "ok"
    wait_kv_free(server.base_url, timeout=60)


def test_a_ranks_stages_and_tracing_off(tmp_path: Path) -> None:
    with trace_receiver() as receiver:
        tracer = Tracer("dsinfer-decode", receiver.endpoint, {"dsinfer.worker": "decode/0/0"})
        stages = RequestStages(tracer, "decode")
        parent = tracer.open("attempt")
        stages.start("r1", parent.traceparent, "decode.queue")
        stages.mark("r1", "kv_wait")
        stages.mark("r1", "generate")
        stages.end("r1", finish="length")
        stages.start("r2", "", "decode.queue")  # not traced: measured only
        stages.end("r2", "lost")
        parent.end()
        tracer.close()
        spans = receiver.spans
        decode = _one(spans, name="decode")
        attempt = _one(spans, name="attempt")
        assert decode.parent_span_id == attempt.span_id and decode.trace_id == attempt.trace_id
        children = sorted((s for s in spans if s.parent_span_id == decode.span_id), key=lambda s: s.start)
        assert [s.name for s in children] == ["decode.queue", "kv_wait", "generate"]
        assert all(a.end <= b.start + 1e-6 for a, b in itertools.pairwise(children))
        assert decode.attributes["dsinfer.finish"] == "length" and len(spans) == 5
    counts = stages.histogram.counts
    assert {k: sum(v) for k, v in counts.items()} == {"decode.queue": 2, "kv_wait": 1, "generate": 1}
    assert len(stages) == 0
    off = Tracer("dsinfer-decode", None)
    assert not off.enabled and off.open("x").traceparent == ""
    stages = RequestStages(off, "decode")
    stages.start("r", "00-" + "1" * 32 + "-" + "2" * 16 + "-01", "decode.queue")
    stages.end("r")
    assert sum(stages.histogram.counts["decode.queue"]) == 1  # measured, and no span made
