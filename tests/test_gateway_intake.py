"""Bounded input and the status codes around it, through a real uvicorn server over a scripted
backend: a body over --max-request-body gets 413 in OpenAI's format (announced or streamed in
chunks), a prompt too long in characters for the context gets 400 before it is tokenized, no
error message shows a server path, a client that leaves mid-stream is counted as 499, and a
draining gateway answers 503 with Retry-After."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsinfer.base.presets import RANDOM_MODEL, resolve_model
from dsinfer.base.protocol import TokenDelta
from dsinfer.base.tokenizer import Tokenizer
from dsinfer.gateway.app import build_app
from dsinfer.gateway.args import GatewayArgs
from dsinfer.gateway.backend import Capacity, Job
from tests.fixtures.engine_backend import ScriptedBackend, Step, serve

LIMIT = 64 * 1024
MAX_MODEL_LEN = 256
VOCAB = 4096


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model(RANDOM_MODEL)[0])


def _script(job: Job) -> list[Step]:
    if job.params.max_tokens == 99:  # a stream that goes on until the client leaves
        return [step for _ in range(200) for step in (0.05, (0, TokenDelta(request_id="", token_ids=[40])))]
    error = "the KV transfer failed: NIXL error at /opt/nixl/src/ucx_backend.cpp:812"
    if job.params.max_tokens == 7:
        return [(0, TokenDelta(request_id="", token_ids=[40])), (0, TokenDelta(request_id="", error=error))]
    return [(0, TokenDelta(request_id="", token_ids=[40], finish_reason="length", num_prompt_tokens=1))]


@pytest.fixture(scope="module")
def backend() -> ScriptedBackend:
    return ScriptedBackend(_script, capacity=Capacity(MAX_MODEL_LEN, 64, {"colocated": 1000}))


@pytest.fixture(scope="module")
def app_and_url(backend: ScriptedBackend, tokenizer: Tokenizer) -> Iterator[tuple[Any, str]]:
    app = build_app(backend, tokenizer, GatewayArgs(max_request_body=LIMIT), VOCAB)
    with serve(app) as url:
        yield app, url


def _error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code, error
    return error


def _raw_post(url: str, head: bytes, chunks: Iterator[bytes]) -> bytes:
    """POST ``head`` then ``chunks`` on a raw socket, stopping when the server answered or closed."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head)
        for chunk in chunks:
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            sock.setblocking(False)
            try:
                if sock.recv(1, socket.MSG_PEEK):
                    break  # the answer came while the body was still being sent
            except BlockingIOError:
                pass
            finally:
                sock.setblocking(True)
        answer = b""
        try:
            while data := sock.recv(65536):
                answer += data
        except ConnectionResetError:
            pass
        return answer


