"""The authenticated control plane: real ZMQ sockets against the real router and app.

A forged worker speaks the message format but lacks the cluster secret (no CURVE at all, or
keys from another secret): it cannot register, never receives a request, and its PoolDown
changes nothing; the failed handshakes are logged, rate-limited. A process with the secret
still cannot speak for a pool it is not part of. Role processes refuse to start without a
secret; the keys follow from the secret alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq

from dsinfer.base.cluster_secret import SECRET_ENV, ControlKeys, SecretError, load_secret
from dsinfer.base.control_auth import HandshakeLog
from dsinfer.base.presets import RANDOM_MODEL, resolve_model
from dsinfer.base.processes import free_port
from dsinfer.base.protocol import (
    Abort,
    GenerateRequest,
    LoadReport,
    PoolDown,
    Register,
    TokenDelta,
    TokenDeltas,
    encode,
)
from dsinfer.base.sampling_params import SamplingParams
from dsinfer.base.tokenizer import Tokenizer
from dsinfer.cli.main import main
from dsinfer.connector.messages import PrefillDone, decode
from dsinfer.gateway.app import build_app
from dsinfer.gateway.args import GatewayArgs
from dsinfer.gateway.router import Router
from dsinfer.workers.channel import WorkerChannel
from harness.played_rank import curve_dealer
from tests.fixtures.control import KEYS, TEST_SECRET, curve_router
from tests.fixtures.engine_backend import serve

MODEL = "ab" * 32
TIMEOUT = 30.0


def _register(worker: str) -> Register:
    role, pool, _ = worker.split("/")
    return Register(
        worker=worker, role=role, pool=int(pool), incarnation="i1", inbox="tcp://127.0.0.1:1",
        kv_pages_total=64, page_size=64, max_model_len=1024, model=MODEL,
    )  # fmt: skip


def _wait(condition: object, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture()
def gateway() -> Iterator[tuple[str, str, Router]]:
    control = f"127.0.0.1:{free_port()}"
    router = Router(control, KEYS)
    tokenizer = Tokenizer.from_dir(resolve_model(RANDOM_MODEL)[0])
    with serve(build_app(router, tokenizer, GatewayArgs(model=RANDOM_MODEL), 4096)) as url:
        yield url, control, router


def test_forged_workers_cannot_register_receive_requests_or_take_a_pool_down(
    gateway: tuple[str, str, Router], caplog: pytest.LogCaptureFixture
) -> None:
    url, control, router = gateway
    caplog.set_level(logging.INFO)
    ctx = zmq.Context()
    try:
        real = curve_dealer(ctx, "colocated/0/0", control, KEYS)
        real.send(encode(_register("colocated/0/0")))
        real.send(encode(LoadReport(worker="colocated/0/0", incarnation="i1", kv_pages_total=64)))
        _wait(lambda: httpx.get(f"{url}/ready").status_code == 200, "the real rank to register")

        # No secret: a plain DEALER, and one with keys of another secret. Each claims a pool of
        # its own and the real rank's name, and sends PoolDown for the real rank's incarnation.
        other = ControlKeys.from_secret("another-secret-0123456789abcdef")
        forgers = [curve_dealer(ctx, name, control, keys) for keys in (None, other) for name in ("colocated/1/0", "colocated/0/0")]  # fmt: skip
        down = PoolDown(role="colocated", pool=0, incarnation="i1", reason="forged")
        for forger in forgers:
            identity = forger.getsockopt(zmq.IDENTITY).decode()
            forger.send(encode(_register(identity)))
            forger.send(encode(down))
        # With the secret, but neither a rank nor the launcher of pool 0: ignored too.
        insider = curve_dealer(ctx, "colocated/5/launcher/0", control, KEYS)
        insider.send(encode(down))
        _wait(lambda: router.control.handshakes.failures >= 4, "the forgers' handshakes to fail")
        _wait(
            lambda: "ignored PoolDown from 'colocated/5/launcher/0'" in caplog.text, "the insider's refusal"
        )

        metrics = httpx.get(f"{url}/metrics").text
        assert 'worker="colocated/1/0"' not in metrics
        assert 'dsinfer_worker_healthy{role="colocated",worker="colocated/0/0"} 1.0' in metrics
        with httpx.Client(timeout=TIMEOUT) as client:
            for i in range(5):
                pending = client.build_request(
                    "POST", f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1}
                )
                response_future = _send_async(client, pending)
                assert real.poll(int(TIMEOUT * 1000)), f"request {i} never reached the real rank"
                request = decode(real.recv())
                assert isinstance(request, GenerateRequest)
                real.send(
                    encode(TokenDelta(request_id=request.request_id, token_ids=[9], finish_reason="length"))
                )
                assert response_future().status_code == 200
        assert all(forger.poll(100) == 0 for forger in forgers)  # nothing ever reached a forger

        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused a connection")]
        assert lines and len(lines) <= 3, lines  # rate-limited: one line, then one per 10 s
        assert "a peer without the cluster secret" in lines[0]
    finally:
        ctx.destroy(linger=0)


def _send_async(client: httpx.Client, request: httpx.Request) -> object:
    import threading

    result: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: result.append(client.send(request)))
    thread.start()

    def wait() -> httpx.Response:
        thread.join(TIMEOUT)
        assert result, "no response"
        return result[0]

    return wait


def test_rank_inbox_takes_messages_only_from_peers_with_the_secret() -> None:
    channel = WorkerChannel("decode/0/0", f"127.0.0.1:{free_port()}", "127.0.0.1", KEYS)
    ctx = zmq.Context()
    try:
        done = PrefillDone(request_id="r/0", first_token=3)
        plain = ctx.socket(zmq.PUSH)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(channel.inbox_addr)
        plain.send(encode(done), zmq.NOBLOCK)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            assert channel.receive(50) == []
        peer = WorkerChannel("prefill/0/0", f"127.0.0.1:{free_port()}", "127.0.0.1", KEYS)
        try:
            peer.send_peer(channel.inbox_addr, done)
            received: list[object] = []
            _wait(lambda: received.extend(channel.receive(50)) or received, "the keyed peer's message")
            assert received == [done]
        finally:
            peer.close()
    finally:
        ctx.destroy(linger=0)
        channel.close()


def test_deltas_of_requests_the_gateway_does_not_know_are_answered_with_abort(
    gateway: tuple[str, str, Router],
) -> None:
    """What a rank still streams for a gateway that restarted: the new one tells it to stop."""
    url, control, _ = gateway
    ctx = zmq.Context()
    try:
        rank = curve_dealer(ctx, "colocated/0/0", control, KEYS)
        rank.send(encode(_register("colocated/0/0")))
        _wait(lambda: httpx.get(f"{url}/ready").status_code == 200, "the rank to register")
        for _ in range(3):  # answered once
            rank.send(encode(TokenDelta(request_id="cmpl-old@dead/0", token_ids=[5])))
        rank.send(
            encode(TokenDelta(request_id="cmpl-done@dead/0", finish_reason="stop"))
        )  # a last one: nothing
        assert rank.poll(int(TIMEOUT * 1000)), "no Abort came"
        assert decode(rank.recv()) == Abort(request_id="cmpl-old@dead/0")
        assert rank.poll(500) == 0
    finally:
        ctx.destroy(linger=0)


def test_a_rank_serves_every_gateway_it_is_given() -> None:
    """--gateway-addr A,B: Register and reports reach both; a request's deltas go back only to the
    gateway that sent it; a successful handshake asks the rank to register again."""
    contexts = [zmq.Context(), zmq.Context()]  # a ZAP authenticator per context: one per gateway
    routers = [curve_router(ctx) for ctx in contexts]
    channel = WorkerChannel("colocated/0/0", ",".join(addr for _, addr, _ in routers), "127.0.0.1", KEYS)
    try:
        _wait(lambda: not channel.receive(10) and channel.gateway_connected(), "a handshake with a gateway")
        channel.send_gateway(_register("colocated/0/0"))
        for sock, _, _ in routers:
            assert sock.poll(int(TIMEOUT * 1000))
            identity, frame = sock.recv_multipart()
            assert identity == b"colocated/0/0" and isinstance(decode(frame), Register)
        second = routers[1][0]
        request = GenerateRequest(
            request_id="cmpl-x@b/0", prompt_token_ids=[1], params=SamplingParams(seed=1)
        )
        second.send_multipart([b"colocated/0/0", encode(request)])
        received: list[object] = []
        _wait(lambda: received.extend(channel.receive(50)) or received, "the request")
        assert received == [request]
        delta = TokenDelta(request_id="cmpl-x@b/0", token_ids=[3], finish_reason="length")
        channel.send_gateway(delta)
        channel.flush()  # a step's deltas go as one TokenDeltas message per gateway
        assert second.poll(int(TIMEOUT * 1000)) and decode(second.recv_multipart()[1]) == TokenDeltas(
            deltas=[delta]
        )
        assert routers[0][0].poll(300) == 0  # not to the other gateway
    finally:
        channel.close()
        for (sock, _, auth), ctx in zip(routers, contexts, strict=True):
            sock.close(linger=0)
            auth.stop()
            ctx.term()


@pytest.mark.parametrize("role", ["gateway", "decode"])
def test_role_processes_refuse_to_start_without_a_secret(
    role: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    argv = ["serve", "--role", role] + ([] if role == "gateway" else ["--gateway-addr", "127.0.0.1:1"])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "needs the cluster secret" in err and "--cluster-secret-file" in err and SECRET_ENV in err


def test_secret_sources_and_derived_keys(tmp_path: Path) -> None:
    file = tmp_path / "secret"
    file.write_text(f"  {TEST_SECRET}\n")
    assert load_secret(file, {}) == TEST_SECRET
    assert load_secret(None, {SECRET_ENV: TEST_SECRET}) == TEST_SECRET
    assert load_secret(file, {SECRET_ENV: "x" * 40}) == TEST_SECRET  # the flag wins
    assert load_secret(None, {}) is None
    with pytest.raises(SecretError, match="has 5 characters"):
        load_secret(None, {SECRET_ENV: "short"})
    with pytest.raises(SecretError, match="cannot read --cluster-secret-file"):
        load_secret(tmp_path / "absent", {})
    again = ControlKeys.from_secret(TEST_SECRET)
    assert again == KEYS and TEST_SECRET not in repr(again)
    pairs = {KEYS.gateway.public, KEYS.inbox.public, KEYS.client.public}
    assert len(pairs) == 3 and KEYS.client.public not in {ControlKeys.from_secret("y" * 32).client.public}
    assert zmq.curve_public(KEYS.client.secret) == KEYS.client.public


def test_handshake_failures_are_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    handshakes = HandshakeLog("the control socket", server=True, interval=10.0, clock=lambda: now[0])
    failed = {"event": zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, "value": 0x11000001, "endpoint": b""}
    caplog.set_level(logging.WARNING, logger="dsinfer.auth")
    for t in (0.0, 1.0, 2.0, 12.0):
        now[0] = t
        assert handshakes.event(failed) is False
    assert handshakes.event({"event": zmq.EVENT_HANDSHAKE_SUCCEEDED, "value": 0, "endpoint": b""})
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and handshakes.failures == 4
    assert "it does not speak CURVE" in lines[0] and "(2 more since the last line)" in lines[1]
