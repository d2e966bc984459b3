"""A continuation (a migrated choice: prompt plus the tokens it already delivered, counted as
output) gives the tokens of the undisturbed choice, in the engine and through the PD roles:
greedy and seeded sampling, penalties (they count the replayed tokens as output), logprobs,
a choice other than the first of n, MTP, max_tokens over the whole output. And the router moves a
streaming choice whose rank died to another rank as a continuation, at most --max-migrations
times (ranks played by the real control protocol over ZMQ)."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest
import zmq

from dsinfer import LLM, SamplingParams
from dsinfer.base.protocol import GenerateRequest, LoadReport, PoolDown, TokenDelta
from dsinfer.base.request_id import RequestKey, parse_request_id
from dsinfer.engine.args import EngineArgs
from dsinfer.engine.engine import LLMEngine
from harness.checkpoints import BuiltCheckpoint
from tests.test_gateway_router import FakeRank, _healthy, _wait, gateway_with_rank
from tests.test_gateway_router import gateway as gateway
from tests.test_gateway_router import one_rank as one_rank
from tests.test_pd_workers import ENGINE, make_harness

PROMPTS = [list(range(7, 7 + n)) for n in (5, 130)]
CASES = {
    "greedy+logprobs": SamplingParams(temperature=0, max_tokens=14, logprobs=2, ignore_eos=True),
    "seeded+penalties": SamplingParams(
        temperature=0.8,
        seed=11,
        max_tokens=14,
        frequency_penalty=0.7,
        presence_penalty=0.4,
        repetition_penalty=1.3,
        ignore_eos=True,
        n=2,
    ),
}


@pytest.fixture(scope="module")
def offline(tiny_ckpt: BuiltCheckpoint) -> LLM:
    return LLM(str(tiny_ckpt.path), **ENGINE)


def _expected(
    offline: LLM, params: SamplingParams
) -> list[list[tuple[list[int], list[dict[int, float]] | None]]]:
    outs = offline.generate(PROMPTS, params, use_tqdm=False)
    return [[(c.token_ids, c.logprobs) for c in out.outputs] for out in outs]


def test_continuation_gives_the_undisturbed_tokens(tiny_ckpt: BuiltCheckpoint, offline: LLM) -> None:
    """With MTP on: its draft starts again after the replayed tokens (tokens never depend on it).
    Every continuation runs in one batch."""
    engine = LLMEngine(EngineArgs(model=str(tiny_ckpt.path), speculative_mtp=True, **ENGINE))
    try:
        wanted: dict[str, tuple[list[int], list[dict[int, float]] | None]] = {}
        for name, params in CASES.items():
            one = dataclasses.replace(params, n=1)
            for p, choices in enumerate(_expected(offline, params)):
                for choice, (tokens, logprobs) in enumerate(choices):
                    split = 1 + (3 * p + choice) % (len(tokens) - 1)
                    rid = f"{name}-{p}/{choice}~1"
                    engine.add_request(
                        rid, PROMPTS[p], one, first_choice=choice, output_token_ids=tokens[:split]
                    )
                    wanted[rid] = tokens[split:], None if logprobs is None else logprobs[split:]
        got: dict[str, list[int]] = {rid: [] for rid in wanted}
        got_lp: dict[str, list[dict[int, float]]] = {rid: [] for rid in wanted}
        while engine.has_unfinished_requests():
            for update in engine.step_updates():
                got[update.request_id] += update.new_token_ids
                got_lp[update.request_id] += update.new_logprobs or []
        for rid, (tokens, logprobs) in wanted.items():
            assert got[rid] == tokens, rid
            if logprobs is not None:
                assert [set(d) for d in got_lp[rid]] == [set(d) for d in logprobs], rid
        assert engine.kv.num_available_pages() == engine.kv.num_pages
    finally:
        engine.close()


def test_continuation_is_validated(tiny_ckpt: BuiltCheckpoint) -> None:
    engine = LLMEngine(EngineArgs(model=str(tiny_ckpt.path), **ENGINE))
    try:
        params = SamplingParams(temperature=0, max_tokens=3)
        with pytest.raises(ValueError, match="has none left of its 3"):
            engine.add_request("a/0~1", [5, 6], params, output_token_ids=[7, 8, 9])
        with pytest.raises(ValueError, match="output token ids must be in"):
            engine.add_request("b/0~1", [5, 6], params, output_token_ids=[10**6])
        with pytest.raises(ValueError, match="one choice"):
            engine.add_request("c/0~1", [5, 6], dataclasses.replace(params, n=2), output_token_ids=[7])
        assert not engine.has_unfinished_requests()
    finally:
        engine.close()


def test_pd_continuation_gives_the_undisturbed_tokens(tiny_ckpt: BuiltCheckpoint, offline: LLM) -> None:
    """Decode reserves pages for prompt + delivered tokens, prefill computes them all, samples
    the next token at its output position and writes every page; decode goes on from there."""
    with make_harness(tiny_ckpt) as h:
        rids, wanted = [], {}
        for name, params in CASES.items():
            for p, choices in enumerate(_expected(offline, params)):
                for choice, (tokens, _) in enumerate(choices):
                    split = 1 + (5 * p + choice) % (len(tokens) - 1)
                    rid = f"{name}-{p}/{choice}~1"
                    h.admit(rid, PROMPTS[p], params, choice, output=tokens[:split])
                    rids.append(rid)
                    wanted[rid] = tokens[split:]
        deltas = h.run(rids)
        for rid in rids:
            assert [t for d in deltas[rid] for t in d.token_ids] == wanted[rid], rid
        h.settle()
        assert h.all_pages_free()


# The router ------------------------------------------------------------------------------------
def _stream(url: str, body: dict[str, object], out: list[str]) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        out.extend(line for line in response.iter_lines() if line.startswith("data: "))


def _completion_in_background(
    url: str, body: dict[str, object]
) -> tuple[threading.Thread, list[httpx.Response]]:
    result: list[httpx.Response] = []
    client = threading.Thread(
        target=lambda: result.append(httpx.post(f"{url}/v1/completions", json=body, timeout=30))
    )
    client.start()
    return client, result


def _request(rank: FakeRank, timeout: float = 10.0) -> GenerateRequest:
    message = rank.receive(timeout)
    while message is not None and not isinstance(message, GenerateRequest):
        message = rank.receive(timeout)
    assert isinstance(message, GenerateRequest), message
    return message


@pytest.fixture()
def two_ranks(gateway: tuple[str, str]) -> Iterator[tuple[str, FakeRank, FakeRank]]:
    url, control = gateway
    ctx = zmq.Context()
    try:
        ranks = FakeRank(ctx, control, "colocated/0/0"), FakeRank(ctx, control, "colocated/1/0")
        for rank in ranks:
            rank.announce()
        _wait(lambda: _healthy(url))
        yield url, *ranks
    finally:
        ctx.destroy(linger=0)


def test_router_moves_a_streaming_choice_as_a_continuation(two_ranks: tuple[str, FakeRank, FakeRank]) -> None:
    url, a, b = two_ranks
    body = {
        "prompt": [5, 6, 7],
        "max_tokens": 6,
        "stream": True,
        "seed": 3,
        "temperature": 0.5,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    lines: list[str] = []
    client = threading.Thread(target=_stream, args=(url, body, lines))
    client.start()
    first_rank = None
    deadline = time.monotonic() + 10
    while first_rank is None:
        assert time.monotonic() < deadline
        for rank in (a, b):
            message = rank.receive(0.05)
            if isinstance(message, GenerateRequest):
                first_rank, first = rank, message
    other = b if first_rank is a else a

    def delta(request_id: str, tokens: list[int], **fields: object) -> TokenDelta:
        return TokenDelta(
            request_id=request_id, token_ids=tokens, logprobs=[{t: -1.0} for t in tokens], **fields
        )

    first_rank.send(delta(first.request_id, [40, 41], num_prompt_tokens=3))
    first_rank.send(delta(first.request_id, [42]))
    time.sleep(0.3)
    pool = int(first_rank.worker.split("/")[1])
    first_rank.send(PoolDown(role="colocated", pool=pool, incarnation="i1", reason="rank 0 exited"))
    moved = _request(other)
    key = parse_request_id(moved.request_id)
    assert key == RequestKey(parse_request_id(first.request_id).request, 0, 1)
    assert moved.output_token_ids == [40, 41, 42] and moved.prompt_token_ids == first.prompt_token_ids
    assert moved.params == first.params and moved.params.seed is not None
    first_rank.send(delta(first.request_id, [99]))  # late: dropped
    other.send(delta(moved.request_id, [43, 44]))
    other.send(delta(moved.request_id, [45], finish_reason="length"))
    client.join(10)
    assert not client.is_alive()
    metrics = httpx.get(f"{url}/metrics").text
    assert 'dsinfer_choice_migrations_total{cause="rank_died",streaming="true"} 1.0' in metrics
    assert "dsinfer_migration_recovery_seconds_count 1.0" in metrics
    assert 'dsinfer_pool_events_total{event="pool_restarted",pool="colocated/' in metrics
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines if line != "data: [DONE]"]
    tokens = [t for c in chunks for ch in c["choices"] for t in (ch.get("logprobs") or {}).get("tokens", [])]
    assert tokens == [f"token_id:{t}" for t in range(40, 46)]
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]] == ["length"]


def test_router_ends_a_choice_past_max_migrations(two_ranks: tuple[str, FakeRank, FakeRank]) -> None:
    """Each time its rank restarts (a new incarnation registers) the choice moves on with the
    tokens it has; the fourth time (--max-migrations 3) it ends with an error that says so."""
    url, a, b = two_ranks
    body = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}
    result: list[httpx.Response] = []
    client = threading.Thread(
        target=lambda: result.append(httpx.post(f"{url}/v1/completions", json=body, timeout=30))
    )
    client.start()
    for attempt in range(4):
        message, holder = None, a
        deadline = time.monotonic() + 10
        while message is None:
            assert time.monotonic() < deadline, attempt
            for rank in (a, b):
                got = rank.receive(0.05)
                if isinstance(got, GenerateRequest):
                    message, holder = got, rank
        assert parse_request_id(message.request_id).attempt == attempt
        assert message.output_token_ids == [50 + i for i in range(attempt)]
        holder.send(TokenDelta(request_id=message.request_id, token_ids=[50 + attempt]))
        time.sleep(0.2)
        holder.register = msgspec.structs.replace(holder.register, incarnation=f"i{attempt + 2}")
        holder.send(holder.register)
    client.join(10)
    assert result and result[0].status_code == 500
    assert "already moved 3 times (--max-migrations)" in result[0].json()["error"]["message"]


def test_router_parks_a_choice_while_its_only_pool_restarts(
    one_rank: tuple[str, str, zmq.Context, FakeRank],
) -> None:
    """The only pool goes down under a running choice: the choice waits (no error to the client)
    and goes out as a continuation when the pool's new incarnation registers; meanwhile a new
    request gets 503 (retry), not a 400 saying it is too large for the pools that are up."""
    url, _, _, rank = one_rank
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
    client, result = _completion_in_background(url, body)
    first = _request(rank)
    rank.send(TokenDelta(request_id=first.request_id, token_ids=[60], num_prompt_tokens=3))
    time.sleep(0.2)
    rank.send(PoolDown(role="colocated", pool=0, incarnation="i1", reason="rank 0 exited with code -9"))
    _wait(lambda: not _healthy(url))
    during = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
    assert during.status_code == 503, during.text
    time.sleep(0.3)
    assert client.is_alive() and not result  # parked, not failed
    rank.register = msgspec.structs.replace(rank.register, incarnation="i2")
    rank.announce()
    moved = _request(rank)
    assert parse_request_id(moved.request_id).attempt == 1 and moved.output_token_ids == [60]
    rank.send(TokenDelta(request_id=moved.request_id, token_ids=[61, 62, 63], finish_reason="length"))
    client.join(10)
    assert result and result[0].status_code == 200, result
    assert result[0].json()["usage"]["completion_tokens"] == 4
    metrics = httpx.get(f"{url}/metrics").text
    assert "dsinfer_in_flight_requests 0.0" in metrics


def test_router_parked_choice_goes_out_when_its_rank_answers_again() -> None:
    """The only rank stops answering (heartbeats stop): its choice is parked, not failed; when it
    is heard from again (a load report), the choice goes out to it again as the next attempt."""
    with gateway_with_rank(heartbeat_timeout=0.5) as (url, _, _, rank):
        client, result = _completion_in_background(
            url, {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
        )
        first = _request(rank)
        _wait(lambda: not _healthy(url))  # no heartbeat for 0.5 s: out of rotation, the choice parked
        time.sleep(0.3)
        assert client.is_alive() and not result
        rank.send(LoadReport(worker=rank.worker, incarnation="i1", kv_pages_total=2))
        moved = _request(rank)
        assert parse_request_id(moved.request_id) == parse_request_id(first.request_id).next_attempt()
        rank.send(TokenDelta(request_id=moved.request_id, token_ids=[61, 62], finish_reason="length"))
        client.join(10)
        assert result and result[0].status_code == 200, result
