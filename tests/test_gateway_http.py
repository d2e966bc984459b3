"""The gateway over a scripted backend, through a real uvicorn server: bad input never reaches the
backend and gets an OpenAI error body, auth, health, 429/503/500/504, reasoning_content, a
character split across tokens while streaming, stop strings held back, request ids, echo and
the --chat-template override."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import prometheus_client
import pytest

from dsinfer.base.presets import resolve_model
from dsinfer.base.protocol import TokenDelta
from dsinfer.base.sampling_params import SamplingParams
from dsinfer.base.tokenizer import Tokenizer
from dsinfer.gateway.app import build_app
from dsinfer.gateway.args import GatewayArgs
from dsinfer.gateway.backend import Capacity, Job, Overloaded, Unavailable
from dsinfer.gateway.choice import ChoiceState, ChoiceUpdate
from tests.fixtures.engine_backend import ScriptedBackend, Step, serve, text_deltas

MAX_MODEL_LEN = 64
VOCAB = 4096
CAPACITY = Capacity(MAX_MODEL_LEN, 64, {"colocated": 1000})  # what the "registered pools" hold
THINK_END = 5  # "</think>" in the tiny tokenizer (not a special token, so it is in the text)
NI = [166, 127, 260]  # "你" as three byte-level tokens


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model("tiny")[0])


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@contextmanager
def _server(backend: ScriptedBackend, tokenizer: Tokenizer, **args: Any) -> Iterator[str]:
    app = build_app(backend, tokenizer, GatewayArgs(**{"model": "tiny", **args}), VOCAB)
    with serve(app) as url:
        yield url


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> ScriptedBackend:
    return ScriptedBackend(
        lambda job: text_deltas([_ids(tokenizer, "ok")], n=job.params.n), capacity=CAPACITY
    )


@pytest.fixture(scope="module")
def url(backend: ScriptedBackend, tokenizer: Tokenizer) -> Iterator[str]:
    with _server(backend, tokenizer, max_n=4) as base:
        yield base


@pytest.fixture
def scripted(
    backend: ScriptedBackend, tokenizer: Tokenizer
) -> Iterator[Callable[[Callable[[Job], list[Step]]], None]]:
    """Swap the module backend's script for one test; also resets what it recorded."""
    default = backend.script
    backend.submitted.clear()
    backend.aborted.clear()

    def use(script: Callable[[Job], list[Step]]) -> None:
        backend.script = script

    yield use
    backend.script, backend.refuse, backend.ready = default, None, True


def _client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def _check_error(response: httpx.Response, status: int, param: str | None = "?") -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param != "?":
        assert error["param"] == param, error
    return error


