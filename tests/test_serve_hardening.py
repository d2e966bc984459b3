"""The hardened serving plane with real processes and sockets.

A gateway process (``dsinfer serve --role gateway``) with a rank played by this test over the
real control protocol (CURVE, the cluster secret): a 20 MB body gets 413 while the gateway's
peak memory grows by less than twice the limit; a 5 MB prompt (refused on its length in
characters) and a 3.5 MB one (refused after tokenizing, off the event loop) get 400 while
/health keeps answering within 1 s; SIGTERM mid-stream ends every stream with [DONE] (its
tokens, or an error event).

The all-in-one server with default flags: no process listens beyond loopback; kill -9 of the
gateway brings a new one that serves within 15 s, with the pools not restarted (same rank pids);
forged workers without the secret (the drill of issue 17) change nothing.

``dsinfer serve`` that cannot start (an unsupported checkpoint, a bad flag value, its port in use,
a checkpoint its ranks cannot load) exits within seconds, non-zero, its last line its one error
line, leaving no process behind: nothing is restarted.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import zmq

from dsinfer.base.cluster_secret import ControlKeys
from dsinfer.base.presets import DEFAULT_MODEL, RANDOM_MODEL, presets_dir
from dsinfer.base.processes import free_port
from dsinfer.base.protocol import LoadReport, PoolDown, Register, encode
from harness.played_rank import PlayedRank, curve_dealer
from harness.server import Server, serve, serve_until_exit, wait_until
from harness.server import gateway as harness_gateway
from tests.fixtures.control import KEYS, TEST_SECRET

pytestmark = pytest.mark.system

TIMEOUT = 60.0
MIB = 2**20
BODY_LIMIT = 8 * MIB  # the gateway's default --max-request-body


# A gateway process and a rank played by the test ---------------------------------------------------
@pytest.fixture()
def gateway(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Server]:
    flags = ["--model", RANDOM_MODEL, *getattr(request, "param", [])]
    with harness_gateway(
        tmp_path / "gateway.log", TEST_SECRET, flags, startup_timeout=TIMEOUT, stop_grace=0.0
    ) as gw:
        yield gw


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _wait(condition: object, what: str, timeout: float = TIMEOUT, proc: Server | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if proc is not None and proc.process is not None and proc.process.poll() is not None:
            raise AssertionError(f"the gateway exited while waiting for {what}:\n{proc.log()[-3000:]}")
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


@pytest.fixture()
def rank(gateway: Server, request: pytest.FixtureRequest) -> Iterator[PlayedRank]:
    assert gateway.control is not None
    fake = PlayedRank(gateway.control, KEYS, **getattr(request, "param", {}))
    try:
        _wait(lambda: _answers(f"{gateway.base_url}/ready"), "the rank to register", proc=gateway)
        yield fake
    finally:
        fake.stop()


# Bounded input ---------------------------------------------------------------------------------------
def _memory(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def test_20mb_body_gets_413_and_memory_stays_bounded(gateway: Server) -> None:
    pid = gateway.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak (VmHWM) restarts from the current RSS
    baseline = _memory(pid)["VmRSS"]
    host, port = gateway.base_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        # no Content-Length: the gateway learns the size only by reading (chunks of 64 KiB)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"10000\r\n" + b"x" * 65536 + b"\r\n"
        sent = 0
        try:
            while sent < 20 * MIB:
                sock.sendall(chunk)
                sent += 65536
        except (BrokenPipeError, ConnectionResetError):
            pass  # the gateway answered and closed before the 20 MB were sent
        answer = b""
        while data := _recv(sock):
            answer += data
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert b'"code":"request_too_large"' in answer
    growth = _memory(pid)["VmHWM"] - baseline
    assert growth < 2 * BODY_LIMIT, f"peak memory grew by {growth / MIB:.1f} MiB"
    announced = httpx.post(f"{gateway.base_url}/v1/completions", content=b"x" * (20 * MIB), timeout=TIMEOUT)
    assert announced.status_code == 413 and announced.json()["error"]["code"] == "request_too_large"


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except ConnectionResetError:
        return b""


@pytest.mark.parametrize("rank", [{"max_model_len": 163840}], indirect=True)
def test_multi_mb_prompts_get_400_while_health_answers(gateway: Server, rank: PlayedRank) -> None:
    latencies: list[float] = []
    stop = threading.Event()

    def poll_health() -> None:
        with httpx.Client(timeout=TIMEOUT) as client:
            while not stop.is_set():
                started = time.monotonic()
                assert client.get(f"{gateway.base_url}/health").status_code == 200
                latencies.append(time.monotonic() - started)
                time.sleep(0.05)

    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()
    try:
        with httpx.Client(timeout=TIMEOUT) as client:
            # 5 MB: more characters than 163840 tokens can hold, refused before tokenizing
            refused = client.post(
                f"{gateway.base_url}/v1/completions", json={"prompt": "hello world " * 436_000}
            )
            assert refused.status_code == 400, refused.text
            assert "characters" in refused.json()["error"]["message"]
            # 3.5 MB: under that bound, so tokenized (on the tokenizer pool), then refused in tokens
            tokenized = client.post(
                f"{gateway.base_url}/v1/completions", json={"prompt": "hello world " * 290_000}
            )
            assert tokenized.status_code == 400, tokenized.text
            assert "tokens" in tokenized.json()["error"]["message"]
            short = client.post(f"{gateway.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert short.status_code == 200, short.text
    finally:
        stop.set()
        poller.join(TIMEOUT)
    assert len(latencies) > 5 and max(latencies) < 1.0, f"/health took up to {max(latencies):.2f} s"


# SIGTERM ----------------------------------------------------------------------------------------------
def _stream(url: str, max_tokens: int, events: list[str], started: threading.Event) -> None:
    body = {"prompt": "hi", "max_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                started.set()


@pytest.mark.parametrize("gateway", [["--drain-timeout", "3"]], indirect=True)
def test_sigterm_ends_every_stream_with_done(gateway: Server, rank: PlayedRank) -> None:
    streams: list[list[str]] = [[], []]
    started = [threading.Event(), threading.Event()]
    # 10 tokens at 0.1 s finish within the drain; 1000 do not
    threads = [
        threading.Thread(target=_stream, args=(gateway.base_url, n, events, first), daemon=True)
        for n, events, first in zip((10, 1000), streams, started, strict=True)
    ]
    for thread in threads:
        thread.start()
    for first in started:
        assert first.wait(TIMEOUT), "a stream never started"
    gateway.process.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(TIMEOUT)
        assert not thread.is_alive(), "a stream never ended"
    finished, cut = streams
    assert finished[-1] == "[DONE]" and json.loads(finished[-2])["choices"][0]["finish_reason"] == "length"
    assert sum(len(json.loads(e)["choices"][0]["text"]) > 0 for e in finished[:-1]) >= 1
    assert cut[-1] == "[DONE]" and "shutting down" in json.loads(cut[-2])["error"]["message"], cut[-3:]
    # uvicorn re-raises the signal once it has shut down: the exit status says SIGTERM ended it
    assert gateway.process is not None and gateway.process.wait(TIMEOUT) in (0, -signal.SIGTERM), (
        gateway.log()[-3000:]
    )
    _wait(lambda: len(rank.aborted) == 1, "the rank to be told Abort of the cut stream")


# The all-in-one server --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def all_in_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve([], tmp_path_factory.mktemp("serve"), startup_timeout=240.0) as server:
        yield server


def _processes(server: Server) -> list[psutil.Process]:
    root = psutil.Process(server.process.pid)
    return [root, *root.children(recursive=True)]


def test_no_process_listens_beyond_loopback(all_in_one: Server) -> None:
    listeners = []
    for proc in _processes(all_in_one):
        for conn in proc.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN or conn.type == socket.SOCK_DGRAM:
                listeners.append((proc.pid, " ".join(proc.cmdline()[2:6]), conn.laddr.ip, conn.laddr.port))
    outside = [entry for entry in listeners if not ipaddress.ip_address(entry[2]).is_loopback]
    assert not outside, f"listening beyond loopback: {outside}"
    # not vacuous: HTTP and control on the gateway, an inbox and a UCX listener on each rank
    assert len(listeners) >= 6 and {port for *_, port in listeners} >= {all_in_one.port}, listeners


def test_the_supervisors_see_their_children_come_up(all_in_one: Server) -> None:
    """What tells a failure at start from a crash later: the gateway listening, each rank's "up"
    line as its launcher reads it (a launcher logs it just after its rank registered, so it may
    follow the gateway's readiness)."""
    lines = (
        f"all-in-one: the gateway listens on port {all_in_one.port}",
        "prefill pool 0: ranks 0-0 up",
        "decode pool 0: ranks 0-0 up",
    )
    wait_until(lambda: all(line in all_in_one.log() for line in lines), "the supervisors' lines", 30)


def _gateway_pid(server: Server) -> int:
    return next(p.pid for p in _processes(server) if "gateway" in p.cmdline() and "--role" in p.cmdline())


def _rank_incarnation(pid: int) -> str:
    """What ``ps`` shows any local user: the rank's arguments, its incarnation among them."""
    argv = psutil.Process(pid).cmdline()
    return str(json.loads(argv[argv.index("--args-json") + 1])["incarnation"])


def test_forged_workers_without_the_secret_change_nothing(all_in_one: Server) -> None:
    """The drill of issue 17 against the real server: processes on the same host that speak the
    message format (no CURVE, or keys of another secret) register a pool of their own, speak for
    the real decode rank and send PoolDown with the incarnations read from ``ps``. None of it
    lands: no new worker, every request is served by the real pools, none reaches a forger, and
    the refused handshakes are logged."""
    gateway_argv = psutil.Process(_gateway_pid(all_in_one)).cmdline()
    control = f"127.0.0.1:{gateway_argv[gateway_argv.index('--control-port') + 1]}"
    downs = [
        PoolDown(role=role, pool=0, incarnation=_rank_incarnation(pid), reason="forged")
        for role in ("prefill", "decode")
        for pid in all_in_one.rank_pids(role)
    ]
    assert len(downs) == 2
    forged = Register(
        worker="decode/1/0", role="decode", pool=1, incarnation="f1", inbox="tcp://127.0.0.1:1",
        kv_pages_total=1 << 16, page_size=64, max_model_len=4096, model="ab" * 32,
    )  # fmt: skip
    other = ControlKeys.from_secret("another-cluster-secret-0123456789")
    ctx = zmq.Context()
    try:
        forgers = [
            curve_dealer(ctx, name, control, keys)
            for keys in (None, other)
            for name in ("decode/1/0", "decode/0/0", "decode/0/launcher/0")
        ]
        for forger in forgers:
            forger.send(encode(forged))
            forger.send(encode(LoadReport(worker="decode/1/0", incarnation="f1", kv_pages_total=1 << 16)))
            for down in downs:
                forger.send(encode(down))
        _wait(lambda: "refused a connection to" in all_in_one.log(), "the refused handshakes' log line")
        # the built-in model's answer shows the real pools served it (to a bare "Hello" it may
        # answer nothing but its end of sequence)
        body = {"prompt": "<｜User｜>What is 17 + 25?<｜Assistant｜>", "max_tokens": 4, "temperature": 0}
        with httpx.Client(timeout=TIMEOUT) as client:
            for _ in range(6):
                response = client.post(f"{all_in_one.base_url}/v1/completions", json=body)
                assert response.status_code == 200, response.text
                assert response.json()["choices"][0]["text"] == "42", response.text
            metrics = all_in_one.metrics()
        assert 'worker="decode/1/0"' not in metrics
        assert 'dsinfer_worker_healthy{role="decode",worker="decode/0/0"} 1.0' in metrics, metrics
        assert all(forger.poll(100) == 0 for forger in forgers)  # nothing ever reached a forger
        assert "a peer without the cluster secret" in all_in_one.log()
    finally:
        ctx.destroy(linger=0)


def test_killed_gateway_is_replaced_and_the_pools_keep_running(all_in_one: Server) -> None:
    ranks = all_in_one.rank_pids("prefill") + all_in_one.rank_pids("decode")
    assert len(ranks) == 2
    old = _gateway_pid(all_in_one)
    cut: list[BaseException] = []
    started = threading.Event()

    def stream() -> None:  # in flight when the gateway dies: a broken connection, to retry
        body = {"prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream(
                "POST", f"{all_in_one.base_url}/v1/completions", json=body, timeout=TIMEOUT
            ) as r:
                for _ in r.iter_lines():
                    started.set()
        except httpx.HTTPError as e:
            cut.append(e)

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    assert started.wait(TIMEOUT), "the stream never started"
    os.kill(old, signal.SIGKILL)
    killed = time.monotonic()
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    served = None
    while served is None:
        assert time.monotonic() - killed < TIMEOUT, f"no new gateway served:\n{all_in_one.log()[-4000:]}"
        try:
            response = httpx.post(f"{all_in_one.base_url}/v1/completions", json=body, timeout=10)
            if response.status_code == 200:
                served = time.monotonic() - killed
        except httpx.HTTPError:
            time.sleep(0.2)
    assert served < 15.0, f"the new gateway served {served:.1f} s after the kill"
    streamer.join(TIMEOUT)
    assert isinstance(cut[0], httpx.TransportError), cut
    assert _gateway_pid(all_in_one) != old
    assert all_in_one.rank_pids("prefill") + all_in_one.rank_pids("decode") == ranks  # pools not restarted
    assert "restart 1/100" in all_in_one.log()


# Failing at start ------------------------------------------------------------------------------------
def _unsupported_checkpoint(path: Path) -> Path:
    path.mkdir()
    config = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}
    (path / "config.json").write_text(json.dumps(config))
    return path


