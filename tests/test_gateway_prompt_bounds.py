"""Prompts too long to serve are refused without tokenizing them whole (issue 45): a lower bound on
their tokens from their characters (no token stands for more characters than the vocabulary's
longest entry) refuses a 7.9 MB prompt in milliseconds, chat and completions alike; a prompt that
passes the bound but takes too long to tokenize gets a 413, while /health answers throughout.
Through a real uvicorn server (in a thread) over a scripted backend, with the default model's
tokenizer (tiny-chat, whose normalizer replaces characters one for one)."""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from dsinfer.base.presets import DEFAULT_MODEL, RANDOM_MODEL, resolve_model
from dsinfer.base.protocol import TokenDelta
from dsinfer.base.tokenizer import Tokenizer, least_kept_fraction
from dsinfer.gateway.app import build_app
from dsinfer.gateway.args import GatewayArgs
from dsinfer.gateway.backend import Capacity, Job
from tests.fixtures.engine_backend import ScriptedBackend, Step, serve

MAX_MODEL_LEN = 163_840  # DeepSeek-V3's
PROMPT_BYTES = 7_900_000  # just under the 8 MiB default of --max-request-body
FAST = 1.0  # seconds: the refusal takes milliseconds; generous for a loaded CI machine


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model(DEFAULT_MODEL)[0])


def _script(job: Job) -> list[Step]:
    return [(0, TokenDelta(request_id="", token_ids=[40], finish_reason="length", num_prompt_tokens=1))]


@pytest.fixture(scope="module")
def app_and_url(tokenizer: Tokenizer) -> Iterator[tuple[Any, str]]:
    backend = ScriptedBackend(_script, capacity=Capacity(MAX_MODEL_LEN, 64, {"colocated": 10**6}))
    app = build_app(backend, tokenizer, GatewayArgs(), tokenizer.vocab_size)
    with serve(app) as url:
        yield app, url


# The bound -----------------------------------------------------------------------------------
def _longest_entry(tokenizer: Tokenizer) -> int:
    return max(len(token) for token in tokenizer.backend.get_vocab(with_added_tokens=True))