BAD_COMPLETIONS: list[tuple[Any, int, str | None]] = [
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "max_tokens": 1.5}, 400, "max_tokens"),
    ({"prompt": "hi", "n": "2"}, 400, "n"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"prompt": [True]}, 400, "prompt"),
    ({"prompt": [1, "a"]}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ({"prompt": "hi", "n": 5}, 400, "n"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [[]]}, 400, "prompt"),
    ({"prompt": ["a", ""]}, 400, "prompt"),
    ({"prompt": [5000]}, 400, "prompt"),
    ({"prompt": [[1, 2], [-1]]}, 400, "prompt"),
    ({"prompt": list(range(2, 2 + MAX_MODEL_LEN))}, 400, "prompt"),
    ({"prompt": list(range(2, 50)), "max_tokens": 20}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ({"prompt": "hi", "top_k": 1.5}, 400, "top_k"),
    ({"prompt": "hi", "min_p": 2}, 400, "min_p"),
    ({"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"prompt": "hi", "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop"),
    ({"prompt": "hi", "stop": [1]}, 400, "stop"),
    ({"prompt": "hi", "stop_token_ids": [99999]}, 400, "stop_token_ids"),
    ({"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": 200}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": "x"}}, 400, "logit_bias"),
    ({"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": "hi", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ({"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ({"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ({"prompt": "hi", "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens"),
    ({"prompt": "hi", "use_beam_search": True}, 400, "use_beam_search"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "structured_outputs": {"regex": "[a-"}}, 400, "structured_outputs"),
    ({"prompt": "hi", "guided_json": {"type": "objec"}}, 400, "guided_json"),
    ({"prompt": "hi", "guided_choice": []}, 400, "guided_choice"),
    ({"prompt": "hi", "guided_regex": "a", "guided_choice": ["a"]}, 400, "guided_choice"),
    ([1, 2], 400, None),
]

BAD_CHATS: list[tuple[Any, int, str | None]] = [
    ({"messages": []}, 400, "messages"),
    ({}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": [{"content": "hi"}]}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
    (
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, 400, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools"),
    (
        {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}},
        400,
        "response_format",
    ),
    (
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}},
            },
        },
        400,
        "response_format",
    ),
    ({"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}, 400, "functions"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, 400, "tool_choice"),
    (
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        400,
        "tool_choice",
    ),
    ({"messages": [{"role": "user", "content": "x" * 200}]}, 400, "prompt"),
    (
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": []}},
        400,
        "chat_template_kwargs",
    ),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "other"}, 404, "model"),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [("/v1/completions", *case) for case in BAD_COMPLETIONS]
    + [("/v1/chat/completions", *case) for case in BAD_CHATS],
)
def test_bad_requests(
    url: str, backend: ScriptedBackend, path: str, body: Any, status: int, param: str | None
) -> None:
    before = len(backend.submitted)
    _check_error(httpx.post(f"{url}{path}", json=body), status, param)
    assert len(backend.submitted) == before, "bad input reached the backend"


def test_malformed_bodies_and_routes(url: str, backend: ScriptedBackend) -> None:
    before = len(backend.submitted)
    for raw in (b"{not json", b"", b"\xff\xfe", b'{"prompt": "hi",}'):
        _check_error(httpx.post(f"{url}/v1/completions", content=raw), 400)
        _check_error(httpx.post(f"{url}/v1/chat/completions", content=raw), 400)
    _check_error(httpx.post(f"{url}/v1/nothing", json={}), 404)
    _check_error(httpx.get(f"{url}/v1/completions"), 405)
    assert len(backend.submitted) == before


def test_openai_client_sees_bad_request(url: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _client(url).completions.create(model="tiny", prompt="hi", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        _client(url).chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])


def test_models_and_health(url: str, backend: ScriptedBackend, scripted: Callable[..., None]) -> None:
    models = _client(url).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/ready").status_code == 200
    backend.ready = False
    assert httpx.get(f"{url}/health").json() == {"status": "ok", "ready": False, "healthy_workers": 0}
    not_ready = httpx.get(f"{url}/ready")  # liveness holds, readiness does not
    assert not_ready.status_code == 503 and int(not_ready.headers["retry-after"]) >= 1


def test_backend_refusals(url: str, backend: ScriptedBackend, scripted: Callable[..., None]) -> None:
    backend.refuse = Overloaded("queue full", retry_after=3.2)
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"})
    _check_error(response, 429)
    assert response.headers["retry-after"] == "4"
    backend.refuse = Unavailable("no healthy decode worker")
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert "decode" in _check_error(response, 503)["message"]
    assert int(response.headers["retry-after"]) >= 1


def test_worker_error(url: str, scripted: Callable[..., None], tokenizer: Tokenizer) -> None:
    def script(job: Job) -> list[Step]:
        return [
            (0, TokenDelta(request_id="", token_ids=_ids(tokenizer, "par"))),
            (0, TokenDelta(request_id="", error="rank 3 died")),
        ]

    scripted(script)
    error = _check_error(httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}), 500)
    assert "rank 3 died" in error["message"]
    with pytest.raises(openai.APIError, match="rank 3 died"):
        list(_client(url).completions.create(model="tiny", prompt="hi", stream=True))


def test_failure_folding_a_delta_fails_only_its_request(
    url: str, scripted: Callable[..., None], tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend's sink folds each delta into its choice; what raises there ends that request
    with a 500 (not the backend's message handler), and the next request is served."""
    poison = _ids(tokenizer, "par")
    fold = ChoiceState.update

    def update(state: ChoiceState, delta: TokenDelta) -> ChoiceUpdate:
        if delta.token_ids == poison:
            raise RuntimeError("cannot fold this delta")
        return fold(state, delta)

    monkeypatch.setattr(ChoiceState, "update", update)
    scripted(lambda job: text_deltas([_ids(tokenizer, "ok"), poison, _ids(tokenizer, "ok")]))
    _check_error(httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}), 500)
    scripted(lambda job: text_deltas([_ids(tokenizer, "ok"), _ids(tokenizer, "ok")]))
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "okok", response.text


def test_auth(backend: ScriptedBackend, tokenizer: Tokenizer, scripted: Callable[..., None]) -> None:
    with _server(backend, tokenizer, api_key="sesame") as base:
        before = len(backend.submitted)
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic sesame"}):
            _check_error(httpx.post(f"{base}/v1/completions", json={"prompt": "hi"}, headers=headers), 401)
            _check_error(httpx.get(f"{base}/v1/models", headers=headers), 401)
        assert len(backend.submitted) == before
        with pytest.raises(openai.AuthenticationError):
            _client(base, "wrong").models.list()
        assert _client(base, "sesame").completions.create(model="tiny", prompt="hi").choices[0].text == "ok"
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.get(f"{base}/metrics").status_code == 200


def _reasoning_script(tokenizer: Tokenizer) -> list[Step]:
    groups = [
        _ids(tokenizer, "Let me"),
        _ids(tokenizer, " think"),
        [THINK_END],
        _ids(tokenizer, "The answer"),
        _ids(tokenizer, " is 42"),
    ]
    return text_deltas(groups)


def test_reasoning_content(
    backend: ScriptedBackend, tokenizer: Tokenizer, scripted: Callable[..., None]
) -> None:
    scripted(lambda job: _reasoning_script(tokenizer))
    with _server(backend, tokenizer, reasoning_parser="deepseek-r1") as base:
        client = _client(base)
        messages = [{"role": "user", "content": "6 x 7?"}]
        message = client.chat.completions.create(model="tiny", messages=messages).choices[0].message
        assert message.reasoning_content == "Let me think"  # type: ignore[attr-defined]
        assert message.content == "The answer is 42"
        reasoning, content = "", ""
        for chunk in client.chat.completions.create(model="tiny", messages=messages, stream=True):
            for choice in chunk.choices:
                delta = choice.delta.model_dump()
                assert "</think>" not in (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                reasoning += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
        assert (reasoning, content) == ("Let me think", "The answer is 42")
        completion = client.completions.create(model="tiny", prompt="x", max_tokens=5)
        assert (
            completion.choices[0].text == "Let me think</think>The answer is 42"
        )  # no parser on /v1/completions
    with _server(backend, tokenizer) as base:
        message = _client(base).chat.completions.create(model="tiny", messages=messages).choices[0].message
        assert message.content == "Let me think</think>The answer is 42"


def test_streamed_character_split_across_tokens(
    url: str, tokenizer: Tokenizer, scripted: Callable[..., None]
) -> None:
    assert tokenizer.decode(NI) == "你" and all(tokenizer.decode([t]) == "\ufffd" for t in NI)
    scripted(lambda job: text_deltas([_ids(tokenizer, "Hi "), *[[t] for t in NI], _ids(tokenizer, "!")]))
    pieces = [
        c.choices[0].text
        for c in _client(url).completions.create(model="tiny", prompt="x", stream=True)
        if c.choices
    ]
    assert "".join(pieces) == "Hi 你!"
    assert all("\ufffd" not in p for p in pieces)
    chat = _client(url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], stream=True
    )
    deltas = [c.choices[0].delta.content or "" for c in chat if c.choices]
    assert "".join(deltas) == "Hi 你!" and "你" in deltas


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_never_streamed(
    url: str, tokenizer: Tokenizer, scripted: Callable[..., None], include: bool
) -> None:
    groups = [_ids(tokenizer, "Hello"), _ids(tokenizer, " wor"), _ids(tokenizer, "ld and more")]
    scripted(lambda job: text_deltas(groups))  # the gateway finds "world" itself
    stream = _client(url).completions.create(
        model="tiny",
        prompt="x",
        stream=True,
        stop="world",
        extra_body={"include_stop_str_in_output": include},
    )
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert "".join(pieces) == ("Hello world" if include else "Hello ")
    assert not any("wor" in p for p in pieces[:-1])


def test_timeout(backend: ScriptedBackend, tokenizer: Tokenizer, scripted: Callable[..., None]) -> None:
    scripted(lambda job: [30.0, *text_deltas([[7]])])
    with _server(backend, tokenizer, request_timeout=0.3) as base:
        error = _check_error(httpx.post(f"{base}/v1/completions", json={"prompt": "hi"}), 504)
        assert "timed out" in error["message"]
        assert len(backend.aborted) == 1
        job = backend.submitted[-1]
        assert job.deadline == pytest.approx(job.arrival_time + 0.3)
        with pytest.raises(openai.APIError, match="timed out"):
            list(
                _client(base).chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "x"}], stream=True
                )
            )
        assert len(backend.aborted) == 2