def test_oversized_bodies_get_413_while_they_are_read(
    app_and_url: tuple[Any, str], backend: ScriptedBackend
) -> None:
    _, url = app_and_url
    before = len(backend.submitted)
    announced = httpx.post(f"{url}/v1/completions", content=b"{" + b" " * (LIMIT + 10) + b"}")
    error = _error(announced, 413, "request_too_large")
    assert str(LIMIT) in error["message"] and "--max-request-body" in error["message"]

    # No Content-Length: chunked, 4 KiB at a time, up to 4x the limit unless answered first.
    def chunks() -> Iterator[bytes]:
        for _ in range(4 * LIMIT // 4096):
            yield b"1000\r\n" + b" " * 4096 + b"\r\n"

    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    answer = _raw_post(url, head, chunks())
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b'"code":"request_too_large"' in answer
    assert len(backend.submitted) == before  # nothing reached the backend

    fits = {"prompt": "hi", "max_tokens": 1, "user": "x" * (LIMIT - 200)}
    assert httpx.post(f"{url}/v1/completions", json=fits).status_code == 200


def test_prompt_too_long_in_characters_is_refused_before_tokenizing(
    app_and_url: tuple[Any, str], tokenizer: Tokenizer
) -> None:
    _, url = app_and_url
    per_token = tokenizer.max_token_chars
    assert per_token is not None and per_token < 64
    text = "a" * ((MAX_MODEL_LEN - 1) * per_token + 1)
    error = _error(httpx.post(f"{url}/v1/completions", json={"prompt": text}), 400, "context_length_exceeded")
    assert f"has {len(text)} characters" in error["message"] and error["param"] == "prompt"
    chat = {"messages": [{"role": "user", "content": text}]}
    error = _error(httpx.post(f"{url}/v1/chat/completions", json=chat), 400, "context_length_exceeded")
    assert error["param"] == "messages"
    # a text under the bound is tokenized and checked in tokens as before
    error = _error(httpx.post(f"{url}/v1/completions", json={"prompt": "hello " * 300}), 400)
    assert "tokens" in error["message"] and "characters" not in error["message"]


_PATH = re.compile(r"/(opt|work|tmp|home|root|usr)/")


def test_no_error_shows_a_server_path(
    app_and_url: tuple[Any, str], tmp_path: Path, tokenizer: Tokenizer
) -> None:
    _, url = app_and_url
    failed = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 7})
    message = _error(failed, 500)["message"]
    assert "NIXL error at <path>:812" in message and not _PATH.search(message), message
    streamed = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 7, "stream": True})
    assert "<path>" in streamed.text and not _PATH.search(streamed.text)

    no_template = Tokenizer(tokenizer.backend, origin=str(tmp_path / "model"))
    backend = ScriptedBackend(_script, capacity=Capacity(MAX_MODEL_LEN, 64, {"colocated": 1000}))
    with serve(build_app(backend, no_template, GatewayArgs(served_model_name="m"), VOCAB)) as other:
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        message = _error(httpx.post(f"{other}/v1/chat/completions", json=chat), 400)["message"]
    assert message == "cannot apply the chat template: this model has no chat template"


def _requests_with_status(url: str, status: str) -> float:
    pattern = re.compile(
        rf'^dsinfer_requests_total\{{endpoint="completions",status="{status}"\}} (\S+)$', re.M
    )
    match = pattern.search(httpx.get(f"{url}/metrics").text)
    return float(match.group(1)) if match else 0.0


def test_client_leaving_a_stream_is_counted_as_499(
    app_and_url: tuple[Any, str], backend: ScriptedBackend
) -> None:
    _, url = app_and_url
    before = _requests_with_status(url, "499"), _requests_with_status(url, "200")
    body = {"prompt": "hi", "max_tokens": 99, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = 100
    while _requests_with_status(url, "499") == before[0] and deadline:
        deadline -= 1
        httpx.get(f"{url}/health")
    assert _requests_with_status(url, "499") == before[0] + 1
    assert _requests_with_status(url, "200") == before[1]


def test_draining_gateway_answers_503_with_retry_after(app_and_url: tuple[Any, str]) -> None:
    app, url = app_and_url
    app.state.gateway.draining = True
    try:
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"})
        assert "shutting down" in _error(refused, 503, "service_unavailable")["message"]
        assert int(refused.headers["retry-after"]) >= 1
        ready = httpx.get(f"{url}/ready")
        assert (
            ready.status_code == 503 and ready.json()["reason"] == "draining" and ready.headers["retry-after"]
        )
        assert httpx.get(f"{url}/health").status_code == 200  # alive all the same
    finally:
        app.state.gateway.draining = False


def test_a_burst_of_short_requests_waits_for_the_tokenizer_up_to_the_queue_limit() -> None:
    """64 clients at once is an ordinary burst (the serving benchmark's): every short request
    waits for a tokenizer thread, and only past --max-queued-requests is one refused with 429."""
    import asyncio
    import threading

    from dsinfer.gateway.errors import APIError
    from dsinfer.gateway.intake import Preparer

    async def burst() -> tuple[list[int], APIError]:
        preparer = Preparer(2, max_waiting=100)
        release = threading.Event()
        tasks = [
            asyncio.create_task(preparer.run(lambda i=i: release.wait(30) and i, 100)) for i in range(100)
        ]
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as refused:
            await preparer.run(lambda: 0, 100)
        release.set()
        done = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        preparer.close()
        return done, refused.value

    done, refused = asyncio.run(burst())
    assert done == list(range(100))
    assert refused.status == 429 and "100 requests are waiting to be tokenized" in refused.message