def _weightless_checkpoint(path: Path) -> Path:
    """The built-in model without its weights: the gateway starts (config, tokenizer), the ranks
    cannot load it."""
    shutil.copytree(presets_dir() / DEFAULT_MODEL, path, ignore=shutil.ignore_patterns("*.safetensors"))
    return path


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("unsupported checkpoint", "model_type 'qwen3_moe' (Qwen3MoeForCausalLM) is not supported"),
        ("bad flag value", "max_num_seqs must be at least 1"),
        ("port in use", "address already in use"),
        ("ranks cannot load the checkpoint", "before the pool was up: CheckpointError: "),
    ],
)
def test_serve_that_cannot_start_exits_with_one_error_line(tmp_path: Path, case: str, needle: str) -> None:
    port = free_port()
    args = ["--port", str(port)]
    if case == "unsupported checkpoint":
        args += ["--model", str(_unsupported_checkpoint(tmp_path / "qwen"))]
    elif case == "bad flag value":
        args += ["--max-num-seqs", "0"]
    elif case == "ranks cannot load the checkpoint":
        args += ["--model", str(_weightless_checkpoint(tmp_path / "weightless"))]
    with socket.socket() as taken:
        if case == "port in use":
            taken.bind(("127.0.0.1", port))
            taken.listen()
        ended = serve_until_exit(args, tmp_path, timeout=30.0)
    assert ended.code is not None, f"still running after 30 s:\n{ended.log[-4000:]}"
    assert ended.code == 2, ended.log[-4000:]
    errors = [line for line in ended.log.splitlines() if line.startswith("dsinfer: error:")]
    assert len(errors) == 1 and needle in errors[0], ended.log[-4000:]
    assert ended.log.strip().splitlines()[-1] == errors[0]
    assert "restart" not in ended.log, ended.log[-4000:]
    assert ended.left == [], f"processes left behind: {ended.left}"
    print(f"{case}: exit {ended.code} after {ended.seconds:.1f} s: {errors[0]}")