def test_request_ids(
    url: str, backend: ScriptedBackend, tokenizer: Tokenizer, scripted: Callable[..., None]
) -> None:
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, headers={"X-Request-Id": "abc-123"})
    assert response.json()["id"] == "cmpl-abc-123" == response.headers["x-request-id"]
    assert backend.submitted[-1].request_id == "cmpl-abc-123"
    chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert chat.json()["id"].startswith("chatcmpl-")
    scripted(lambda job: [2.0, *text_deltas([[7]])])
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={"prompt": "a", "stream": True}, headers={"X-Request-Id": "dup"}
    ):
        second = httpx.post(f"{url}/v1/completions", json={"prompt": "b"}, headers={"X-Request-Id": "dup"})
        assert _check_error(second, 400)["code"] == "duplicate_request_id"


def test_echo_and_array_prompts(url: str, backend: ScriptedBackend, tokenizer: Tokenizer) -> None:
    result = _client(url).completions.create(model="tiny", prompt=["one", "two"], echo=True, n=2)
    assert [c.text for c in result.choices] == ["oneok", "oneok", "twook", "twook"]
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    jobs = backend.submitted[-2:]
    assert [j.prompt_token_ids for j in jobs] == [tokenizer.encode("one"), tokenizer.encode("two")]
    assert all(j.params.n == 2 for j in jobs)
    assert result.usage is not None and result.usage.completion_tokens == 4


