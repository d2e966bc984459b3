"""The router over ranks that speak the real control protocol (ZMQ DEALER sockets sending the
messages a rank sends), behind the real app and uvicorn: a rank whose max_model_len, page size or
model disagree with the registered ones is refused with one log line; a request no registered
rank can hold gets a 400 and never reaches a rank; a request that fits reaches one as a worker
request with its seed set, no stop strings, and the id format_request_id writes."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import zmq

from dsinfer.base.presets import RANDOM_MODEL, resolve_model
from dsinfer.base.processes import free_port
from dsinfer.base.protocol import GenerateRequest, LoadReport, Message, Register, TokenDelta, decode, encode
from dsinfer.base.request_id import RequestKey, parse_request_id
from dsinfer.base.tokenizer import Tokenizer
from dsinfer.gateway.app import build_app
from dsinfer.gateway.args import GatewayArgs
from dsinfer.gateway.router import FIRST_REGISTRATION_WAIT, Router
from harness.played_rank import curve_dealer
from tests.fixtures.control import KEYS
from tests.fixtures.engine_backend import serve

MODEL = "ab" * 32
MAX_MODEL_LEN, PAGE, KV_PAGES = 256, 64, 2  # the rank holds 2 pages: 128 tokens of KV


class FakeRank:
    """A rank's control socket, nothing behind it."""

    def __init__(self, ctx: zmq.Context, control: str, worker: str, **register: object) -> None:
        self.worker = worker
        self.sock = curve_dealer(ctx, worker, control, KEYS)
        fields: dict[str, object] = {
            "worker": worker, "role": "colocated", "pool": int(worker.split("/")[1]), "incarnation": "i1",
            "inbox": "tcp://127.0.0.1:1", "kv_pages_total": KV_PAGES, "page_size": PAGE,
            "max_model_len": MAX_MODEL_LEN, "model": MODEL,
        }  # fmt: skip
        self.register = Register(**{**fields, **register})  # type: ignore[arg-type]

    def send(self, message: object) -> None:
        self.sock.send(encode(message))  # type: ignore[arg-type]

    def announce(self) -> None:
        self.send(self.register)
        self.send(LoadReport(worker=self.worker, incarnation="i1", kv_pages_total=KV_PAGES))

    def receive(self, timeout: float) -> Message | None:
        if self.sock.poll(int(timeout * 1000)):
            return decode(self.sock.recv())
        return None


@contextlib.contextmanager
def running_gateway(
    heartbeat_timeout: float | None = None, first_registration_wait: float = FIRST_REGISTRATION_WAIT
) -> Iterator[tuple[str, str]]:
    """The app over a router on a free control port: (url, control address)."""
    control = f"127.0.0.1:{free_port()}"
    router = Router(
        control, KEYS, heartbeat_timeout=heartbeat_timeout, first_registration_wait=first_registration_wait
    )
    tokenizer = Tokenizer.from_dir(resolve_model(RANDOM_MODEL)[0])
    app = build_app(router, tokenizer, GatewayArgs(model=RANDOM_MODEL), 4096)
    with serve(app) as url:
        yield url, control


def test_new_gateway_holds_requests_until_its_ranks_register() -> None:
    """A gateway that has not been ready yet (it just started or restarted: its ranks register at
    once on connecting) holds a request until a rank registers, instead of a 503; with none
    within its bound, the request gets a 503 to retry."""
    body = {"prompt": [5, 6, 7], "max_tokens": 1}
    with running_gateway() as (url, control), contextlib.ExitStack() as stack:
        result: list[httpx.Response] = []
        client = threading.Thread(
            target=lambda: result.append(httpx.post(f"{url}/v1/completions", json=body, timeout=30))
        )
        client.start()
        stack.callback(client.join, 30)
        time.sleep(0.5)
        assert not result  # held, not refused
        ctx = zmq.Context()
        stack.callback(ctx.destroy, linger=0)
        rank = FakeRank(ctx, control, "colocated/0/0")
        rank.announce()
        request = rank.receive(timeout=10)
        while request is not None and not isinstance(request, GenerateRequest):
            request = rank.receive(timeout=10)
        assert isinstance(request, GenerateRequest), request
        assert not request.more_coming  # a lone request: the rank starts it at once
        rank.send(TokenDelta(request_id=request.request_id, token_ids=[9], finish_reason="length"))
        client.join(30)
        assert result and result[0].status_code == 200, result
    with running_gateway(first_registration_wait=0.5) as (url, _):
        started = time.monotonic()
        refused = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert refused.status_code == 503 and "no worker pool has registered" in refused.text, refused.text
        assert 0.4 < time.monotonic() - started < 10  # held for the bound, then refused