@pytest.mark.parametrize("model", [RANDOM_MODEL, DEFAULT_MODEL])
def test_bound_is_the_longest_vocabulary_entry_computed_once(model: str) -> None:
    """tiny: byte-level BPE without a normalizer; tiny-chat: a normalizer that keeps every character."""
    tokenizer = Tokenizer.from_dir(resolve_model(model)[0])
    assert tokenizer.max_token_chars == _longest_entry(tokenizer)
    assert "max_token_chars" in vars(tokenizer)  # cached on the tokenizer
    rng = random.Random(0)
    vocab = list(tokenizer.backend.get_vocab())
    texts = [
        "What is 1234 + 5678? " * 50,
        " ".join(rng.choice(vocab) for _ in range(500)),
        "".join(chr(rng.randrange(32, 0x3000)) for _ in range(2000)),
        (tokenizer.bos_token or "") * 40,
    ]
    for text in texts:
        least = tokenizer.least_tokens(text)
        assert least == -(-len(text) // tokenizer.max_token_chars)
        assert least <= len(tokenizer.encode(text, add_special_tokens=False)), text[:80]


@pytest.mark.parametrize(
    ("normalizer", "fraction"),
    [
        (None, 1.0),
        ({"type": "NFD"}, 1.0),
        ({"type": "Replace", "pattern": {"Regex": "0(?=[0-9]{3})"}, "content": "\ue000"}, 1.0),
        ({"type": "Replace", "pattern": {"String": "  "}, "content": " "}, 0.5),
        (
            {
                "type": "Sequence",
                "normalizers": [
                    {"type": "Replace", "pattern": {"Regex": "ab|c"}, "content": "x"},
                    {"type": "Lowercase"},
                ],
            },
            0.5,
        ),
        ({"type": "Replace", "pattern": {"Regex": " +"}, "content": " "}, None),  # any run of spaces -> one
        ({"type": "Replace", "pattern": {"String": "x"}, "content": ""}, None),  # deletes
        ({"type": "NFC"}, None),  # composes: not analysed
        ({"type": "Strip", "left": True, "right": True}, None),
    ],
)
def test_least_kept_fraction(normalizer: dict[str, Any] | None, fraction: float | None) -> None:
    assert least_kept_fraction(normalizer) == fraction


# Through the gateway ---------------------------------------------------------------------------
def _post(url: str, path: str, body: dict[str, Any]) -> tuple[httpx.Response, float]:
    content = json.dumps(body).encode()
    start = time.perf_counter()
    response = httpx.post(
        f"{url}{path}", content=content, headers={"Content-Type": "application/json"}, timeout=60
    )
    return response, time.perf_counter() - start


def _error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert error["code"] == code, error
    return error


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_7_9_mb_prompt_is_refused_at_once(
    app_and_url: tuple[Any, str], tokenizer: Tokenizer, endpoint: str
) -> None:
    _, url = app_and_url
    text = "What is 1234 + 5678? " * (PROMPT_BYTES // 21)
    if endpoint == "chat":
        path, body, param = (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": text}]},
            "messages",
        )
    else:
        path, body, param = "/v1/completions", {"prompt": text}, "prompt"
    response, seconds = _post(url, path, body)
    print(f"{endpoint}: {len(text) / 1e6:.1f} MB prompt refused in {seconds * 1000:.0f} ms")
    error = _error(response, 400, "context_length_exceeded")
    assert seconds < FAST
    assert error["param"] == param
    per_token = tokenizer.max_token_chars
    least = int(re.search(r"so at least (\d+) tokens", error["message"]).group(1))  # type: ignore[union-attr]
    assert least >= -(-len(text) // per_token)  # chat: the template's characters too
    assert f"at most {per_token} characters" in error["message"]
    assert f"context length is {MAX_MODEL_LEN} tokens" in error["message"]


def test_max_tokens_counts_against_the_bound(app_and_url: tuple[Any, str], tokenizer: Tokenizer) -> None:
    """A prompt that fits alone but not with max_tokens is refused before tokenizing too."""
    _, url = app_and_url
    per_token = tokenizer.max_token_chars
    assert per_token is not None
    text = "a" * ((MAX_MODEL_LEN - 1000) * per_token)
    response, seconds = _post(url, "/v1/completions", {"prompt": text, "max_tokens": 2000})
    error = _error(response, 400, "context_length_exceeded")
    assert error["param"] == "max_tokens" and "at least 164840 were requested" in error["message"]
    assert seconds < FAST, seconds


def test_slow_tokenizing_gets_413_and_health_answers(tokenizer: Tokenizer) -> None:
    """A context too long for the bound to refuse anything: the prompt is tokenized, and answered
    with a 413 when that takes longer than the preparer's timeout (0.2 s here)."""
    backend = ScriptedBackend(_script, capacity=Capacity(10**8, 64, {"colocated": 10**7}))
    app = build_app(backend, tokenizer, GatewayArgs(), tokenizer.vocab_size)
    app.state.gateway.preparer.timeout = 0.2
    text = "What is 1234 + 5678? " * 50_000  # ~1 MB: about a second of tokenizing
    health: list[float] = []
    with serve(app) as url:
        done = threading.Event()

        def poll() -> None:
            while not done.is_set():
                start = time.perf_counter()
                assert httpx.get(f"{url}/health").status_code == 200
                health.append(time.perf_counter() - start)
                time.sleep(0.02)

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            response, seconds = _post(url, "/v1/completions", {"prompt": text})
        finally:
            done.set()
            poller.join()
        print(
            f"413 after {seconds:.2f} s; /health: {len(health)} answers, slowest {max(health) * 1000:.0f} ms"
        )
        error = _error(response, 413, "prompt_too_large")
        assert "more than 0.2 s to template and tokenize" in error["message"]
        assert seconds < 0.2 + FAST
        assert health and max(health) < FAST
        # the abandoned tokenizing ends, and frees its place
        deadline = time.monotonic() + 60
        while app.state.gateway.preparer.pending[True] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert app.state.gateway.preparer.pending == {True: 0, False: 0}
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