def test_chat_template_override(backend: ScriptedBackend, tokenizer: Tokenizer, tmp_path: Path) -> None:
    template = tmp_path / "r1.jinja"
    template.write_text(
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{{ '<think>\\n' }}"
    )
    with _server(backend, tokenizer, chat_template=template) as base:
        usage = (
            _client(base)
            .chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hey"}])
            .usage
        )
    expected = tokenizer.encode(tokenizer.bos_token + "[user]hey<think>\n", add_special_tokens=False)
    assert backend.submitted[-1].prompt_token_ids == expected
    assert usage is not None and usage.prompt_tokens == len(expected)


def test_streaming_wire_format(url: str) -> None:
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = "".join(response.iter_text())
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    bodies = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert bodies[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert bodies[-2]["choices"][0]["finish_reason"] == "stop"
    assert bodies[-1]["choices"] == [] and bodies[-1]["usage"]["completion_tokens"] == 1


def test_sampling_fields_reach_the_job(url: str, backend: ScriptedBackend) -> None:
    _client(url).completions.create(
        model="tiny", prompt="hi", n=2, temperature=0.7, top_p=0.9, seed=11, stop=["a", "b"], max_tokens=5,
        presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"17": -100, "18": 3}, logprobs=3,
        extra_body={
            "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "stop_token_ids": [9], "ignore_eos": True,
            "skip_special_tokens": False, "prompt_logprobs": 1,
        },
    )  # fmt: skip
    assert backend.submitted[-1].params == SamplingParams(
        n=2, temperature=0.7, top_p=0.9, seed=11, stop=["a", "b"], max_tokens=5, presence_penalty=0.5,
        frequency_penalty=-0.5, logit_bias={17: -100, 18: 3}, logprobs=3, top_k=40, min_p=0.05,
        repetition_penalty=1.1, stop_token_ids=[9], ignore_eos=True, skip_special_tokens=False, prompt_logprobs=1,
    )  # fmt: skip
    messages = [{"role": "user", "content": "hi"}]
    _client(url).chat.completions.create(
        model="tiny", messages=messages, max_tokens=3, max_completion_tokens=7, logprobs=True, top_logprobs=2,
        extra_body={"top_k": 10**12},
    )  # fmt: skip
    params = backend.submitted[-1].params
    assert (params.max_tokens, params.logprobs, params.top_k) == (7, 2, 0)
    _client(url).chat.completions.create(model="tiny", messages=messages)
    params = backend.submitted[-1].params
    assert (params.max_tokens, params.logprobs, params.temperature, params.n) == (None, None, 1.0, 1)
    job = backend.submitted[-1]
    assert job.deadline == pytest.approx(job.arrival_time + GatewayArgs().request_timeout)


def test_metrics_registry_is_per_app(backend: ScriptedBackend, tokenizer: Tokenizer) -> None:
    apps = [build_app(backend, tokenizer, GatewayArgs(model="tiny"), VOCAB) for _ in range(2)]
    registries = [app.state.gateway.metrics.registry for app in apps]
    assert registries[0] is not registries[1]
    assert not any(m.name.startswith("dsinfer") for m in prometheus_client.REGISTRY.collect())