@pytest.fixture()
def gateway() -> Iterator[tuple[str, str]]:
    with running_gateway() as addresses:
        yield addresses


@contextlib.contextmanager
def gateway_with_rank(
    gateway: tuple[str, str] | None = None, heartbeat_timeout: float | None = None
) -> Iterator[tuple[str, str, zmq.Context, FakeRank]]:
    """One colocated rank registered and ready behind ``gateway`` (a new one when None):
    (url, control, context, rank)."""
    with contextlib.ExitStack() as stack:
        url, control = gateway or stack.enter_context(running_gateway(heartbeat_timeout))
        ctx = zmq.Context()
        stack.callback(ctx.destroy, linger=0)
        rank = FakeRank(ctx, control, "colocated/0/0")
        rank.announce()
        _wait(lambda: _healthy(url))
        yield url, control, ctx, rank


@pytest.fixture()
def one_rank(gateway: tuple[str, str]) -> Iterator[tuple[str, str, zmq.Context, FakeRank]]:
    with gateway_with_rank(gateway) as setup:
        yield setup


def _wait(condition: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _healthy(url: str) -> bool:
    return httpx.get(f"{url}/ready").status_code == 200


def test_rank_with_other_limits_is_refused_once(
    one_rank: tuple[str, str, zmq.Context, FakeRank], caplog: pytest.LogCaptureFixture
) -> None:
    url, control, ctx, _ = one_rank
    caplog.set_level(logging.INFO, logger="dsinfer.gateway")
    smaller = FakeRank(ctx, control, "colocated/1/0", max_model_len=128)
    other_page = FakeRank(ctx, control, "colocated/2/0", page_size=32)
    other_model = FakeRank(ctx, control, "colocated/3/0", model="cd" * 32)
    for _ in range(3):  # ranks register again every few seconds: one line each all the same
        for rank in (smaller, other_page, other_model):
            rank.announce()
    _wait(lambda: sum("refused" in r.getMessage() for r in caplog.records) >= 3)
    time.sleep(0.3)
    refusals = sorted(r.getMessage() for r in caplog.records if "refused" in r.getMessage())
    assert refusals == [
        "refused colocated/1/0: its max_model_len is 128, the registered pools' is 256",
        "refused colocated/2/0: its page_size is 32, the registered pools' is 64",
        f"refused colocated/3/0: it serves another model ({'cd' * 6}, not {'ab' * 6})",
    ]
    assert 'worker="colocated/1/0"' not in httpx.get(f"{url}/metrics").text
    models = httpx.get(f"{url}/v1/models").json()
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN  # the registered ranks' limit


def test_request_no_rank_can_hold_gets_400_and_never_reaches_a_rank(
    one_rank: tuple[str, str, zmq.Context, FakeRank],
) -> None:
    url, _, _, rank = one_rank
    too_long = httpx.post(f"{url}/v1/completions", json={"prompt": list(range(2, 2 + MAX_MODEL_LEN))})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    # fits the context length (256), not the KV of any rank (2 pages of 64 tokens)
    no_kv = httpx.post(f"{url}/v1/completions", json={"prompt": list(range(2, 52)), "max_tokens": 100})
    assert no_kv.status_code == 400, no_kv.text
    error = no_kv.json()["error"]
    assert error["code"] == "kv_capacity_exceeded" and error["param"] == "max_tokens"
    assert "needs 3 KV pages of 64 tokens" in error["message"], error["message"]
    assert rank.receive(timeout=0.5) is None  # nothing reached the rank

    with httpx.Client(timeout=30) as client:
        fits = {"prompt": list(range(2, 52)), "max_tokens": 50, "stop": ["x"], "n": 2}
        pending = client.build_request("POST", f"{url}/v1/completions", json=fits)
        result: list[httpx.Response] = []
        thread = threading.Thread(target=lambda: result.append(client.send(pending)))
        thread.start()
        requests = [rank.receive(timeout=10) for _ in range(2)]
        for choice, request in enumerate(requests):
            assert isinstance(request, GenerateRequest)
            key = parse_request_id(request.request_id)
            assert key == RequestKey(key.request, choice, 0) and key.request.startswith("cmpl-")
            assert request.choice == choice and request.params.n == 1
            assert request.params.seed is not None and request.params.stop == []  # the gateway owns stops
            rank.send(TokenDelta(request_id=request.request_id, token_ids=[7], finish_reason="length"))
        thread.join(30)
    assert result and result[0].status_code == 200, result
    assert requests[0].params.seed == requests[1].params.seed  # n choices share one seed
    assert [r.more_coming for r in requests] == [True, False]  # an idle rank waits for the second
